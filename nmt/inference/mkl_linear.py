"""fp32 linear layers for CPU inference on Intel CPUs through MKL's packed sgemm.

Why: on an Intel CPU, MKL's sgemm with its weight packed once (`cblas_sgemm_pack`, then
`cblas_sgemm_compute`) is the fastest fp32 matmul torch carries for a decoder's shapes, at
every row count, and needs nothing compiled per shape; oneDNN (nmt/inference/packed_linear.py)
compiles a kernel for each row count it meets, in every worker, and runs the small ones
slower (docs/performance.md). On AMD CPUs MKL runs its AVX2 kernels, so oneDNN stays there.

MKL's packed B does not depend on the row count it was packed for: it is packed once for one
row and serves any (as CTranslate2's packed GEMM does). torch exposes the pair as private ops
(`mkl::_mkl_reorder_linear_weight`, `mkl::_mkl_linear`, what its CPU freezing pass uses);
those are checked once per process against `F.linear` at several row counts, and where they
are missing or disagree the oneDNN layer is used instead. NMT_MKL_LINEAR=0 turns this off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.cores import cpu_info
from nmt.switches import switch

PACK_ROWS = 1  # the row count MKL packs for; the packed layout serves any row count


def is_intel() -> bool:
    """Whether /proc/cpuinfo names an Intel CPU (MKL's own kernels run there)."""
    return cpu_info().get("vendor_id", "") == "GenuineIntel"


def available() -> bool:
    """Whether fp32 linears should run on MKL's packed sgemm here: an Intel CPU, the switch
    on (NMT_MKL_LINEAR), and torch's ops present and agreeing with `F.linear`."""
    return switch("NMT_MKL_LINEAR") != "0" and is_intel() and works()


@functools.cache
def works() -> bool:
    """Whether torch's MKL packed-linear ops run here and agree with `F.linear` for row
    counts other than the one packed for (checked once per process)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(40, 64, generator=gen)
        bias = torch.randn(40, generator=gen)
        layer = MklLinear(weight, bias)
        inputs = [torch.randn(*shape, 64, generator=gen) for shape in ((1,), (3,), (17,), (2, 5))]
        return all(torch.allclose(layer(x), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
                   for x in inputs)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class MklLinear(nn.Module):
    """An inference-only fp32 linear layer y = x W^T + b on MKL's packed sgemm, W packed once.

    Holds no parameters: the packed weight (an opaque tensor MKL must find at the address it
    packed it to: never copied) and the bias are snapshots of the layer it replaces, so
    `state_dict()` and `.to()` leave them alone."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        dense = weight.detach().float().contiguous()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(dense, PACK_ROWS)
        # The op reads only the original weight's shape and dtype when given the row count
        # it packed for, which `forward` always gives: a zero-stride stand-in holds no copy.
        self.shape = torch.zeros(1).expand(self.out_features, self.in_features)
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        rows = x.numel() // self.in_features if self.in_features else 0
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape, self.bias, rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed for MKL")
