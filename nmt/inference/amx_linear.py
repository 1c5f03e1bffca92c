"""The AMX linear kernel (nmt/kernels/amx_linear.c): bf16, and int8 with activations
quantized per row, for `KernelLinear` (nmt/inference/kernel_linear.py) on a CPU with AMX.

Why: oneDNN compiles a kernel for every row count it meets, and beam search meets a new one
at almost every step, in every worker (docs/performance.md); this kernel is compiled at
install and serves every shape. Its int8 op replaces torch's dynamic-quantized layers, which
quantize a whole call's activations with one scale. Checked once per process against
PyTorch (`_agrees`, `_int8_agrees`); where it disagrees or is not built, it is not used.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt import kernels
from nmt.inference.kernel_linear import KernelSpec, int8_agrees, run

PARAMS = 12  # P_COUNT of the C source
OP_AVAILABLE, OP_PACK, OP_LINEAR, OP_AVAILABLE_I8, OP_PACK_I8, OP_LINEAR_I8 = range(6)


def _pack(lib: ctypes.CDLL, w: Tensor) -> Tensor:
    """(N, K) bf16 or int8 weight -> the kernel's tile layout (flat, of w's dtype), N padded
    to 32."""
    n, k = w.shape
    out = torch.empty((n + 31) // 32 * 32 * k, dtype=w.dtype)
    op = OP_PACK_I8 if w.dtype == torch.int8 else OP_PACK
    if kernels.call_linear(lib.nmt_amx_linear, op, w=w.data_ptr(), n=n, k=k,
                           y=out.data_ptr()) != 0:
        raise RuntimeError("the AMX linear kernel failed to pack a weight")
    return out


def _agrees(lib: ctypes.CDLL) -> bool:
    """The bf16 op runs here (AMX granted) and matches F.linear to bf16 rounding: row counts
    below, at and past the 16- and 32-row blocks, a width that is no multiple of 16, with
    and without a bias, one and two threads."""
    if kernels.call_linear(lib.nmt_amx_linear, OP_AVAILABLE) != 0:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    packed = _pack(lib, weight)
    for rows in (1, 5, 16, 17, 33, 70):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        for b in (bias, None):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            for threads in (1, 2):
                got = run(BF16, lib, x, packed, 40, b, threads).float()
                if not torch.allclose(got, want, rtol=1e-2, atol=2e-2):
                    return False
    return True


KERNEL = kernels.Kernel("amx_linear", "nmt_amx_linear", PARAMS, _agrees)


def int8_works() -> bool:
    """Whether the kernel's int8 ops run here (built with AMX-INT8, AMX granted) and match
    the same quantization done by PyTorch (`_int8_agrees`, checked once per library)."""
    lib = KERNEL.library()
    if lib is None:
        return False
    with torch.autocast("cpu", enabled=False), torch.inference_mode():  # any caller's context
        return _int8_agrees(lib)


@functools.cache
def _int8_agrees(lib: ctypes.CDLL) -> bool:
    """The int8 ops run (AMX-INT8 granted) and equal PyTorch's same quantization: row counts
    below, at and past the 16- and 32-row blocks, a width no multiple of 16."""
    return kernels.call_linear(lib.nmt_amx_linear, OP_AVAILABLE_I8) == 0 and int8_agrees(
        INT8, lib, ((40, 128),), (1, 5, 16, 17, 33, 70))


BF16 = KernelSpec("AMX bf16 kernel", KERNEL, torch.bfloat16, 32, OP_LINEAR, _pack,
                  KERNEL.enabled, int8=False)
INT8 = KernelSpec("AMX int8 kernel", KERNEL, torch.float32, 64, OP_LINEAR_I8, _pack,
                  int8_works, int8=True)
