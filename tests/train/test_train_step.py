"""nmt/train/step.py: the training update as a function, the one `nmt train` and the
benches run."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import VOCAB, make_model, random_batch

from nmt.data.batching import Batch
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID
from nmt.precision import grad_scaler
from nmt.train.feed import Micro
from nmt.train.loss import label_smoothed_nll
from nmt.train.schedule import InverseSqrtSchedule, build_optimizer
from nmt.train.step import LossOptions, StepStats, advance, apply_update, train_step

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src (3, 6), tgt_in (3, 7) = BOS + pieces, tgt_out (3, 7) = pieces + EOS, padded."""
    src = random_batch([6, 3, 5], seed=0)
    tgt_out = random_batch([7, 4, 2], seed=1)
    tgt_in = torch.where(tgt_out == EOS_ID, PAD_ID, tgt_out).roll(1, dims=1)
    tgt_in[:, 0] = BOS_ID
    return src, tgt_in, tgt_out


def micro_of(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> Micro:
    tokens = int((tgt_out != 0).sum())
    return Micro(Batch(src, tgt_in, tgt_out, int((src != 0).sum()), tokens),
                 has_pad=bool((src == 0).any()), select=None, target=tgt_out)


def test_one_update_equals_the_written_out_update() -> None:
    """train_step + apply_update + advance make exactly the update written out by hand:
    forward, smoothed loss / target tokens, backward, Adam step, schedule step."""
    from nmt.config import TrainConfig

    torch.manual_seed(0)
    model = make_model().train()
    twin = copy.deepcopy(model)
    src, tgt_in, tgt_out = batch()
    tokens = int((tgt_out != 0).sum())
    cfg = TrainConfig()

    optimizer = build_optimizer(model.parameters(), cfg, CPU)
    schedule = InverseSqrtSchedule(optimizer, 32, 10)
    scaler = grad_scaler(CPU, enabled=False)
    torch.manual_seed(5)  # dropout masks
    stats = train_step(model, model, [micro_of(src, tgt_in, tgt_out)], tgt_tokens=tokens,
                       optimizer=optimizer, scaler=scaler, precision="fp32",
                       loss=LossOptions(0.1, 0))
    assert isinstance(stats, StepStats)
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0
               for t in (stats.loss_sum, stats.nll_sum, stats.grad_norm))
    apply_update(optimizer, scaler, finite=True)
    advance(schedule, None, finite=True)

    ref_opt = build_optimizer(twin.parameters(), cfg, CPU)
    ref_schedule = InverseSqrtSchedule(ref_opt, 32, 10)
    torch.manual_seed(5)
    loss, nll = label_smoothed_nll(twin(src, tgt_in), tgt_out, 0.1, 0)
    (loss * (1.0 / tokens)).backward()
    norm = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in twin.parameters() if p.grad is not None]))
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    ref_schedule.step()

    assert stats.loss_sum.item() == loss.item() and stats.nll_sum.item() == nll.item()
    assert stats.grad_norm.item() == pytest.approx(norm.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert schedule.step_count == ref_schedule.step_count == 1
    assert all(p.grad is None for p in model.parameters())


def test_a_non_finite_update_changes_no_weight_and_no_schedule() -> None:
    torch.manual_seed(1)
    model = make_model().train()
    before = copy.deepcopy(model.state_dict())
    from nmt.config import TrainConfig

    optimizer = build_optimizer(model.parameters(), TrainConfig(), CPU)
    schedule = InverseSqrtSchedule(optimizer, 32, 10)
    scaler = grad_scaler(CPU, enabled=False)
    src, tgt_in, tgt_out = batch()
    train_step(model, model, [lambda: micro_of(src, tgt_in, tgt_out)],  # lazy, as the feed
               tgt_tokens=int((tgt_out != 0).sum()), optimizer=optimizer, scaler=scaler,
               precision="fp32", loss=LossOptions(0.1, 0), clip_norm=1.0)
    apply_update(optimizer, scaler, finite=False)
    advance(schedule, None, finite=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert schedule.step_count == 0 and all(p.grad is None for p in model.parameters())


def test_fused_projected_loss_gives_the_reference_loss() -> None:
    """LossOptions(fused=True) (the GPU path: decoder states, chunked projection) and the
    logits path give the same loss and gradient norm."""
    from nmt.config import TrainConfig

    src, tgt_in, tgt_out = batch()
    tokens = int((tgt_out != 0).sum())
    results = []
    for fused in (False, True):
        torch.manual_seed(2)
        model = make_model(dropout=0.0).train()
        optimizer = build_optimizer(model.parameters(), TrainConfig(), CPU)
        stats = train_step(model, model, [micro_of(src, tgt_in, tgt_out)], tgt_tokens=tokens,
                           optimizer=optimizer, scaler=grad_scaler(CPU, enabled=False),
                           precision="fp32", loss=LossOptions(0.1, 0, fused=fused,
                                                              chunk_rows=7))
        results.append((stats.loss_sum.item(), stats.grad_norm.item()))
    assert results[0] == pytest.approx(results[1], rel=1e-5)
    assert VOCAB > 7  # several chunks
