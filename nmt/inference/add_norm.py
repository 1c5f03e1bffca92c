"""A post-norm residual at inference on a CPU as one C kernel (nmt/kernels/add_norm.c).

Why: `LayerNorm(x + sublayer(x))` in eager PyTorch is an add and a layer_norm, two
dispatched ops and three passes over the rows (the sum written, read for its moments,
read again for the output), three times per decoder layer and step; the kernel does it in
one call with each row kept in the L1 cache, and writes the result over the sub-layer's
output, which nothing else holds, so it allocates nothing either.

How: built at install, loaded for this CPU and checked once per process against PyTorch
(nmt/kernels); where no library applies, `add_norm_` returns None and the caller runs
PyTorch's ops. Only where no gradient is wanted and no autocast is on: training never
takes it.
"""

from __future__ import annotations

import array
import ctypes

import torch
from torch import Tensor, nn

from nmt import kernels

PARAMS = 14  # the parameter block's length: P_COUNT of the C source's enum
MAX_D = 8192  # MAX_D of the C source
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def enabled() -> bool:
    """Whether the kernel is built and checked here."""
    return KERNEL.enabled()


def add_norm_(out: Tensor, x: Tensor, norm: nn.LayerNorm) -> Tensor | None:
    """`norm(x + out)` written into `out` and returned, or None (nothing written) when
    the kernel does not take these operands: both CPU tensors of one shape and dtype
    (float32 or bfloat16), contiguous, `norm` over their last dim with weight and bias of
    either dtype, no gradient wanted, no autocast on, the kernel built and checked (see
    module docstring). Then the caller computes it with PyTorch's ops. Called three times
    per decoder layer and step, so the checks are ordered cheapest first."""
    dtype = out.dtype
    if dtype not in DTYPES or x.dtype != dtype or not out.is_cpu:
        return None
    weight, bias = norm.weight, norm.bias
    if torch.is_grad_enabled() and (out.requires_grad or x.requires_grad
                                    or weight.requires_grad):
        return None
    if (bias is None or weight.dtype not in DTYPES or bias.dtype != weight.dtype
            or torch.is_autocast_enabled("cpu")):
        return None
    shape = out.shape
    if (x.shape != shape or not shape or not 0 < shape[-1] <= MAX_D
            or norm.normalized_shape != shape[-1:]
            or not (out.is_contiguous() and x.is_contiguous() and weight.is_contiguous()
                    and bias.is_contiguous())):
        return None
    lib = KERNEL.library()
    if lib is None:
        return None
    _run(lib, out, x, weight, bias, norm.eps, torch.get_num_threads())
    return out


def _run(lib: ctypes.CDLL, out: Tensor, x: Tensor, weight: Tensor, bias: Tensor, eps: float,
         threads: int) -> None:
    """out = LayerNorm(x + out) * weight + bias over the last dim (d > 0), through `lib`."""
    d = out.size(-1)
    params = array.array("q", (
        x.data_ptr(), out.data_ptr(), out.data_ptr(), weight.data_ptr(), bias.data_ptr(),
        out.numel() // d, d, d, d, d, DTYPES[out.dtype], DTYPES[weight.dtype],
        kernels.float_bits(eps), threads))
    if lib.nmt_add_norm(params.buffer_info()[0]) != 0:
        raise ValueError(f"fused add + LayerNorm: rows of {d} exceed its {MAX_D}")


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel against PyTorch's add and layer_norm: float32 and bfloat16 rows, weights
    of either dtype, a width that is not a multiple of the vector (the tails)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, w_dtype, tol in ((torch.float32, torch.float32, 1e-5),
                                (torch.bfloat16, torch.bfloat16, 1e-2),
                                (torch.bfloat16, torch.float32, 1e-2)):
        for d in (64, 75):
            x = (torch.randn(5, d, generator=gen) * 3 + 1).to(dtype)
            s = torch.randn(5, d, generator=gen).to(dtype)
            weight = (torch.rand(d, generator=gen) + 0.5).to(w_dtype)
            bias = torch.randn(d, generator=gen).to(w_dtype)
            want = torch.nn.functional.layer_norm(x + s, (d,), weight.to(dtype),
                                                  bias.to(dtype), 1e-5)
            got = s.clone()
            _run(lib, got, x, weight, bias, 1e-5, 1)
            if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                return False
    return True


KERNEL = kernels.Kernel("add_norm", "nmt_add_norm", PARAMS, _agrees)
