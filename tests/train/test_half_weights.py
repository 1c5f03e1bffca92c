"""Training on a bf16 copy with fp32 master weights (nmt/train/half.py): the copy follows
the master, its padded output rows change nothing (the same loss and gradients as the
unpadded model, in fp32 to the last rounding), no autocast cast of a weight is left, and
300 CPU updates track the autocast path's losses within bf16 noise with checkpoints in
fp32 at the vocabulary's size."""

from __future__ import annotations

import pytest
import torch
from helpers.data import make_copy_data

import nmt.train.loop as loop
from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.data.batching import Batch
from nmt.model.transformer import Transformer
from nmt.train.feed import to_device
from nmt.train.half import HalfWeights, padded_vocab, use_half_weights
from nmt.train.loss import target_positions
from nmt.train.step import LossOptions, micro_loss

VOCAB = 1000  # padded to 1024


def _micro(vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, 7), generator=gen)
    ids[2, 5:] = 0  # PAD
    lens = torch.tensor([7, 7, 5])
    batch = Batch(ids, ids.clone(), ids.clone(), int(lens.sum()), int(lens.sum()))
    select = torch.from_numpy(target_positions(lens.numpy(), 7))
    return to_device(batch, True, select, torch.device("cpu"))


def test_padded_vocab_rounds_up_to_64() -> None:
    assert [padded_vocab(v) for v in (1, 64, 65, 1000, 37000)] == [64, 64, 128, 1024, 37056]


def test_copy_follows_master_and_its_padded_rows_stay_zero() -> None:
    torch.manual_seed(0)
    master = Transformer(model_preset("tiny", vocab_size=VOCAB))
    half = HalfWeights(master, pad_vocab=True)
    emb = half.model.embed.weight
    assert emb.shape == (1024, master.config.d_model) and emb.dtype == torch.bfloat16
    assert torch.equal(emb[:VOCAB], master.embed.weight.to(torch.bfloat16))
    assert not emb[VOCAB:].any()
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.5)
    half.refresh()
    for p, q in zip(master.parameters(), half.model.parameters(), strict=True):
        assert torch.equal(q[:p.size(0)], p.to(torch.bfloat16))
    assert not half.model.embed.weight[VOCAB:].any()
    assert all(p.dtype == torch.float32 for p in master.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_padded_rows_change_neither_loss_nor_gradients(fused: bool) -> None:
    """An fp32 copy with the output matrix padded to 1024 rows: the loss and the gradients
    gathered into the master equal the master's own, and the padded rows get none."""
    torch.manual_seed(0)
    master = Transformer(model_preset("tiny", vocab_size=VOCAB, dropout=0.0)).train()
    opts = LossOptions(0.1, master.config.pad_id, fused=fused)
    mb = _micro()
    loss, nll = micro_loss(master, master, mb, opts)
    loss.backward()
    want = {n: p.grad.clone() for n, p in master.named_parameters()}
    master.zero_grad(set_to_none=True)

    half = HalfWeights(master, dtype=torch.float32, pad_vocab=True)
    loss2, nll2 = micro_loss(half.model, half.model, mb, opts)
    loss2.backward()
    assert not half.model.embed.weight.grad[VOCAB:].any()
    half.gather()
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll2, nll, rtol=1e-6, atol=1e-5)
    for n, p in master.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert all(q.grad is None for q in half.model.parameters())


def test_auto_is_bf16_on_cuda_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_half_weights("auto", cuda, "bf16") and not use_half_weights("auto", cpu, "bf16")
    assert use_half_weights("on", cpu, "bf16") and not use_half_weights("on", cpu, "fp16")
    assert not use_half_weights("off", cuda, "bf16")


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    return make_copy_data(tmp_path_factory.mktemp("data") / "copy", n_train=400, n_valid=20)


def _train(data, run, half: str):
    torch.set_num_threads(1)
    cfg = TrainConfig(max_updates=300, max_tokens=256, warmup=50, max_len=16, log_interval=1,
                      valid_interval=1000, save_interval_minutes=0, seed=5,
                      precision="bf16", half_weights=half)
    trainer = loop.Trainer(data, run, model_preset("tiny"), cfg, "cpu", progress=False)
    assert (trainer.half is not None) is (half == "on")
    return trainer.run()


@pytest.mark.slow
def test_300_updates_track_autocast_within_bf16_noise(copy_data, tmp_path) -> None:
    """The same run (seed, batches, dropout) under autocast and on a bf16 copy: the loss
    curves agree to bf16 noise, update by update and at the end; the checkpoint holds fp32
    weights at the vocabulary's own size."""
    auto = _train(copy_data, tmp_path / "autocast", "off").losses
    half = _train(copy_data, tmp_path / "half", "on").losses
    assert len(auto) == len(half) == 300
    assert auto[-1] < 0.6 * auto[0]  # it learned
    diffs = [abs(a - b) for a, b in zip(auto, half, strict=True)]
    assert max(diffs[:20]) < 0.02  # from the same weights: rounding only
    tail_a, tail_h = sum(auto[-50:]) / 50, sum(half[-50:]) / 50
    assert abs(tail_a - tail_h) < 0.05 * tail_a
    ckpt = load_checkpoint(tmp_path / "half" / "checkpoint_last.pt")
    weights = ckpt["model"]
    assert weights["embed.weight"].dtype == torch.float32
    assert weights["embed.weight"].size(0) == ckpt["model_config"]["vocab_size"]


def test_rows_linear_copy_computes_the_same_function() -> None:
    """The CUDA copy's linears keep their weights transposed: the same outputs and the same
    gathered gradients as the plain fp32 model, the weights' gradients in their layout."""
    torch.manual_seed(0)
    master = Transformer(model_preset("tiny", vocab_size=VOCAB, dropout=0.0)).train()
    opts = LossOptions(0.1, master.config.pad_id)
    mb = _micro()
    loss, _ = micro_loss(master, master, mb, opts)
    loss.backward()
    want = {n: p.grad.clone() for n, p in master.named_parameters()}
    master.zero_grad(set_to_none=True)
    half = HalfWeights(master, dtype=torch.float32, pad_vocab=True, rows_linears=True)
    qkv = half.model.encoder[0].self_attn.qkv
    assert qkv.weight.shape == master.encoder[0].self_attn.qkv.weight.shape[::-1]
    loss2, _ = micro_loss(half.model, half.model, mb, opts)
    loss2.backward()
    assert qkv.weight.grad.is_contiguous()
    half.gather()
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-5)
    for n, p in master.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
    with torch.no_grad():
        master.encoder[0].self_attn.qkv.weight.mul_(2)
    half.refresh()
    assert torch.equal(qkv.weight.t(), master.encoder[0].self_attn.qkv.weight)


def test_backward_into_fp32_buffers_equals_accumulated_grads() -> None:
    """One process: each micro-batch's gradients go straight into the fp32 buffers
    (autograd.grad, no `.grad` on the copy); over two micro-batches the master gets the
    same gradients as the fp32 model's own accumulated backward, in its layout, and the
    next update starts from them afresh (copied, not added)."""
    torch.manual_seed(0)
    master = Transformer(model_preset("tiny", vocab_size=VOCAB, dropout=0.0)).train()
    opts = LossOptions(0.1, master.config.pad_id)
    first, second = _micro(), _micro()
    second.batch.src[0, :3] = 5  # a different batch
    for mb in (first, second):
        micro_loss(master, master, mb, opts)[0].backward()
    want = {n: p.grad.clone() for n, p in master.named_parameters()}
    master.zero_grad(set_to_none=True)
    half = HalfWeights(master, dtype=torch.float32, pad_vocab=True, rows_linears=True)
    for _ in range(2):  # two updates: the second must not add to the first's sums
        for mb in (first, second):
            half.backward(micro_loss(half.model, half.model, mb, opts)[0])
        assert all(q.grad is None for q in half.model.parameters())
        half.gather()
        for n, p in master.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
        master.zero_grad(set_to_none=True)


def test_backward_leaves_a_parameter_no_micro_batch_used_without_gradient() -> None:
    torch.manual_seed(0)
    master = Transformer(model_preset("tiny", vocab_size=VOCAB, dropout=0.0)).train()
    master.register_parameter("unused", torch.nn.Parameter(torch.zeros(3)))
    half = HalfWeights(master, dtype=torch.float32)
    opts = LossOptions(0.1, master.config.pad_id)
    half.backward(micro_loss(half.model, half.model, _micro(), opts)[0])
    half.gather()
    assert master.unused.grad is None and master.embed.weight.grad is not None
