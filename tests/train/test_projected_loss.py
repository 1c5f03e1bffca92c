"""The chunked projection + smoothed loss (`projected_smoothed_loss`) against the reference
`label_smoothed_nll(F.linear(features, weight), ...)`: loss, NLL and both gradients, fp32
(tight) and bf16 autocast (loose), with and without smoothing, chunk sizes that do and do
not divide the rows, padding masked, and random shapes (hypothesis)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import tiny_model_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.train.loss import label_smoothed_nll, projected_smoothed_loss

PAD = 0


def _inputs(rows: int, vocab: int, dim: int, seed: int, dtype: torch.dtype = torch.float32,
            pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, dim, generator=gen, dtype=dtype) * 2
    weight = torch.randn(vocab, dim, generator=gen, dtype=dtype) * dim ** -0.5
    target = torch.randint(1, vocab, (rows,), generator=gen)
    target[torch.randperm(rows, generator=gen)[:pad_rows]] = PAD
    return features, weight, target


def _both(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, eps: float,
          chunk_rows: int, autocast: torch.dtype | None = None,
          pad_id: int | None = PAD) -> list[tuple[torch.Tensor, ...]]:
    """(loss, nll, grad_features, grad_weight) of the reference and of the chunked version."""
    out = []
    for fused in (False, True):
        f = features.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        ctx = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else torch.autocast("cpu", enabled=False))
        with ctx:
            if fused:
                loss, nll = projected_smoothed_loss(f, w, target, eps, pad_id=pad_id,
                                                    chunk_rows=chunk_rows)
            else:
                logits = F.linear(f, w)  # (rows, vocab)
                loss, nll = label_smoothed_nll(logits, target, eps,
                                               PAD if pad_id is None else pad_id)
        (loss * 0.37).backward()
        out.append((loss.detach(), nll, f.grad, w.grad))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Equal to `rtol` relative to the largest magnitude of `want` (gradients have zeros)."""
    scale = want.abs().max().clamp_min(1e-30)
    return bool(((got.double() - want.double()).abs().max() / scale) <= rtol)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize(("rows", "chunk"), [(64, 16), (61, 16), (61, 7), (5, 1024), (61, 1)])
def test_fp32_equals_reference(eps, rows, chunk):
    features, weight, target = _inputs(rows, 1009, 24, seed=rows + chunk, pad_rows=rows // 6)
    (ref, ours) = _both(features, weight, target, eps, chunk)
    for name, got, want in zip(("loss", "nll", "grad_features", "grad_weight"), ours, ref,
                               strict=True):
        assert got.dtype == want.dtype, name
        assert _close(got, want, 1e-5), (name, got, want)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [16, 50, 4096])
def test_bf16_autocast_close_to_reference(eps, chunk):
    features, weight, target = _inputs(200, 997, 32, seed=chunk, pad_rows=20)
    (ref, ours) = _both(features, weight, target, eps, chunk, autocast=torch.bfloat16)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float32
    assert ours[2].dtype == features.dtype and ours[3].dtype == weight.dtype  # fp32 params
    for name, got, want, tol in zip(("loss", "nll", "grad_features", "grad_weight"), ours, ref,
                                    (1e-4, 1e-4, 2e-2, 2e-2), strict=True):
        assert _close(got, want, tol), (name, got, want)


def test_bf16_chunked_equals_unchunked_bf16_closely():
    """Chunking changes only the grouping of rows: chunk 13 vs one chunk, same bf16 math."""
    features, weight, target = _inputs(100, 503, 16, seed=3, pad_rows=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        results = []
        for chunk in (13, 100):
            f = features.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            loss, nll = projected_smoothed_loss(f, w, target, 0.1, pad_id=PAD, chunk_rows=chunk)
            loss.backward()
            results.append((loss, nll, f.grad, w.grad))
    for got, want in zip(*results, strict=True):
        assert _close(got.detach(), want.detach(), 1e-2)
    assert torch.equal(results[0][0], results[1][0])  # per-row statistics do not depend on it
    assert torch.equal(results[0][2], results[1][2])  # grad_features rows neither


def test_padding_rows_count_for_nothing_and_get_no_gradient():
    features, weight, target = _inputs(40, 101, 8, seed=1, pad_rows=9)
    keep = target.ne(PAD)
    f = features.clone().requires_grad_(True)
    loss, nll = projected_smoothed_loss(f, weight, target, 0.1, pad_id=PAD, chunk_rows=6)
    loss.backward()
    assert f.grad[~keep].abs().sum() == 0
    dropped, dropped_nll = projected_smoothed_loss(features[keep], weight, target[keep], 0.1,
                                                   chunk_rows=6)
    assert torch.allclose(loss, dropped, rtol=1e-6) and torch.allclose(nll, dropped_nll,
                                                                        rtol=1e-6)


def test_pad_id_none_counts_every_row():
    features, weight, target = _inputs(12, 50, 8, seed=2)
    target[0] = PAD
    loss, _ = projected_smoothed_loss(features, weight, target, 0.1, pad_id=None, chunk_rows=5)
    ref, _ = label_smoothed_nll(F.linear(features, weight), target, 0.1, pad_id=-1)
    assert torch.allclose(loss, ref, rtol=1e-6)


def test_batch_shaped_features_and_targets():
    features, weight, target = _inputs(24, 61, 8, seed=4, pad_rows=5)
    loss, nll = projected_smoothed_loss(features.view(4, 6, 8), weight, target.view(4, 6), 0.1,
                                        pad_id=PAD, chunk_rows=5)
    ref, ref_nll = label_smoothed_nll(F.linear(features, weight).view(4, 6, 61),
                                      target.view(4, 6), 0.1, PAD)
    assert torch.allclose(loss, ref, rtol=1e-6) and torch.allclose(nll, ref_nll, rtol=1e-6)


def test_nll_is_detached_and_loss_is_fp32_scalar():
    features, weight, target = _inputs(10, 30, 8, seed=5)
    f = features.requires_grad_(True)
    loss, nll = projected_smoothed_loss(f, weight, target, 0.1)
    assert loss.shape == () and loss.requires_grad and not nll.requires_grad
    assert loss.dtype == torch.float32


def test_gradcheck_fp64():
    features, weight, target = _inputs(9, 13, 4, seed=6, dtype=torch.float64, pad_rows=2)
    f = features.requires_grad_(True)
    w = weight.requires_grad_(True)
    for eps in (0.0, 0.2):
        assert torch.autograd.gradcheck(
            lambda a, b, eps=eps: projected_smoothed_loss(a, b, target, eps, pad_id=PAD,
                                                          chunk_rows=4)[0], (f, w))


def test_gradient_only_where_asked():
    features, weight, target = _inputs(10, 30, 8, seed=7)
    w = weight.clone().requires_grad_(True)
    projected_smoothed_loss(features, w, target, 0.1, chunk_rows=3)[0].backward()
    ref_w = weight.clone().requires_grad_(True)
    label_smoothed_nll(F.linear(features, ref_w), target, 0.1, PAD)[0].backward()
    assert _close(w.grad, ref_w.grad, 1e-5)
    f = features.clone().requires_grad_(True)
    projected_smoothed_loss(f, weight, target, 0.1, chunk_rows=3)[0].backward()
    assert f.grad is not None and f.grad.shape == features.shape


def test_no_rows_gives_zero_loss_and_zero_gradients():
    w = torch.randn(20, 8, requires_grad=True)
    f = torch.zeros(0, 8, requires_grad=True)
    loss, nll = projected_smoothed_loss(f, w, torch.zeros(0, dtype=torch.long), 0.1)
    loss.backward()
    assert loss.item() == 0.0 and nll.item() == 0.0 and w.grad.abs().sum() == 0


def test_bad_arguments_raise():
    features, weight, target = _inputs(6, 20, 4, seed=8)
    with pytest.raises(ValueError, match="chunk_rows"):
        projected_smoothed_loss(features, weight, target, 0.1, chunk_rows=0)
    with pytest.raises(ValueError, match="targets"):
        projected_smoothed_loss(features, weight, target[:5], 0.1)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), vocab=st.integers(2, 300), dim=st.integers(1, 24),
       chunk=st.integers(1, 80), eps=st.sampled_from([0.0, 0.1, 0.45]),
       pad_fraction=st.floats(0.0, 0.5), seed=st.integers(0, 10_000))
def test_random_shapes_equal_reference(rows, vocab, dim, chunk, eps, pad_fraction, seed):
    features, weight, target = _inputs(rows, vocab, dim, seed,
                                       pad_rows=int(rows * pad_fraction))
    (ref, ours) = _both(features.double(), weight.double(), target, eps, chunk)
    for got, want in zip(ours, ref, strict=True):
        assert _close(got, want, 1e-9)


def test_model_features_path_equals_the_logits_path():
    """What the loop would run (decoder features of the real target rows + the shared
    matrix into the chunked loss) equals today's (`model(select=...)` + reference loss):
    loss and every parameter's gradient, fp64."""
    model, src, tgt_in, tgt_out, select = tiny_model_batch()
    target = tgt_out.reshape(-1)[select]
    ref, _ = label_smoothed_nll(model(src, tgt_in, select=select), target, 0.1, PAD)
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    features = model.decode_features(tgt_in, model.encode(src))  # (batch, tgt_len, d_model)
    rows = features.reshape(-1, features.size(-1)).index_select(0, select)  # (n, d_model)
    loss, _ = projected_smoothed_loss(rows, model.output_weight, target, 0.1, pad_id=PAD,
                                      chunk_rows=4)
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-12)
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, want[k], atol=1e-10), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (none visible on this machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_close_to_reference(dtype):
    features, weight, target = _inputs(300, 4099, 64, seed=9, pad_rows=30)
    results = []
    for fused in (False, True):
        f = features.cuda().requires_grad_(True)
        w = weight.cuda().requires_grad_(True)
        with torch.autocast("cuda", dtype=dtype):
            if fused:
                loss, nll = projected_smoothed_loss(f, w, target.cuda(), 0.1, pad_id=PAD,
                                                    chunk_rows=128)
            else:
                loss, nll = label_smoothed_nll(F.linear(f, w), target.cuda(), 0.1, PAD)
        loss.backward()
        results.append((loss.detach(), nll, f.grad, w.grad))
    for got, want, tol in zip(results[1], results[0], (2e-3, 2e-3, 2e-2, 2e-2), strict=True):
        assert _close(got.cpu(), want.cpu(), tol)


@pytest.mark.slow
def test_compiled_chunks_equal_eager():
    """`compiled=True` (torch.compile'd per-chunk statistics and gradient) gives what the
    eager path gives: fp32 tightly, bf16 autocast to bf16 rounding; ragged last chunks
    and a second row count reuse the dynamic-shape compilation."""
    for rows, autocast in ((70, None), (45, torch.bfloat16)):
        features, weight, target = _inputs(rows, 211, 16, seed=rows, pad_rows=7)
        results = []
        for compiled in (False, True):
            f = features.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            ctx = (torch.autocast("cpu", dtype=autocast) if autocast is not None
                   else torch.autocast("cpu", enabled=False))
            with ctx:
                loss, nll = projected_smoothed_loss(f, w, target, 0.1, pad_id=PAD,
                                                    chunk_rows=32, compiled=compiled)
            loss.backward()
            results.append((loss.detach(), nll, f.grad, w.grad))
        tol = 1e-5 if autocast is None else 1e-2
        for got, want in zip(results[1], results[0], strict=True):
            assert _close(got, want, tol)


def test_fp64_inputs_stay_fp64_under_autocast():
    """Autocast leaves fp64 matmuls alone; so does the chunked loss."""
    features, weight, target = _inputs(20, 40, 8, seed=10, dtype=torch.float64, pad_rows=3)
    (ref, ours) = _both(features, weight, target, 0.1, 7, autocast=torch.bfloat16)
    for got, want in zip(ours, ref, strict=True):
        assert got.dtype == torch.float64 and _close(got, want, 1e-12)
