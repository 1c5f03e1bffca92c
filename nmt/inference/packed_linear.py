"""CPU inference: every linear layer through oneDNN, its weight packed once.

Why: on a CPU, PyTorch sends an fp32 matmul to MKL's sgemm, which on AMD processors runs its
AVX2 kernels even where AVX-512 is there. Measured on this project's CPU (AMD EPYC,
AVX-512), one thread, decoder shapes (rows x 256 -> 768 / 1024 / 8000): MKL 95-110 GFLOP/s,
oneDNN (`torch.ops.mkldnn._linear_pointwise`) 205-240 GFLOP/s; no MKL setting changes it
(MKL_ENABLE_INSTRUCTIONS, MKL_DEBUG_CPU_TYPE, MKL_CBWR). bf16 matmuls already go to oneDNN,
but reorder the weight into oneDNN's blocked layout at every call; packing it once saves
that too (16 rows x 8000 outputs: 231 -> 154 us; identical output).

`pack_for_inference(model)` swaps every `nn.Linear` of a module for a `PackedLinear` holding the
packed weight; the Transformer's output projection (the shared embedding matrix, not a linear
layer) gets its packed copy from nmt/inference/decoding.py, when `is_packed(model)`. The model
is inference-only afterwards: its linear weights are packed snapshots (not parameters, not in
`state_dict()`), so it must not be trained or saved. Results agree with `F.linear` to float
rounding (max |diff| ~4e-6 on logits of order 10; accumulation order differs).

The oneDNN ops are private PyTorch API (the ones torch.compile's CPU backend uses), so each
(dtype) is checked once against `F.linear` on a small case; where the ops are missing, fail
or disagree, nothing is packed and the plain path runs. NMT_PACKED_LINEAR=0 switches packing
off (for comparisons). `make_linear` sends some layers elsewhere, to kernels that need nothing
compiled per shape: bf16 on a CPU with AMX to nmt/inference/amx_linear.py, fp32 on an Intel
CPU to MKL's packed sgemm (nmt/inference/mkl_linear.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.inference import amx_linear, mkl_linear
from nmt.switches import switch

PACKABLE = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype) -> bool:
    """Whether packed oneDNN linears are wanted (NMT_PACKED_LINEAR) and work here for
    `dtype`, agreeing with F.linear."""
    return switch("NMT_PACKED_LINEAR") != "0" and works(dtype)


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


def make_linear(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """The packed inference layer for `weight` (out, in) and `bias`: on the AMX kernel for
    bf16 where it runs and takes the shape, on MKL's packed sgemm for fp32 on an Intel CPU,
    else a `PackedLinear`."""
    if (weight.dtype == torch.bfloat16 and amx_linear.fits(weight)
            and amx_linear.available()):
        return amx_linear.AmxLinear(weight, bias)
    if weight.dtype == torch.float32 and mkl_linear.available():
        return mkl_linear.MklLinear(weight, bias)
    return PackedLinear(weight, bias)


def pack_for_inference(model: nn.Module) -> int:
    """Swap every `nn.Linear` in `model` (in place) for a packed layer (`make_linear`).
    Only for CPU models in fp32 or bf16, when `available()`; the model must be in its
    final dtype and device. Returns the number of layers packed (0: nothing done)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or not available(first.dtype):
        return 0
    return swap_linears(model, make_linear)


def swap_linears(model: nn.Module, make: Callable[[Tensor, Tensor | None], nn.Module]) -> int:
    """Replace every plain `nn.Linear` in `model`, in place, by `make(weight, bias)`;
    returns how many were replaced."""
    count = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, make(child.weight, child.bias))
                    count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether `pack_for_inference` packed `model`'s linears: then a weight it uses outside
    a linear layer (the Transformer's shared output projection) is worth packing too."""
    return any(isinstance(module, PackedLinear | amx_linear.AmxLinear | mkl_linear.MklLinear)
               for module in model.modules())
