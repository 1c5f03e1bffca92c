"""How training's linear products run on a CPU, as the backend table says
(nmt/inference/backends.py, rows "training linear"): PyTorch's own, the same with the rows
rounded up (`torch-rows64`), or oneDNN's matmul for the forward and both backward products
(`onednn-train`).

- `torch-rows64` (bf16 on a CPU with AMX): oneDNN compiles a kernel for every matmul shape it
  meets, and every batch of a token-count batcher has its own number of tokens; rounding
  each layer's rows up to a multiple of ROWS with zero rows leaves a few row counts per run,
  compiled once (docs/training.md). Zero rows change no result: their outputs are cut off,
  they add nothing to the weight gradient and receive none.
- `onednn-train` (fp32 on an AMD CPU with AVX-512): torch sends an fp32 matmul to MKL, whose
  kernels on an AMD CPU are its AVX2 ones; oneDNN's use AVX-512 (docs/performance.md).

The network knows nothing of it: `use` swaps the linear layers' class from outside (same
parameters, same state dict), and the training step projects to the vocabulary with the
same function (nmt/train/step.py, `LossOptions.project`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.inference import backends

ROWS = 64  # rows per step: about 3 % more rows at 2,048-token batches
Linear = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # F.linear's signature
_ONEDNN = torch.ops.mkldnn._linear_pointwise


def linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """F.linear(x, weight, bias) with x's rows (its leading dimensions flattened) padded by
    zero rows to a multiple of `multiple` for the matmul: (..., in) -> (..., out)."""
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    extra = -rows % multiple if multiple > 1 else 0
    if extra == 0 or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.size(-1))  # (rows, in)
    flat = torch.cat([flat, flat.new_zeros(extra, flat.size(1))])  # (rows + extra, in)
    out = F.linear(flat, weight, bias)[:rows]  # (rows, out); leading rows: contiguous
    return out.view(*x.shape[:-1], out.size(-1))


class _OnednnRows(torch.autograd.Function):
    """y = x W^T + b over rows (M, K), each product of the forward and the backward on
    oneDNN's matmul (the weight as it is: it changes every update, so nothing is packed)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rows: Tensor, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return _ONEDNN(rows, weight, bias, "none", [], "")  # (M, N)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        rows, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        dx = _ONEDNN(grad, weight.t(), None, "none", [], "") if needs[0] else None  # (M, K)
        dw = _ONEDNN(grad.t(), rows.t(), None, "none", [], "") if needs[1] else None  # (N, K)
        db = grad.sum(0) if ctx.has_bias and needs[2] else None  # type: ignore[attr-defined]
        return dx, dw, db


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) on oneDNN, forward and backward: (..., in) -> (..., out).
    PyTorch's for no rows, which oneDNN refuses, and under torch.compile, which picks its
    own kernels (and cannot lower this op at dynamic shapes)."""
    if x.numel() == 0 or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if x.dim() == 2:
        return _OnednnRows.apply(x, weight, bias)
    out = _OnednnRows.apply(x.reshape(-1, x.size(-1)), weight, bias)  # (rows, out)
    return out.view(*x.shape[:-1], weight.size(0))


def choice(device: torch.device, precision: str) -> str:
    """The training linear of this CPU's cell of the table for `precision` (the first that
    runs here): "torch-rows64", "onednn-train" or "torch" (also on a GPU)."""
    if device.type != "cpu" or ("training linear", precision) not in backends.TABLE:
        return "torch"
    for name in backends.cell("training linear", precision):
        if name == "torch-rows64" or name == "torch":
            return name
        if name == "onednn-train" and backends.runs("onednn", "fp32"):
            return name
    return "torch"


def training_linear(device: torch.device, precision: str) -> Linear | None:
    """The linear function training on `device` in `precision` computes with (`choice`),
    None for PyTorch's own."""
    name = choice(device, precision)
    if name == "torch-rows64":
        return functools.partial(linear_rows, multiple=ROWS)
    return onednn_linear if name == "onednn-train" else None


class TrainingLinear(nn.Linear):
    """nn.Linear whose forward runs `function` (a `training_linear`); the same parameters
    and state dict (`use` swaps a layer's class in place)."""

    function: Linear = F.linear

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x, self.weight, self.bias)


def use(model: nn.Module, function: Linear) -> int:
    """Make every plain nn.Linear of `model` a TrainingLinear running `function` (in place,
    parameters untouched); returns the number of layers changed. The Transformer's output
    projection is no nn.Linear: the training step projects with it (`LossOptions.project`)."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = TrainingLinear
            module.function = function
            count += 1
    return count
