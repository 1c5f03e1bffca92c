"""Incremental decoding's paths (nmt/inference/layer_step.py) against the network as the paper
writes it (nmt/model): every way a step can run gives the logits of the model's own
teacher-forced forward, and the inference encoder its encoder.

The paths: the C attention and add + LayerNorm kernels or PyTorch's ops (NMT_KERNELS=0); every
row fed or only the live ones (a finished sentence left in the cache); float32 exactly to
float rounding, bfloat16 to a stated tolerance. The native C step and the int8 layers are
held to these paths in test_native_step.py and test_int8_*.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_model, random_batch

from nmt.inference import add_norm, fused_attention
from nmt.inference.decoding import ModelStepDecoder, decode_step, init_state
from nmt.inference.layer_step import (
    additive_mask,
    attend_one,
    attention_weights,
    encoder_layer,
    softmax_keys,
)

pytestmark = pytest.mark.isa  # kernel numerics: CI runs these again at AVX2

# (rtol, atol) of a path against the reference: float32 rounding, or bfloat16's 8 bits.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 8e-2)}


@pytest.fixture(params=["kernels", "pytorch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C kernels where they load, or PyTorch's ops alone."""
    for kernel in (fused_attention.KERNEL, add_norm.KERNEL):
        kernel.forget()
    if request.param == "pytorch":
        monkeypatch.setenv("NMT_KERNELS", "0")
    yield request.param
    for kernel in (fused_attention.KERNEL, add_norm.KERNEL):
        kernel.forget()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_step_equals_the_teacher_forced_forward(path: str, dtype: torch.dtype) -> None:
    assert fused_attention.enabled() == (path == "kernels" and
                                         fused_attention.KERNEL.status().level is not None)
    model = make_model(seed=4).to(dtype)
    src = random_batch([6, 3, 5], seed=21)
    tgt = random_batch([9, 9, 9], seed=22, bos=True)
    want = model(src, tgt).float()  # (batch, tgt_len, vocab): the reference
    rtol, atol = TOLERANCE[dtype]
    enc = model.encode(src, layer_step=encoder_layer)
    torch.testing.assert_close(enc.states.float(), model.encode(src).states.float(),
                               rtol=rtol, atol=atol)
    state = init_state(model, enc)
    for t in range(tgt.size(1)):
        got = decode_step(model, tgt[:, t], state).float()  # (batch, vocab)
        torch.testing.assert_close(got, want[:, t], rtol=rtol, atol=atol)


@torch.no_grad()
def test_live_rows_alone_equal_every_row_fed(path: str) -> None:
    """A beam of 2 per sentence, the first sentence's rows finished after step 2: feeding
    only the live rows gives their logits of feeding every row."""
    model = make_model(seed=5)
    src = random_batch([6, 4], seed=31)
    tgt = random_batch([7, 7], seed=32, bos=True).repeat_interleave(2, dim=0)  # (4, 7)
    want = model(src.repeat_interleave(2, dim=0), tgt).float()
    decoder = ModelStepDecoder(model, src)
    decoder.regroup(torch.tensor([0, 0, 1, 1]), 2, torch.tensor([0, 1]))
    live = torch.tensor([2, 3])
    for t in range(tgt.size(1)):
        if t < 3:
            got = decoder.step(tgt[:, t]).float()  # (4, vocab)
            torch.testing.assert_close(got, want[:, t], rtol=1e-4, atol=1e-5)
        else:
            got = decoder.step_rows(tgt[live, t], live, 4).float()  # (2, vocab)
            torch.testing.assert_close(got, want[live, t], rtol=1e-4, atol=1e-5)
    decoder.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_one_with_transposed_keys_equals_sdpa_at_every_key_count(dtype) -> None:
    """attend_one (keys given transposed; softmax written out below 16 keys, where torch's
    CPU kernel is scalar) against SDPA, for 1..40 keys, with a mask hiding some keys."""
    torch.manual_seed(0)
    for keys in range(1, 41):
        q = torch.randn(5, 4, 3, 16)
        k, v = torch.randn(5, 4, keys, 16), torch.randn(5, 4, keys, 16)
        mask = torch.rand(5, 1, 3, keys) > 0.3
        mask[..., 0] = True  # every query sees a key
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = attend_one(q.to(dtype), k.transpose(-1, -2).contiguous().to(dtype), v.to(dtype),
                         mask)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        scores = torch.randn(7, keys).to(dtype)
        torch.testing.assert_close(softmax_keys(scores.clone()).float(),
                                   scores.float().softmax(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_one_additive_mask_equals_boolean_bit_for_bit(dtype) -> None:
    """The caches' additive masks (0 / -inf, built once per step) hide exactly the keys a
    boolean mask hides: the same output to the last bit, from strided (non-contiguous)
    queries as the decoder layers pass them, and through `attention_weights`."""
    torch.manual_seed(0)
    qkv = torch.randn(6 * 4, 3 * 4 * 16).to(dtype)  # rows of a fused projection
    q = qkv[:, : 4 * 16].view(6, 4, 4, 16).transpose(1, 2)  # (b, heads, g, d), strided
    k_t = torch.randn(6, 4, 16, 21).to(dtype)
    v = torch.randn(6, 4, 21, 16).to(dtype)
    mask = torch.rand(6, 1, 4, 21) > 0.4
    mask[..., 3] = True  # every query sees a key
    bias = additive_mask(mask, dtype)
    assert bias.dtype == dtype and bool((bias[mask] == 0).all())
    assert bool(bias[~mask].eq(float("-inf")).all())
    assert torch.equal(attend_one(q, k_t, v, bias), attend_one(q, k_t, v, mask))
    k = k_t.transpose(-1, -2)
    assert torch.equal(attention_weights(q, k, bias, dtype), attention_weights(q, k, mask, dtype))
