"""fp32 linear layers for CPU inference on Intel CPUs through MKL's packed sgemm.

Why: on an Intel CPU, MKL's sgemm with its weight packed once (`cblas_sgemm_pack`, then
`cblas_sgemm_compute`) is the fastest fp32 matmul torch carries for a decoder's shapes and
compiles nothing per shape, where oneDNN (nmt/inference/packed_linear.py) compiles a kernel
for each row count it meets, in every worker (docs/performance.md). On AMD CPUs MKL runs its
AVX2 kernels, so oneDNN stays there.

MKL's packed B serves any row count, so it is packed once. The functions are taken from
the MKL inside torch's CPU library (it exports them), so the packed weight is a buffer at a
known address: the native decoder step (nmt/inference/native_step.py) computes on the same
copy. Each output row starts as the bias and the product is added to it (beta = 1), what
torch's own `mkl::_mkl_linear` does, bit for bit. Checked once per process against
`F.linear` at several row counts (`works`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.cores import cpu_info

# CBLAS's enum values, as MKL's headers define them.
ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162
PACK_ROWS = 1  # the row count MKL packs for; the packed layout serves any row count
ALIGN = 64  # bytes: where the packed weight starts within its buffer


class Mkl(NamedTuple):
    """MKL's packed-sgemm functions, as torch's CPU library exports them:
    `cblas_sgemm_pack_get_size(identifier, m, n, k)` (bytes), `cblas_sgemm_pack(layout,
    identifier, trans, m, n, k, alpha, src, ld, dest)` and `cblas_sgemm_compute(layout,
    trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)`."""

    get_size: ctypes._CFuncPtr
    pack: ctypes._CFuncPtr
    compute: ctypes._CFuncPtr


@functools.cache
def mkl() -> Mkl | None:
    """The packed-sgemm functions of the MKL inside torch's CPU library, or None where that
    library or the functions are not found (a torch built without MKL, another platform)."""
    if not torch.backends.mkl.is_available():
        return None
    found = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    if not found:
        return None
    try:
        lib = ctypes.CDLL(str(found[0]))
        get_size, pack, compute = (lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack,
                                   lib.cblas_sgemm_compute)
    except (OSError, AttributeError):
        return None
    c_int, c_void = ctypes.c_int, ctypes.c_void_p
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [c_int] * 4
    pack.restype = None
    pack.argtypes = [c_int] * 6 + [ctypes.c_float, c_void, c_int, c_void]
    compute.restype = None
    compute.argtypes = ([c_int] * 6 + [c_void, c_int, c_void, c_int, ctypes.c_float, c_void,
                                        c_int])
    return Mkl(get_size, pack, compute)


def is_intel() -> bool:
    """Whether /proc/cpuinfo names an Intel CPU (MKL's own kernels run there)."""
    return cpu_info().get("vendor_id", "") == "GenuineIntel"


def available() -> bool:
    """Whether fp32 linears run on MKL's packed sgemm here: an Intel CPU, and MKL's
    functions present and agreeing with `F.linear`."""
    return is_intel() and works()


@functools.cache
def works() -> bool:
    """Whether MKL's packed sgemm runs here and agrees with `F.linear` for row counts
    other than the one packed for (checked once per process)."""
    if mkl() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen)
    bias = torch.randn(40, generator=gen)
    layer = MklLinear(weight, bias)
    inputs = [torch.randn(*shape, 64, generator=gen) for shape in ((1,), (3,), (17,), (2, 5))]
    with torch.inference_mode():
        return all(torch.allclose(layer(x), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
                   for x in inputs)


class MklLinear(nn.Module):
    """An inference-only fp32 linear layer y = x W^T + b on MKL's packed sgemm, W packed once.

    Holds no parameters: the packed weight (`buffer`, starting at `address`, never copied
    or moved: MKL finds it there) and the bias are snapshots of the layer it replaces, so
    `state_dict()` and `.to()` leave them alone. Only where `mkl()` is not None."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        functions = mkl()
        if functions is None:
            raise RuntimeError("MKL's packed sgemm is not available in this torch")
        self._compute = functions.compute
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        dense = weight.detach().float().contiguous()  # (out, in): B = W^T, given transposed
        size = functions.get_size(B_MATRIX, PACK_ROWS, self.out_features, self.in_features)
        self.buffer = torch.empty(size + ALIGN, dtype=torch.uint8)
        self.address = self.buffer.data_ptr() + (-self.buffer.data_ptr()) % ALIGN
        functions.pack(ROW_MAJOR, B_MATRIX, TRANS, PACK_ROWS, self.out_features,
                       self.in_features, 1.0, dense.data_ptr(), self.in_features, self.address)
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        n, k = self.out_features, self.in_features
        rows = x.reshape(-1, k).float().contiguous()  # (rows, in)
        m = rows.size(0)
        out, beta = torch.empty(m, n), 0.0  # (rows, out)
        if self.bias is not None:
            out.copy_(self.bias)  # each row the bias, the product added to it
            beta = 1.0
        if m:
            self._compute(ROW_MAJOR, NO_TRANS, PACKED, m, n, k, rows.data_ptr(), k,
                          self.address, k, beta, out.data_ptr(), n)
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed for MKL")
