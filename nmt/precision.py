"""Mixed precision policy: which autocast context each --precision value means.

`auto` asks oneDNN whether the CPU computes bf16 natively (AVX512-BF16 or AMX), so the
documented way to tell it that a CPU has no native bf16, or to see what such a CPU gets, is
oneDNN's own cap: `ONEDNN_MAX_CPU_ISA=AVX2` (or `AVX512_CORE`) makes `auto` resolve to fp32
and every oneDNN kernel run its AVX2 code. An explicit bf16/fp16 on a CPU that only
emulates it is allowed but named, with its measured cost (`emulation_note`): emulated bf16
matmuls run at a fraction of fp32's speed.
"""

from __future__ import annotations

import contextlib
import time

import torch

from nmt.errors import UsageError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> the fastest safe choice for `device`: bf16 where the hardware computes it
    natively (Ampere+ GPUs; CPUs with AVX512-BF16 or AMX), fp16 on older GPUs, else fp32
    (emulated bf16 on a CPU without it is slower than fp32). Other values pass through."""
    if precision == "int8" and device.type != "cpu":
        raise UsageError("--precision int8 is for CPUs; on a GPU use auto, bf16 or fp16")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and cpu_native("bf16"):
        return "bf16"
    return "fp32"


def cpu_native(precision: str) -> bool:
    """Whether this CPU's oneDNN kernels compute `precision` (bf16/fp16) natively rather
    than emulating it through fp32 (honours ONEDNN_MAX_CPU_ISA)."""
    if not torch.backends.mkldnn.is_available():
        return False
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, probe.get(precision, ""), None)
    return bool(check is not None and check())


def emulation_slowdown(precision: str, training: bool, size: int = 384,
                       repeats: int = 3) -> float:
    """How many times slower one linear layer (`size` rows x `size` -> `size`) runs under
    `precision` autocast than in fp32 on this CPU: its forward, plus with `training` the
    backward for both the weight and the input gradient. The minimum of `repeats` timings
    each, after one warm-up (about 0.1-1 s on an emulating CPU).

    The input gradient matters: on a CPU without native bf16, torch sends a bf16 matmul of
    two row-major operands (grad_out @ W, the backward of every linear) to a generic gemm,
    about 30x slower than fp32 (1024 x 256 x 1024 with the kernels capped at AVX2: 230 ms
    vs 7.8 ms), where a transposed operand gets oneDNN's emulation at about 4.5x. That
    is why a bf16 training step there is tens of times slower while a forward is ~5x."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=gen, requires_grad=training)
    x = torch.randn(size, size, generator=gen, requires_grad=training)

    def best(ctx: str) -> float:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with torch.set_grad_enabled(training), autocast(torch.device("cpu"), ctx):
                out = torch.nn.functional.linear(x, weight)
            if training:
                out.float().sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(precision) / best("fp32")


def emulation_note(precision: str, device: torch.device, training: bool) -> str | None:
    """For bf16/fp16 on a CPU that only emulates it: one line saying so, with the measured
    cost against fp32 (of a training step's linear when `training`, else of a forward) and
    what `auto` would pick; None where the precision is native, fp32, int8, or on a GPU."""
    if device.type != "cpu" or precision not in AUTOCAST_DTYPES or cpu_native(precision):
        return None
    slowdown = emulation_slowdown(precision, training)
    what = "forward+backward" if training else "forward"
    return (f"this CPU has no native {precision} kernels (oneDNN emulates them: no "
            f"AVX512-{precision.upper()}/AMX, or capped by ONEDNN_MAX_CPU_ISA); one linear "
            f"{what} measured {slowdown:.1f}x slower than fp32 here. "
            f"--precision auto picks {resolve_precision('auto', device)}")


def grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """The dynamic loss scaler fp16 training needs (a disabled one otherwise), for `device`.

    `torch.amp.GradScaler(device)` is torch >= 2.3; older releases only have the CUDA one
    (fp16 training on a CPU then is a usage error).
    """
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, enabled=enabled)
    if device.type != "cuda" and enabled:
        raise UsageError("fp16 training on a CPU needs torch >= 2.3; use --precision "
                         "bf16 or fp32")
    return torch.cuda.amp.GradScaler(enabled=enabled and device.type == "cuda")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """torch.autocast for bf16/fp16 on the device's type (CPU included); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
