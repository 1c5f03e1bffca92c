"""The post-norm residual's C kernel (nmt/model/add_norm.py) against PyTorch's add and
layer_norm: the dtypes, widths and thread counts inference meets; never taken where a
gradient or autocast is on; its absence harmless."""

from __future__ import annotations

import pytest
import torch
from helpers.native import without_kernels
from torch import nn

from nmt.inference import add_norm
from nmt.inference.layer_step import residual as fused_residual
from nmt.model.layers import Residual

pytestmark = pytest.mark.isa  # compiled for the vector ISA in use: CI runs these at AVX2 too

needs_kernel = pytest.mark.skipif(not add_norm.enabled(),
                                  reason="no C compiler here: the kernel cannot be built")


def operands(rows: int, d: int, dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, nn.LayerNorm]:
    """A residual x (rows, 1, d), a sub-layer output of the same shape, and a LayerNorm with
    trained-looking (non-trivial) weight and bias in `w_dtype`."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 1, d, generator=gen) * 4 + 2).to(dtype)
    s = torch.randn(rows, 1, d, generator=gen).to(dtype)
    norm = nn.LayerNorm(d)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
        norm.bias.copy_(torch.randn(d, generator=gen))
    return x, s, norm.to(w_dtype)


@needs_kernel
@pytest.mark.parametrize("d", [256, 512, 75, 16, 1])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_float32_equals_pytorch(d, rows) -> None:
    x, s, norm = operands(rows, d, torch.float32, torch.float32)
    with torch.no_grad():
        want = norm(x + s)
        got = add_norm.add_norm_(s.clone(), x, norm)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@needs_kernel
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [256, 75])
def test_bfloat16_equals_pytorch_within_one_rounding(w_dtype, d) -> None:
    """bfloat16 rows: the sum rounded to bfloat16 as PyTorch's add does, then normalised in
    float32; the output differs from PyTorch's at most by one bfloat16 rounding step."""
    x, s, norm = operands(64, d, torch.bfloat16, w_dtype, seed=1)
    with torch.no_grad():
        want = nn.functional.layer_norm(x + s, (d,), norm.weight, norm.bias, norm.eps)
        got = add_norm.add_norm_(s.clone(), x, norm)
    assert got is not None and got.dtype == torch.bfloat16
    step = want.float().abs().clamp_min(1e-3) * 2 ** -7  # one bf16 ulp, relative
    assert bool(((got.float() - want.float()).abs() <= step + 1e-6).all())


@needs_kernel
def test_residual_after_takes_it_at_inference_only() -> None:
    """A post-norm `Residual` in eval mode gives PyTorch's result through the kernel, written
    over the sub-layer's output; in training (gradients wanted) PyTorch's ops run and the
    gradient flows."""
    x, s, _ = operands(10, 256, torch.float32, torch.float32, seed=2)
    residual = Residual(256, dropout=0.1, pre_norm=False).eval()
    with torch.no_grad():
        residual.norm.weight.mul_(1.5)
        want = residual.norm(x + s)
        fresh = s.clone()
        got = fused_residual(residual, x, fresh)
    assert got.data_ptr() == fresh.data_ptr()  # the kernel wrote over the sub-layer output
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)

    residual.train()
    xg = x.clone().requires_grad_(True)
    out = fused_residual(residual, xg, s.clone())
    out.sum().backward()
    assert xg.grad is not None

    residual.eval()  # gradients wanted in eval mode: not the kernel either
    xg = x.clone().requires_grad_(True)
    assert add_norm.add_norm_(s.clone(), xg, residual.norm) is None
    fused_residual(residual, xg, s.clone()).sum().backward()
    assert xg.grad is not None


def test_operands_it_cannot_take_go_to_pytorch() -> None:
    """Autocast, float64, different shapes, non-contiguous rows or a norm without affine
    parameters: None (nothing written), and `Residual.after` still gives LayerNorm(x + s)."""
    x, s, norm = operands(6, 64, torch.float32, torch.float32, seed=3)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert add_norm.add_norm_(s.clone(), x, norm) is None
        assert add_norm.add_norm_(s.double(), x.double(), norm.double()) is None
        assert add_norm.add_norm_(s[:3].clone(), x, norm) is None
        wide = torch.randn(6, 1, 128)
        assert add_norm.add_norm_(wide[..., ::2], x, norm) is None
        plain = nn.LayerNorm(64, elementwise_affine=False)
        assert add_norm.add_norm_(s.clone(), x, plain) is None
        residual = Residual(64, dropout=0.0, pre_norm=False).eval().double()
        got = fused_residual(residual, x.double(), s.double())
        torch.testing.assert_close(got, residual.norm(x.double() + s.double()))


@needs_kernel
def test_threads_give_the_same_bits() -> None:
    """Each row is one thread's whole work: the thread count cannot change a bit, so
    workers and threads translate alike."""
    x, s, norm = operands(1024, 256, torch.float32, torch.float32, seed=4)
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = add_norm.add_norm_(s.clone(), x, norm)
            torch.set_num_threads(2)
            two = add_norm.add_norm_(s.clone(), x, norm)
            alone = add_norm.add_norm_(s[5:6].clone(), x[5:6], norm)  # a row by itself
    finally:
        torch.set_num_threads(before)
    assert one is not None and two is not None and alone is not None
    assert torch.equal(one, two) and torch.equal(one[5:6], alone)


@pytest.mark.parametrize("off", ["not loaded", "NMT_KERNELS=0"])
def test_switched_off_pytorch_runs(monkeypatch, off: str) -> None:
    """Without the library (not loaded, or every kernel turned off): the kernel is off and
    the residual is PyTorch's."""
    add_norm.KERNEL.forget()
    if off == "not loaded":
        monkeypatch.setattr(add_norm.KERNEL, "library", lambda: None)
    else:
        monkeypatch.setenv("NMT_KERNELS", "0")
    try:
        x, s, norm = operands(4, 32, torch.float32, torch.float32)
        with torch.no_grad():
            assert not add_norm.enabled()
            assert add_norm.add_norm_(s.clone(), x, norm) is None
    finally:
        add_norm.KERNEL.forget()


def test_without_its_library_inference_goes_on_in_silence(tmp_path) -> None:
    """No library built: nothing on stderr, and the residual still computed (PyTorch's ops)."""
    code = (
        "import torch\n"
        "from nmt.inference import add_norm\n"
        "from nmt.inference.layer_step import residual\n"
        "from nmt.model.layers import Residual\n"
        "r = Residual(32, 0.0, False).eval()\n"
        "with torch.no_grad():\n"
        "    print(add_norm.enabled(), residual(r, torch.randn(3, 32), torch.randn(3, 32)).shape)\n"
        "    print(residual(r, torch.randn(2, 32), torch.randn(2, 32)).shape)\n")
    out = without_kernels(code, tmp_path)
    assert out == ["False torch.Size([3, 32])", "torch.Size([2, 32])"]
