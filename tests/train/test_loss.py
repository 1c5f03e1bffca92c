"""Label-smoothed cross-entropy against a hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.models import tiny_model_batch

from nmt.train import loss as loss_module
from nmt.train.loss import label_smoothed_nll, smoothed_cross_entropy, target_positions

pytestmark = pytest.mark.isa  # kernel numerics: CI runs these again at AVX2


def test_matches_hand_computation_and_ignores_pad():
    logits = torch.tensor([[[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0], [9.0, 9.0, 9.0, 9.0]]])
    target = torch.tensor([[1, 2, 0]])  # last position is PAD (id 0)
    eps, vocab = 0.1, 4
    loss, nll = label_smoothed_nll(logits, target, eps, pad_id=0)
    hand_loss = hand_nll = 0.0
    for row, gold in ((logits[0, 0].tolist(), 1), (logits[0, 1].tolist(), 2)):
        log_z = math.log(sum(math.exp(x) for x in row))
        logp = [x - log_z for x in row]
        q = [eps / (vocab - 1)] * vocab
        q[gold] = 1 - eps
        hand_loss += -sum(qi * lp for qi, lp in zip(q, logp, strict=True))
        hand_nll += -logp[gold]
    assert math.isclose(loss.item(), hand_loss, rel_tol=1e-6)
    assert math.isclose(nll.item(), hand_nll, rel_tol=1e-6)


def test_no_smoothing_is_plain_nll_and_grad_flows():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    target = torch.tensor([[3, 4, 0], [5, 0, 0]])
    loss, nll = label_smoothed_nll(logits, target, 0.0, pad_id=0)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), target.reshape(-1),
                                            ignore_index=0, reduction="sum")
    assert torch.allclose(loss, ref) and torch.allclose(nll, ref)
    loss.backward()
    assert logits.grad[1, 1].abs().sum() == 0  # PAD positions get no gradient


def test_bf16_logits_give_fp32_loss():
    logits = torch.randn(1, 2, 5).bfloat16()
    loss, _ = label_smoothed_nll(logits, torch.tensor([[1, 2]]), 0.1, pad_id=0)
    assert loss.dtype == torch.float32


def _reference(logits, target, eps, pad):
    """The straightforward log_softmax formulation the fused function replaces."""
    vocab = logits.size(-1)
    lprobs = torch.log_softmax(logits.double().reshape(-1, vocab), dim=-1)
    flat = target.reshape(-1)
    keep = flat != pad
    nll = -lprobs.gather(-1, flat[:, None]).squeeze(-1)[keep].sum()
    smooth = -lprobs.sum(-1)[keep].sum()
    eps_i = eps / (vocab - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fused_loss_and_gradient_match_log_softmax_reference(eps):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(1, 11, (3, 5), generator=gen)
    target[0, 3:] = 0
    target[2, 1:] = 0
    ours_in = base.clone().requires_grad_(True)
    ref_in = base.clone().requires_grad_(True)
    loss, nll = label_smoothed_nll(ours_in, target, eps, pad_id=0)
    ref_loss, ref_nll = _reference(ref_in, target, eps, 0)
    (loss * 0.7).backward()
    (ref_loss * 0.7).backward()
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-6)
    assert torch.allclose(nll.double(), ref_nll, rtol=1e-6)
    assert torch.allclose(ours_in.grad, ref_in.grad, atol=1e-6)
    assert ours_in.grad[2, 1:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cpu_row_blocks_give_each_row_the_same_numbers(monkeypatch, dtype, eps):
    """Blocks of 3 rows (a 7-row remainder, a block of PAD rows): loss, NLL and every
    gradient element as the log_softmax reference, and bit-equal to one block."""
    gen = torch.Generator().manual_seed(1)
    base = (torch.randn(4, 10, 37, generator=gen) * 3).to(dtype)
    target = torch.randint(1, 37, (4, 10), generator=gen)
    target[1, 4:] = 0
    target[3, :] = 0

    def run(block_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(loss_module, "CPU_BLOCK_BYTES", block_bytes)
        x = base.clone().requires_grad_(True)
        loss, nll = label_smoothed_nll(x, target, eps, pad_id=0)
        (loss * 0.3).backward()
        return loss, nll, x.grad

    assert len(loss_module._blocks(torch.empty(40, 37))) == 1
    one_loss, one_nll, one_grad = run(1 << 20)
    monkeypatch.setattr(loss_module, "CPU_BLOCK_BYTES", 3 * 4 * 37)
    assert [b.stop - b.start for b in loss_module._blocks(torch.empty(40, 37))] == [3] * 13 + [1]
    loss, nll, grad = run(3 * 4 * 37)
    assert grad.dtype == dtype and torch.equal(grad, one_grad)
    torch.testing.assert_close(loss, one_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(nll, one_nll, rtol=1e-6, atol=0)
    ref_in = base.double().requires_grad_(True)
    ref_loss, ref_nll = _reference(ref_in, target, eps, 0)
    (ref_loss * 0.3).backward()
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-5)
    assert torch.allclose(nll.double(), ref_nll, rtol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.double(), ref_in.grad, atol=tol, rtol=tol)
    assert grad[3].abs().sum() == 0 and grad[1, 4:].abs().sum() == 0


def test_gradcheck_on_rows():
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, 5, 0, 3])
    assert torch.autograd.gradcheck(
        lambda x: smoothed_cross_entropy(x, target, 0.1)[0], (logits,))


def test_bf16_gradient_has_logits_dtype():
    logits = torch.randn(6, 9).bfloat16().requires_grad_(True)
    loss, _ = smoothed_cross_entropy(logits, torch.arange(6), 0.1)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_target_positions_pick_real_tokens_of_right_padded_rows():
    lengths = np.array([3, 1, 4])
    rows = target_positions(lengths, 4)
    assert rows.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert target_positions(np.array([4, 4]), 4) is None
    tgt = torch.tensor([[5, 6, 3, 0], [3, 0, 0, 0], [7, 8, 9, 3]])
    assert tgt.reshape(-1)[torch.from_numpy(rows)].ne(0).all()
    assert int(tgt.ne(0).sum()) == rows.size


def test_projecting_only_real_targets_gives_the_full_loss_and_gradients():
    """The loop's path (model(select=...) + fused loss on real rows) equals the plain one
    (all positions projected, log_softmax reference ignoring PAD): loss and every grad."""
    model, src, tgt_in, tgt_out, select = tiny_model_batch()
    loss, _ = label_smoothed_nll(model(src, tgt_in, select=select),
                                 tgt_out.reshape(-1)[select], 0.1, 0)
    loss.backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    ref, _ = _reference(model(src, tgt_in), tgt_out, 0.1, 0)
    ref.backward()
    assert torch.allclose(loss.double(), ref)
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, atol=1e-10), k


def test_auto_precision_resolves_per_device() -> None:
    """`auto` is bf16 only where the hardware does bf16 natively and faster than fp32;
    explicit values pass."""
    import torch

    from nmt.precision import cpu_bf16_pays, resolve_precision

    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == ("bf16" if cpu_bf16_pays() else "fp32")
    for explicit in ("fp32", "bf16", "fp16"):
        assert resolve_precision(explicit, cpu) == explicit
