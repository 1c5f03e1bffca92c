"""Dynamic int8 linear layers for CPU inference through torch's FBGEMM / oneDNN kernels.

`Int8Linear` quantizes its weight once to int8 with one scale per output channel
(symmetric, absmax / 127, as CTranslate2 does); each call quantizes its input to uint8
with one scale and zero point for the whole tensor (`quantized::linear_dynamic`: quantize,
int8 GEMM with int32 accumulation, rescale, bias, in one C++ call; float32 out).

Two kernels, picked per call by the size of the output: FBGEMM while the float32 output is
small, oneDNN once it outgrows the core's L2 cache (docs/performance.md, "Measurements behind
the code").
Without VNNI the u8 x s8 pair sums of vpmaddubsw can saturate int16, so activations then
use 7 bits (`reduce_range`), as torch's own dynamic quantization does on such CPUs (also
when FBGEMM_ENABLE_INSTRUCTIONS or ONEDNN_MAX_CPU_ISA caps the kernels at AVX2).

The kernels are reached through the quantized-tensor API that torch marks as deprecated,
so each is checked once per process against `F.linear`; one that fails is not used, and
where neither works nothing is quantized (nmt/inference/backends.py decides).
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

KERNELS = ("fbgemm", "onednn")
# Output elements (rows x out_features) from which oneDNN beats FBGEMM (bench/int8_kernels.py)
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
    """The int8 kernels of KERNELS that work here."""
    return tuple(k for k in KERNELS if kernel_works(k))


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
        for oneDNN alone where it works (packing for both would cost each batch twice). No
        bias."""
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
