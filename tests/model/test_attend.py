"""nmt.model.attention.attend on CPU (softmax written out) against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.model.attention import attend

pytestmark = pytest.mark.isa  # kernel numerics: CI runs these again at AVX2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_equals_sdpa_with_gradients(causal: bool, masked: bool) -> None:
    torch.manual_seed(0)
    b, h, t, d = 3, 2, 7, 8
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = None
    if masked:  # right padding: row r has 7 - r real keys
        lengths = torch.tensor([7, 5, 2])
        mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]  # (b,1,1,t)
    got = attend(q, k, v, mask, causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_attend_bf16_is_close_and_keeps_the_dtype() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(4, 4, 20, 16) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_attention_dropout_keeps_rows_normalised_in_expectation() -> None:
    torch.manual_seed(2)
    q, k = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4)
    v = torch.ones(2, 2, 6, 3)  # output = sum of the kept, rescaled weights
    dropped = attend(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, torch.ones_like(dropped))  # some weights dropped
    runs = torch.stack([attend(q, k, v, dropout_p=0.5) for _ in range(2000)]).mean(0)
    torch.testing.assert_close(runs, torch.ones_like(runs), atol=0.05, rtol=0)


def test_causal_mask_first_built_under_inference_mode_still_trains() -> None:
    """Translating (inference_mode) in a process that later trains, with the same shape:
    the cached causal mask must not be an inference tensor, or backward fails."""
    from nmt.model.attention import _later_keys, masked_scores

    _later_keys.cache_clear()
    q, k = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    with torch.inference_mode():
        masked_scores(q, k, None, is_causal=True)
    q.requires_grad_(True)
    masked_scores(q, k, None, is_causal=True).softmax(-1).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("autocast", [False, True])
def test_sdpa_path_gets_its_mask_additive_once_and_computes_the_cpu_paths_function(
        autocast: bool) -> None:
    """On SDPA's path the padding mask is made additive once per forward, in the dtype
    attention computes in (autocast's bf16 or the weights'), as SDPA would make it in every
    layer; the model's logits equal the CPU path's (boolean mask, softmax written out)."""
    from nmt.config import model_preset
    from nmt.model.attention import additive_mask, key_padding_mask
    from nmt.model.paths import cuda_paths
    from nmt.model.transformer import Transformer

    pad = torch.tensor([[False, False, True], [False, True, True]])
    allowed = key_padding_mask(pad)
    x = torch.zeros(2, 3, 4)
    assert additive_mask(allowed, x) is allowed  # CPU path: boolean, as it is
    with cuda_paths():
        add = additive_mask(allowed, x)
        assert additive_mask(None, x) is None
    assert add.dtype == torch.float32 and add.shape == allowed.shape
    assert torch.equal(add == 0, allowed) and torch.isinf(add[~allowed]).all()
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny", vocab_size=50, dropout=0.0)).eval()
    src = torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]])
    tgt = torch.tensor([[1, 7, 8], [1, 9, 0]])
    ctx = torch.autocast("cpu", torch.bfloat16, enabled=autocast)
    with torch.no_grad(), ctx:
        want = model(src, tgt, has_pad=True)
        with cuda_paths():
            got = model(src, tgt, has_pad=True)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.float(), want.float(), **tol)
