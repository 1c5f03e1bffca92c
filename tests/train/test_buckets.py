"""Length buckets for `nmt train --compile` (nmt/train/buckets.py): batches padded to a few
shapes, the model compiled once per bucket with no graph break, the losses those of the
eager model; an all-PAD filler row yields no NaN (the first key stays open)."""

from __future__ import annotations

import pytest
import torch
from helpers.data import make_copy_data

import nmt.train.loop as loop
from nmt.config import TrainConfig, model_preset
from nmt.data.batching import Batch
from nmt.model.paths import cuda_paths
from nmt.model.transformer import Transformer
from nmt.train.buckets import LENGTHS, bucket_length, bucket_rows, pad_to_bucket


def test_bucket_length_is_the_smallest_that_holds_the_batch() -> None:
    assert [bucket_length(w) for w in (1, 8, 9, 33, 65, 250, 256)] == [8, 8, 16, 40, 80, 256,
                                                                       256]
    assert bucket_length(300) == 320  # past the table: multiples of 32
    assert list(LENGTHS) == sorted(LENGTHS)


def test_bucket_rows_hold_every_batch_of_the_bucket() -> None:
    """A batch of width w in (below, L] has at most tokens // w rows <= bucket_rows."""
    for tokens in (256, 4096, 8805):
        for width in range(1, 257):
            length = bucket_length(width)
            assert tokens // width <= bucket_rows(length, tokens)


def test_pad_to_bucket_pads_with_pad_and_keeps_counts() -> None:
    src = torch.tensor([[5, 6, 2], [7, 2, 0]])
    tgt = torch.tensor([[1, 8, 9, 10], [1, 11, 0, 0]])
    batch = Batch(src, tgt, tgt.clone(), 5, 6)
    out = pad_to_bucket(batch)
    assert out.src.shape == out.tgt_in.shape == (2, 8)
    assert torch.equal(out.src[:, :3], src) and not out.src[:, 3:].any()
    assert (out.src_tokens, out.tgt_tokens) == (5, 6)
    static = pad_to_bucket(batch, micro_tokens=64)
    assert static.src.shape == (64, 8) and not static.src[2:].any()


def test_an_all_pad_row_gives_no_nan_on_the_gpu_path() -> None:
    """SDPA over a row whose every key is PAD would be NaN; the mask keeps its first key."""
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny", vocab_size=50)).train()
    src = torch.tensor([[5, 6, 2], [0, 0, 0]])
    tgt = torch.tensor([[1, 7, 8], [0, 0, 0]])
    with cuda_paths():
        out = model(src, tgt, has_pad=True)
        out[0].sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    return make_copy_data(tmp_path_factory.mktemp("data") / "copy", n_train=120, n_valid=10)


def _train(data, run, **kw):
    torch.set_num_threads(1)
    cfg = TrainConfig(max_updates=6, max_tokens=128, warmup=4, max_len=16, log_interval=1,
                      valid_interval=1000, save_interval_minutes=0, seed=2, precision="fp32",
                      **kw)
    model = model_preset("tiny", dropout=0.0)  # the masks would differ with the shapes
    return loop.Trainer(data, run, model, cfg, "cpu", progress=False).run()


@pytest.mark.slow
@pytest.mark.parametrize("static_rows", [False, True])
def test_compiled_once_per_bucket_no_breaks_losses_of_eager(copy_data, tmp_path,
                                                            static_rows: bool) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = _train(copy_data, tmp_path / "eager").losses
    torch._dynamo.reset()
    counters.clear()
    compiled = _train(copy_data, tmp_path / "compiled", compile=True,
                      cuda_graphs=static_rows).losses
    graphs = int(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # copy pairs of 1-10 words + EOS/BOS: buckets 8 and 16, one graph each at most
    assert 1 <= graphs <= 2, graphs
    torch.testing.assert_close(compiled, eager, rtol=2e-4, atol=2e-4)
