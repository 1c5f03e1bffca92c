"""Which implementation runs each CPU operation, by precision and CPU: one table.

A CPU falls in one column of `COLUMNS`, from the class nmt sees it as
(`kernels.cpu_class()`) and its vendor: `amx`, `{intel,amd}-avx512`, `{intel,amd}-avx2`, or
`other` (the baseline class, any other architecture). Each cell of `TABLE` lists the
backends tried in order; the first that runs here (loaded and checked, once per process)
and takes the weight wins. The `linear` rows are what `prepare` and `layer` make; the others
describe what the rest of nmt picks, for `render` (docs) and `nmt doctor` (`here`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from nmt import kernels
from nmt.inference import amx_linear, avx2_linear, int8_linear, mkl_linear, packed_linear
from nmt.inference.int8_linear import Int8Linear
from nmt.inference.kernel_linear import KernelLinear, KernelSpec
from nmt.inference.mkl_linear import MklLinear
from nmt.inference.packed_linear import PackedLinear
from nmt.model.transformer import Transformer

COLUMNS = ("amx", "intel-avx512", "intel-avx2", "amd-avx512", "amd-avx2", "other")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # int8 models are float32

LEGEND = {
    "mkl": "MklLinear: MKL's packed sgemm, the weight packed once (runs on Intel CPUs only)",
    "onednn": "PackedLinear: oneDNN's matmul, the weight packed once",
    "nmt-amx": "KernelLinear on nmt's AMX kernel (nmt/kernels/amx_linear.c): bf16 for "
               "in_features % 32 == 0, int8 for in_features % 64 == 0",
    "nmt-avx2": "KernelLinear on nmt's AVX2 int8 kernel (nmt/kernels/avx2_linear.c), for "
                "in_features % 32 == 0",
    "torch-int8": "Int8Linear: torch's dynamic int8, FBGEMM for small outputs, oneDNN for "
                  "large; where it does not run, nothing is quantized (the fp32 row)",
    "torch": "PyTorch's own ops (nn.Linear: MKL's sgemm for fp32 on x86, oneDNN for bf16)",
    "nmt-step": "nmt's C decoder step (nmt/kernels/native_step.c): a step's layers in one "
                "call, where every decoder linear is mkl, nmt-amx or nmt-avx2",
    "nmt-c": "nmt's C kernel (nmt/kernels), at the best ISA level the CPU's class allows",
    "torch-rows64": "PyTorch's linear with the rows rounded up to a multiple of 64, so "
                    "oneDNN compiles few shapes (nmt/train/linears.py)",
    "onednn-train": "oneDNN's matmul for the forward and both backward products "
                    "(nmt/train/linears.py): torch's fp32 matmul is MKL's, AVX2 on AMD CPUs",
}

_ONEDNN = ("onednn", "torch")
_MKL, _AMX_BF16 = ("mkl", *_ONEDNN), ("nmt-amx", *_ONEDNN)  # mkl checks for an Intel CPU
_INT8 = ("torch-int8",)  # where it does not run, `prepare` quantizes nothing (fp32's row)
_AMX_INT8, _AVX2_INT8 = ("nmt-amx", *_INT8), ("nmt-avx2", *_INT8)
_STEP, _TORCH, _C = ("nmt-step", "torch"), ("torch",), ("nmt-c", "torch")
_LINEAR = {  # precision: a cell per column, in the order of COLUMNS
    "fp32": (_MKL, _MKL, _MKL, _ONEDNN, _ONEDNN, _MKL),
    "bf16": (_AMX_BF16, _ONEDNN, _ONEDNN, _ONEDNN, _ONEDNN, _ONEDNN),
    "int8": (_AMX_INT8, _INT8, _AVX2_INT8, _INT8, _AVX2_INT8, _INT8),
}
TABLE: dict[tuple[str, str], tuple[tuple[str, ...], ...]] = {
    **{("linear", p): cells for p, cells in _LINEAR.items()},
    **{("output projection", p): cells for p, cells in _LINEAR.items()},  # the embedding
    ("decoder step", "fp32"): (_STEP, _STEP, _STEP, _TORCH, _TORCH, _STEP),
    ("decoder step", "bf16"): (_STEP, _TORCH, _TORCH, _TORCH, _TORCH, _TORCH),
    ("decoder step", "int8"): (_STEP, _TORCH, _STEP, _TORCH, _STEP, _TORCH),
    ("attention", "all"): (_C,) * 6,
    ("add + LayerNorm", "all"): (_C,) * 6,
    ("beam top-k", "all"): (_C,) * 6,
    ("training linear", "fp32"): (_TORCH,) * 3 + (("onednn-train", "torch"),) + (_TORCH,) * 2,
    ("training linear", "bf16"): (("torch-rows64",),) + (_TORCH,) * 5,
}
C_KERNELS = {"attention": "fused_attention", "add + LayerNorm": "add_norm",
             "beam top-k": "step_topk"}  # operation: its kernel (nmt/kernels/levels.py)
C_CALLABLE = {"mkl", "nmt-amx", "nmt-avx2"}  # the linears nmt-step calls
STEP_KERNELS = ("native_step", "fused_attention", "add_norm")  # what nmt-step needs loaded
SPECS: dict[tuple[str, str], KernelSpec] = {
    ("nmt-amx", "bf16"): amx_linear.BF16, ("nmt-amx", "int8"): amx_linear.INT8,
    ("nmt-avx2", "int8"): avx2_linear.INT8}


def column() -> str:
    """This CPU's column of TABLE (within the ISA caps in force)."""
    level = kernels.cpu_class()
    if level in ("amx", "baseline"):
        return "amx" if level == "amx" else "other"
    vendor = "intel" if mkl_linear.is_intel() else "amd"
    return f"{vendor}-{'avx512' if level.startswith('avx512') else 'avx2'}"


def cell(operation: str, precision: str) -> tuple[str, ...]:
    """The backends this machine's column tries for (operation, precision), in order."""
    return TABLE[operation, precision][COLUMNS.index(column())]


def runs(name: str, precision: str) -> bool:
    """Whether the linear backend `name` runs here in `precision` (checked once a process)."""
    if name == "mkl":
        return precision == "fp32" and mkl_linear.available()
    if name == "onednn":
        return precision in DTYPES and packed_linear.works(DTYPES[precision])
    if name == "torch-int8":
        return precision == "int8" and int8_linear.available()
    spec = SPECS.get((name, precision))
    return spec.works() if spec is not None else name == "torch"


def layer(weight: Tensor, bias: Tensor | None, precision: str,
          keep_quantized: bool = False) -> nn.Module | None:
    """The inference layer for `weight` (out, in) and `bias` in `precision`: the first
    backend of this machine's cell that runs here and takes the weight; None where that is
    torch (keep nn.Linear, or the plain matmul). `keep_quantized`: an int8 layer can give a
    layer of some of its rows (`rows(index)`, a shortlist's output projection)."""
    for name in cell("linear", precision):
        if name == "torch" or not runs(name, precision):
            continue
        if name == "mkl":
            return MklLinear(weight, bias)
        if name == "onednn":
            return PackedLinear(weight, bias)
        if name == "torch-int8":
            return Int8Linear(weight, bias, keep_quantized=keep_quantized)
        spec = SPECS[name, precision]
        if spec.fits(weight):
            return KernelLinear(spec, weight, bias, keep_quantized=keep_quantized)
    return None


def prepare(model: Transformer, precision: str) -> nn.Module | None:
    """Swap every nn.Linear of a CPU `model` (in place, in its final dtype) for its backend
    layer, and return the output projection to use (None: the plain matmul). int8 where
    torch's int8 kernels run (else as fp32); otherwise the model's dtype decides. The model
    is inference-only afterwards: its linear weights are packed snapshots, not parameters."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return None
    if precision != "int8" or first.dtype != torch.float32 or not runs("torch-int8", "int8"):
        precision = next((p for p, dtype in DTYPES.items() if dtype == first.dtype), "")
        if not precision:
            return None
    with torch.no_grad():
        if not swap_linears(model, lambda weight, bias: layer(weight, bias, precision)):
            return None
        return layer(model.output_weight, None, precision, keep_quantized=precision == "int8")


def swap_linears(model: nn.Module,
                 make: Callable[[Tensor, Tensor | None], nn.Module | None]) -> int:
    """Replace every plain nn.Linear of `model`, in place, by `make(weight, bias)` where
    that is not None; how many were replaced."""
    count = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    made = make(child.weight, child.bias)
                    if made is not None:
                        setattr(module, name, made)
                        count += 1
    return count


def here(levels: Mapping[str, str | None]) -> dict[str, str]:
    """What runs on this machine for each row of TABLE ("operation precision": backend),
    given the level each C kernel loaded at (`levels`, None: not loaded; nmt doctor's
    kernels). Where torch's int8 kernels do not run, the int8 rows are the fp32 rows."""
    found: dict[str, str] = {}
    for operation, precision in TABLE:
        if operation in C_KERNELS:
            chosen = "nmt-c" if levels.get(C_KERNELS[operation]) else "torch"
        elif operation == "decoder step":
            linear = found[f"linear {precision}"]
            loaded = all(levels.get(name) for name in STEP_KERNELS)
            chosen = "nmt-step" if loaded and linear in C_CALLABLE else "torch"
        elif operation == "training linear":  # onednn-train needs oneDNN's fp32 matmul
            chosen = next(name for name in cell(operation, precision)
                          if name != "onednn-train" or runs("onednn", "fp32"))
        elif precision == "int8" and not runs("torch-int8", "int8"):
            chosen = found[f"{operation} fp32"]  # nothing quantized
        else:
            chosen = next(name for name in cell(operation, precision)
                          if runs(name, precision))
        found[f"{operation} {precision}"] = chosen
    return found


def render() -> str:
    """TABLE as Markdown: a row per (operation, precision), a column per CPU column, each
    cell the backends tried in order; then what each backend name is."""
    lines = ["| operation | precision | " + " | ".join(COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for (operation, precision), cells in TABLE.items():
        lines.append(f"| {operation} | {precision} | "
                     + " | ".join(", ".join(names) for names in cells) + " |")
    used = {name for cells in TABLE.values() for names in cells for name in names}
    lines += ["", "Each cell: the backends tried in order, the first that runs here and "
              "takes the weight wins. The output projection is the shared embedding matrix.",
              "", *(f"- `{name}`: {what}" for name, what in LEGEND.items() if name in used)]
    return "\n".join(lines)
