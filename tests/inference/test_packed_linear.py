"""oneDNN-packed linears for CPU inference: same numbers as nn.Linear, same translations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nmt.config import model_preset
from nmt.inference import packed_linear
from nmt.inference.decoding import DecodingWorkspace
from nmt.inference.packed_linear import PackedLinear, available, is_packed, pack_for_inference
from nmt.inference.search import beam_search, max_output_lengths
from nmt.model.transformer import Transformer
from nmt.special_ids import EOS_ID, PAD_ID

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_onednn = pytest.mark.skipif(not available(torch.float32),
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
    if not available(torch.bfloat16):
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
    assert pack_for_inference(packed) == n_linear
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert is_packed(packed) and not is_packed(plain)
    plain_space, packed_space = DecodingWorkspace(plain), DecodingWorkspace(packed)
    assert plain_space.projection is None
    assert packed_space.projection is not None  # the shared output matrix, packed too
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
    assert pack_for_inference(half) == 0
    assert any(type(m) is nn.Linear for m in half.modules())
    assert DecodingWorkspace(half).projection is None
    monkeypatch.setenv("NMT_PACKED_LINEAR", "0")  # read when used: no cache to clear
    model = tiny_model()
    assert pack_for_inference(model) == 0
    assert DecodingWorkspace(model).projection is None
    monkeypatch.delenv("NMT_PACKED_LINEAR")
    assert pack_for_inference(model) > 0


def test_unavailable_ops_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the private oneDNN ops fail (older or other torch builds), nothing is packed."""

    def broken(*_args: object) -> torch.Tensor:
        raise RuntimeError("no oneDNN here")

    packed_linear.works.cache_clear()
    monkeypatch.setattr(packed_linear, "_pack", broken)
    try:
        assert not available(torch.float32)
        assert pack_for_inference(tiny_model()) == 0
    finally:
        monkeypatch.undo()
        packed_linear.works.cache_clear()
