"""CPU inference in int8: dynamic int8 linear layers through torch's FBGEMM / oneDNN kernels.

`quantize_for_inference(model)` swaps every `nn.Linear` of a module for an `Int8Linear`:
its weight is quantized once to int8 with one scale per output channel (symmetric,
absmax / 127, as CTranslate2 does), and at run time each call quantizes its input to
uint8 with one scale and zero point for the whole tensor (`quantized::linear_dynamic`:
min/max, quantize, int8 GEMM with int32 accumulation, rescale, bias, all in one C++ call;
the output is float32). Everything else (attention, LayerNorm, softmax) stays float32.

Two kernels, picked per call by the size of the output: FBGEMM is the fastest while the
float32 output is small, oneDNN once it outgrows the core's L2 cache (the figures:
docs/performance.md, "int8 kernels"). Both have AVX2 kernels (vpmaddubsw) and AVX-512 /
VNNI ones; both are in every x86 torch wheel. Without VNNI the u8 x s8 pair sums of
vpmaddubsw can saturate int16, so activations then use 7 bits (`reduce_range`), as torch's
own dynamic quantization does on such CPUs (also when FBGEMM_ENABLE_INSTRUCTIONS or
ONEDNN_MAX_CPU_ISA caps the kernels at AVX2 on a VNNI machine).

The output projection (the shared embedding matrix, vocab x d_model) is int8 too unless
`NMT_INT8_OUTPUT=0`, which keeps it in float32 (packed for oneDNN as in
nmt/inference/packed_linear.py): it is the largest matmul, and its quality cost is measured in
docs/inference.md. The model is inference-only afterwards (the int8 weights are snapshots, not
parameters, not in `state_dict()`).

On a CPU with AMX-INT8 every layer whose input width is a multiple of 64 runs instead on
nmt/inference/amx_linear.py's int8 kernel (`make_int8_linear`), and on a CPU without AVX-512
(an AVX2 one, or the kernels capped at AVX2) every layer of a width a multiple of 32 on
nmt/inference/avx2_linear.py's: activations quantized per row, nothing compiled per shape,
and both callable from the native decoder step; quality and speed in docs/performance.md.

The kernels are reached through the quantized-tensor API that torch marks as deprecated,
so availability is checked once per process against `F.linear` on a small case; where a
kernel is missing, fails or disagrees, it is not used, and when neither works nothing is
quantized (the caller then packs fp32 as usual). NMT_INT8_KERNEL=fbgemm|onednn forces one
kernel (for comparisons).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.cores import cpu_info
from nmt.inference import amx_linear, avx2_linear
from nmt.inference.packed_linear import available as packed_available
from nmt.inference.packed_linear import make_linear, swap_linears
from nmt.switches import switch

KERNELS = ("fbgemm", "onednn")
# Output elements (rows x out_features) from which oneDNN beats FBGEMM (bench/int8_kernels.py:
# even at 128K, e.g. 16 x 8000 and 256 x 1024 rows; oneDNN 1.3x at 256 x 768, 4x at
# 256 x 8000; FBGEMM 1.2-1.9x below 64K).
ONEDNN_FROM_OUTPUTS = 128 * 1024
_CAPPED_ISAS = {"SSE41", "SSE4_1", "AVX", "AVX2"}  # env values that rule VNNI out


@functools.cache
def has_vnni() -> bool:
    """Whether the CPU has AVX-512 VNNI or AVX-VNNI (int8 dot products without int16
    saturation). Read from /proc/cpuinfo; False where that cannot be read."""
    words = set(cpu_info().get("flags", "").split())
    return bool(words & {"avx512_vnni", "avx_vnni"})


def capped_below_vnni(*env_names: str) -> bool:
    """Whether any of the environment variables `env_names` (a kernel library's ISA cap,
    e.g. ONEDNN_MAX_CPU_ISA) holds a value that rules VNNI out (AVX2 or older)."""
    return any(os.environ.get(name, "").upper() in _CAPPED_ISAS for name in env_names)


@functools.cache
def reduce_range() -> bool:
    """7-bit activations where int16 saturation is possible: no VNNI, or the kernels capped
    below it by FBGEMM_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA."""
    capped = capped_below_vnni("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    return capped or not has_vnni()


@contextlib.contextmanager
def _engine(name: str) -> Iterator[None]:
    """torch's quantized engine set to `name` for the duration (it picks the packing)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float weight -> int8 weight and float32 scales (out,), symmetric per output
    channel: w ~ q * scale, q in [-127, 127] (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)  # (out,)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


def _prepack(kernel: str, q: Tensor, scale: Tensor, bias: Tensor | None) -> object:
    """Packed params of `kernel` for int8 weight `q` with per-channel `scale`."""
    zero = torch.zeros(q.size(0), dtype=torch.long)
    with warnings.catch_warnings(), _engine(kernel):
        warnings.simplefilter("ignore")  # the quantized-tensor deprecation notice
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qweight, bias)


def _apply(packed: object, x: Tensor) -> Tensor:
    """x (..., in) float32 -> (..., out) float32 through a packed int8 weight."""
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range())


@functools.cache
def kernel_works(kernel: str) -> bool:
    """Whether `kernel` packs and runs here and agrees with F.linear (int8 tolerance)."""
    if kernel not in torch.backends.quantized.supported_engines:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(40, 64, generator=gen) / 8
        bias = torch.randn(40, generator=gen)
        x = torch.randn(3, 5, 64, generator=gen)
        q, scale = quantize_weight(weight)
        got = _apply(_prepack(kernel, q, scale, bias), x)
        want = F.linear(x, weight, bias)
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):
        return False
    if got.shape != want.shape or got.dtype != torch.float32:
        return False
    return bool((got - want).abs().max() <= 0.05 * want.abs().max())


def kernels() -> tuple[str, ...]:
    """The int8 kernels to use here: the working ones of KERNELS, or the one forced by
    NMT_INT8_KERNEL (none when it does not work)."""
    forced = switch("NMT_INT8_KERNEL")
    wanted = (forced,) if forced in KERNELS else KERNELS
    return tuple(k for k in wanted if kernel_works(k))


def available() -> bool:
    """Whether at least one int8 linear kernel works here."""
    return bool(kernels())


class Int8Linear(nn.Module):
    """An inference-only linear layer y ~ x W^T + b with W in int8 (per-channel scales)
    and x quantized per call (see module docstring).

    Holds no parameters: packed int8 weights (one per available kernel) and the float
    bias are snapshots of the layer it replaces."""

    def __init__(self, weight: Tensor, bias: Tensor | None,
                 quantized: tuple[Tensor, Tensor] | None = None,
                 use: tuple[str, ...] | None = None, keep_quantized: bool = False) -> None:
        """`quantized`: `weight` already as (int8 weight, scales) (weight unused then);
        `use`: the kernels to pack for (default: every working one); `keep_quantized`:
        hold the int8 weight and scales beside the packed ones, for `rows` (the output
        projection only: every other layer would hold its weights twice)."""
        super().__init__()
        q, scale = quantize_weight(weight) if quantized is None else quantized
        self.in_features, self.out_features = q.size(1), q.size(0)
        self.quantized = (q, scale) if keep_quantized else None
        b = None if bias is None else bias.detach().float().clone()
        self.packed = {k: _prepack(k, q, scale, b) for k in kernels()
                       if use is None or k in use}
        if not self.packed:
            raise RuntimeError("no int8 linear kernel works here")
        self.small = self.packed.get("fbgemm", next(iter(self.packed.values())))
        self.large = self.packed.get("onednn", self.small)

    def rows(self, index: Tensor) -> Int8Linear:
        """The layer of output rows `index` (n,) only (a shortlist's output projection,
        built per batch): the int8 weight and scales taken, not quantized again, and packed
        for oneDNN alone where it works (its packing takes about 4 ms for 3,000 rows; it
        is the faster kernel from 64 rows of a step up, FBGEMM below). No bias."""
        if self.quantized is None:
            raise ValueError("Int8Linear.rows needs a layer made with keep_quantized=True")
        q, scale = self.quantized
        use = ("onednn",) if "onednn" in self.packed else None
        return Int8Linear(q, None, quantized=(q.index_select(0, index),
                                              scale.index_select(0, index)), use=use)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) float32 -> (..., out_features) float32."""
        outputs = x.numel() // self.in_features * self.out_features
        return _apply(self.large if outputs >= ONEDNN_FROM_OUTPUTS else self.small, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 per-channel weights, kernels={'+'.join(self.packed)}")


ROW_SELECTABLE = (Int8Linear, amx_linear.AmxInt8Linear,
                  avx2_linear.Avx2Int8Linear)  # int8 layers with `rows(index)`


def make_int8_linear(weight: Tensor, bias: Tensor | None,
                     keep_quantized: bool = False) -> nn.Module:
    """The int8 inference layer for float `weight` (out, in) and `bias`: on the AMX int8
    kernel where it runs and takes the width, else on the AVX2 one (a CPU without AVX-512),
    else an `Int8Linear`. `keep_quantized`: the layer can give a layer of some of its rows
    (`rows`)."""
    if amx_linear.fits_int8(weight) and amx_linear.int8_available():
        q, scale = quantize_weight(weight)
        return amx_linear.AmxInt8Linear(q, scale, bias, keep_quantized=keep_quantized)
    if avx2_linear.fits(weight) and avx2_linear.available():
        q, scale = quantize_weight(weight)
        return avx2_linear.Avx2Int8Linear(q, scale, bias, keep_quantized=keep_quantized)
    return Int8Linear(weight, bias, keep_quantized=keep_quantized)


def quantize_for_inference(model: nn.Module) -> int:
    """Swap every `nn.Linear` in `model` (in place) for an int8 layer (`make_int8_linear`).
    Only for float32 CPU models, when `available()`. Returns the number of layers replaced
    (0: nothing done). The Transformer's shared output matrix is no linear layer:
    `output_projection` gives its int8 form, which the decoding workspace uses."""
    first = next(model.parameters(), None)
    if (first is None or first.device.type != "cpu" or first.dtype != torch.float32
            or not available()):
        return 0
    return swap_linears(model, make_int8_linear)


def output_projection(weight: Tensor) -> nn.Module | None:
    """The vocabulary projection of an int8 model: int8 too, or an fp32 packed one with
    NMT_INT8_OUTPUT=0 (None where neither kernel is available)."""
    with torch.no_grad():
        if switch("NMT_INT8_OUTPUT") != "0" and available():
            return make_int8_linear(weight, None, keep_quantized=True)  # a shortlist: rows
        if packed_available(torch.float32):
            return make_linear(weight, None)
    return None
