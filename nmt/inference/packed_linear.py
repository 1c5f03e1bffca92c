"""Inference-only linear layers on oneDNN with their weight packed once (`PackedLinear`).

Why: on a CPU, PyTorch sends an fp32 matmul to MKL's sgemm, which on AMD processors runs its
AVX2 kernels even where AVX-512 is there; oneDNN's matmul (`_linear_pointwise`) uses the
CPU's full width. bf16 matmuls already go to oneDNN, but reorder the weight into its blocked
layout at every call; packing it once saves that too (docs/performance.md has the figures).
Results agree with `F.linear` to float rounding (accumulation order differs).

The oneDNN ops are private PyTorch API (the ones torch.compile's CPU backend uses), so each
dtype is checked once against `F.linear` on a small case (`works`); where the ops are
missing, fail or disagree, nmt/inference/backends.py leaves nn.Linear in place.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def works(dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears work here for `dtype` and agree with F.linear
    (checked once per process)."""
    if dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=gen).to(dtype)
        bias = torch.randn(24, generator=gen).to(dtype)
        x = torch.randn(5, 3, 16, generator=gen).to(dtype)
        got = _linear(x, _pack(weight), bias)
        want = F.linear(x, weight, bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(),
                                                           rtol=tol, atol=tol))


def _pack(weight: Tensor) -> Tensor:
    """(out, in) weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) @ W^T + b with a packed W: (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An inference-only linear layer y = x W^T + b computed by oneDNN with W prepacked.

    Holds no parameters: the packed weight and the bias are plain tensors (snapshots of the
    layer it replaces), so `state_dict()` and `.to()` leave them alone."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        return _linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed for oneDNN")
