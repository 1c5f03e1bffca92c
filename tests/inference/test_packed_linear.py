"""oneDNN-packed linears for CPU inference: same numbers as nn.Linear, same translations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nmt.config import model_preset
from nmt.inference import backends, packed_linear
from nmt.inference.decoding import DecodingWorkspace
from nmt.inference.mkl_linear import MklLinear
from nmt.inference.packed_linear import PackedLinear, works
from nmt.inference.search import beam_search, max_output_lengths
from nmt.model.transformer import Transformer
from nmt.special_ids import EOS_ID, PAD_ID

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_onednn = pytest.mark.skipif(not works(torch.float32),
                                  reason="this torch/CPU has no working oneDNN linear ops")


def tiny_model(seed: int = 0, vocab: int = 60) -> Transformer:
    torch.manual_seed(seed)
    cfg = model_preset("tiny", vocab_size=vocab)
    return Transformer(cfg).eval()


def sources(seed: int, vocab: int = 60) -> torch.Tensor:
    """A right-padded batch (5, 9) of different lengths, EOS-terminated."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [8, 3, 5, 1, 6]
    src = torch.full((len(lengths), max(lengths) + 1), PAD_ID)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, vocab, (n,), generator=gen)
        src[row, n] = EOS_ID
    return src


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 32), (3, 5, 32), (1, 1, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_nn_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=bias)
    x = torch.randn(*shape)
    packed = PackedLinear(linear.weight, linear.bias)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == want.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a snapshot: later changes to the layer do not reach the packed copy
    with torch.no_grad():
        linear.weight.zero_()
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_bf16_linear_equals_nn_linear() -> None:
    if not works(torch.bfloat16):
        pytest.skip("oneDNN bf16 linear unavailable here")
    torch.manual_seed(0)
    linear = nn.Linear(64, 40).to(torch.bfloat16)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(linear.weight, linear.bias)(x), linear(x),
                               rtol=2e-2, atol=2e-2)


@needs_onednn
def test_packed_model_translates_like_the_plain_one() -> None:
    plain = tiny_model()
    packed = tiny_model()
    n_linear = sum(type(m) is nn.Linear for m in packed.modules())
    projection = backends.prepare(packed, "fp32")
    assert sum(isinstance(m, PackedLinear | MklLinear) for m in packed.modules()) == n_linear
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(projection, PackedLinear | MklLinear)  # the shared output matrix too
    plain_space, packed_space = DecodingWorkspace(plain), DecodingWorkspace(packed, projection)
    assert plain_space.projection is None
    # No linear weight is a parameter any more; the shared embedding still is.
    assert set(packed.state_dict()) <= set(plain.state_dict())
    assert "embed.weight" in packed.state_dict()
    for seed in range(3):
        src = sources(seed)
        with torch.inference_mode():
            logits_plain = plain(src, src)
            logits_packed = packed(src, src)
            torch.testing.assert_close(logits_packed, logits_plain, rtol=1e-4, atol=1e-4)
            max_lens = max_output_lengths(src, 1.0, 5)
            with plain_space.decoder(src) as decoder:
                want = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
            with packed_space.decoder(src) as decoder:
                got = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
        assert [[h.tokens for h in row] for row in got] == \
            [[h.tokens for h in row] for row in want]
        for row_got, row_want in zip(got, want, strict=True):
            for g, w in zip(row_got, row_want, strict=True):
                assert g.score == pytest.approx(w.score, abs=1e-4)


def test_nothing_packed_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    half = tiny_model().to(torch.float16)
    assert backends.prepare(half, "fp16") is None
    assert any(type(m) is nn.Linear for m in half.modules())
    model = tiny_model()
    with monkeypatch.context() as patch:  # a column whose fp32 cell is PyTorch's alone
        patch.setitem(backends.TABLE, ("linear", "fp32"), (("torch",),) * 6)
        assert backends.prepare(model, "fp32") is None
        assert all(type(m) is not PackedLinear for m in model.modules())
    if works(torch.float32):
        assert backends.prepare(model, "fp32") is not None


def test_unavailable_ops_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the private oneDNN ops fail (older or other torch builds), nothing is packed
    (on an AMD CPU: MKL's layers are for Intel's)."""

    def broken(*_args: object) -> torch.Tensor:
        raise RuntimeError("no oneDNN here")

    packed_linear.works.cache_clear()
    monkeypatch.setattr(packed_linear, "_pack", broken)
    monkeypatch.setattr(backends, "column", lambda: "amd-avx512")
    try:
        assert not works(torch.float32)
        model = tiny_model()
        assert backends.prepare(model, "fp32") is None
        assert any(type(m) is nn.Linear for m in model.modules())
    finally:
        monkeypatch.undo()
        packed_linear.works.cache_clear()
