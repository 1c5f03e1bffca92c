"""int8 linear layers for CPU inference without AMX, through one C kernel
(nmt/kernels/avx2_linear.c).

Why: on an AVX2 CPU (or an AVX-512 one without AMX) int8 layers otherwise run torch's
FBGEMM / oneDNN dynamic-quantized kernels, which the native decoder step cannot call and
which quantize a call's activations with one scale. This kernel quantizes each row with
its own scale, as nmt/inference/amx_linear.py's int8 kernel does, is compiled once per
install (nmt/kernels), and the native decoder step calls it by address.

Activations are 7 bits wide here (q in [-63, 63], then + 64 as unsigned bytes, the
offset's share subtracted per output): AVX2's vpmaddubsw adds pairs of products into int16,
which two full-range pairs would overflow. Where the build has VNNI (vpdpbusd, no int16
step) they take all 8 bits. `make_int8_linear` (nmt/inference/int8_linear.py) picks it where
AMX-INT8 is absent and the CPU has no AVX-512 (`available`); NMT_AVX2_INT8=0 turns it off
(FBGEMM / oneDNN then).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from nmt import kernels
from nmt.inference.amx_linear import KernelInt8Linear, quantize_rows

PARAMS = 12  # P_COUNT of the C source
OP_AVAILABLE, OP_PACK, OP_LINEAR, OP_LEVELS = range(4)
K_STEP = 32  # in_features must be a multiple of this
OUTS = 16  # outputs per packed block


def _pack(lib: ctypes.CDLL, q: Tensor) -> Tensor:
    """(N, K) int8 weight -> the kernel's layout (flat int8), N padded to 16."""
    q = q.contiguous()
    n, k = q.shape
    padded = (n + OUTS - 1) // OUTS * OUTS
    out = torch.empty(padded * k + 4 * padded, dtype=torch.int8)  # + int32 compensation
    if kernels.call_linear(lib.nmt_avx2_linear, OP_PACK, w=q.data_ptr(), n=n, k=k,
                          y=out.data_ptr()) != 0:
        raise RuntimeError("the AVX2 int8 kernel failed to pack a weight")
    return out


def _linear(lib: ctypes.CDLL, x: Tensor, packed: Tensor, n: int, bias: Tensor | None,
            threads: int, scale: Tensor) -> Tensor:
    """x (..., K) float32 times W packed by `_pack` with per-output `scale` (n,), plus
    `bias` -> (..., n) float32 (x's rows quantized each with its own scale)."""
    k = x.size(-1)
    rows = x.reshape(-1, k)  # (M, K); a view where x's rows are evenly spaced
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.size(0), n, dtype=torch.float32)  # (M, N)
    status = kernels.call_linear(lib.nmt_avx2_linear, OP_LINEAR, x=rows.data_ptr(),
                                m=rows.size(0), k=k, ldx=rows.stride(0), w=packed.data_ptr(),
                                n=n, bias=0 if bias is None else bias.data_ptr(),
                                y=y.data_ptr(), ldy=n, threads=threads,
                                scale=scale.data_ptr())
    if status != 0:
        raise RuntimeError(f"the AVX2 int8 kernel failed (status {status})")
    return y.view(*x.shape[:-1], n)


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel runs here and equals the same quantization done by PyTorch, integer
    sums exact: row counts below, at and past the 4-row tile and a chunk, widths below and
    past a 16-output block, with and without a bias, one and two threads."""
    if kernels.call_linear(lib.nmt_avx2_linear, OP_AVAILABLE) != 0:
        return False
    levels = kernels.call_linear(lib.nmt_avx2_linear, OP_LEVELS)
    gen = torch.Generator().manual_seed(0)
    for n, k in ((40, 128), (7, 64)):
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) / 50 + 1e-3
        bias = torch.randn(n, generator=gen)
        packed = _pack(lib, weight)
        for rows in (1, 3, 4, 6, 70, 600):
            x = torch.randn(rows, k, generator=gen)
            x[0] = 0.0  # an all-zero row
            q, xs = quantize_rows(x, levels)
            exact = (q.double() @ weight.double().T) * xs.double()[:, None] * scale.double()
            for b in (bias, None):
                want = exact if b is None else exact + b.double()
                for threads in (1, 2):
                    got = _linear(lib, x, packed, n, b, threads, scale).double()
                    if not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
                        return False
    return True


KERNEL = kernels.Kernel("avx2_linear", "nmt_avx2_linear", PARAMS, _agrees, "NMT_AVX2_INT8")


def available() -> bool:
    """Whether int8 linears should run on this kernel here: a CPU without AVX-512 (or with
    it capped: AVX-512 CPUs keep torch's VNNI kernels, twice as wide as this one's vectors),
    the kernel wanted (NMT_AVX2_INT8), built for this CPU and checked."""
    return kernels.allowed("avx512") is not None and KERNEL.enabled()


def fits(weight: Tensor) -> bool:
    """Whether the kernel takes this (out, in) weight: 2-D, in a multiple of 32."""
    return weight.dim() == 2 and weight.size(1) % K_STEP == 0 and weight.size(0) > 0


class Avx2Int8Linear(KernelInt8Linear):
    """`KernelInt8Linear` on the AVX2 int8 kernel; needs `available()` (or the kernel
    built, for tests) and `fits(q)`."""

    needs = "the AVX2 kernel, int8 and in_features % 32 == 0"
    kernel = "AVX2 int8 kernel"
    c_function, c_op = KERNEL.entry, OP_LINEAR
    library = staticmethod(KERNEL.library)
    fits = staticmethod(fits)
    pack = staticmethod(_pack)
    run = staticmethod(_linear)
