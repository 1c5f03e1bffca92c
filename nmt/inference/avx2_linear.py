"""The AVX2 int8 linear kernel (nmt/kernels/avx2_linear.c), for `KernelLinear`
(nmt/inference/kernel_linear.py) on a CPU without AVX-512.

Why: there, int8 layers otherwise run torch's FBGEMM / oneDNN dynamic-quantized kernels,
which quantize a call's activations with one scale and which the native decoder step cannot
call. This kernel quantizes each row with its own scale, as the AMX one does. Activations
are 7 bits wide (q in [-63, 63], then + 64 as unsigned bytes, the offset's share subtracted
per output): AVX2's vpmaddubsw adds pairs of products into int16, which two full-range pairs
would overflow. Where the build has VNNI (vpdpbusd, no int16 step) they take all 8 bits.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from nmt import kernels
from nmt.inference.kernel_linear import KernelSpec, int8_agrees

PARAMS = 12  # P_COUNT of the C source
OP_AVAILABLE, OP_PACK, OP_LINEAR, OP_LEVELS = range(4)
OUTS = 16  # outputs per packed block


def _pack(lib: ctypes.CDLL, q: Tensor) -> Tensor:
    """(N, K) int8 weight -> the kernel's layout (flat int8), N padded to 16, followed by
    each output's int32 compensation."""
    n, k = q.shape
    padded = (n + OUTS - 1) // OUTS * OUTS
    out = torch.empty(padded * k + 4 * padded, dtype=torch.int8)
    if kernels.call_linear(lib.nmt_avx2_linear, OP_PACK, w=q.data_ptr(), n=n, k=k,
                           y=out.data_ptr()) != 0:
        raise RuntimeError("the AVX2 int8 kernel failed to pack a weight")
    return out


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel runs here and equals PyTorch's same quantization: row counts below, at and
    past the 4-row tile and a chunk, widths below and past a 16-output block."""
    entry = lib.nmt_avx2_linear
    return kernels.call_linear(entry, OP_AVAILABLE) == 0 and int8_agrees(
        INT8, lib, ((40, 128), (7, 64)), (1, 3, 4, 6, 70, 600),
        kernels.call_linear(entry, OP_LEVELS))


KERNEL = kernels.Kernel("avx2_linear", "nmt_avx2_linear", PARAMS, _agrees)
INT8 = KernelSpec("AVX2 int8 kernel", KERNEL, torch.float32, 32, OP_LINEAR, _pack,
                  KERNEL.enabled, int8=True)
