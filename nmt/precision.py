"""Mixed precision policy: which autocast context each --precision value means.

`auto` on a CPU picks bf16 only where it pays (`bf16_rule`, from the CPU's features): oneDNN
must compute bf16 natively (AVX512-BF16 or AMX), and the CPU be of a kind whose bf16
matmuls are faster than fp32's. Native is not enough: an Intel Xeon without AMX (or whose
AMX its hypervisor hides) runs bf16 through AVX512-BF16 slower than fp32 (docs/performance.md,
"CPU classes and what nmt picks"); `nmt doctor` measures it on the CPU at hand. oneDNN's own
cap shows what a CPU without native bf16 gets: `ONEDNN_MAX_CPU_ISA=AVX2` (or `AVX512_CORE`)
makes `auto` resolve to fp32. An explicit bf16/fp16 on a CPU where it is slow is allowed but
named, with its measured cost (`precision_note`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from nmt.cores import cpu_info
from nmt.errors import UsageError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# `auto` takes bf16 on a CPU only where its matmul measured at least this many times fp32's
# speed on CPUs of its kind (`bf16_rule`): near parity fp32 wins (no casts in training, full
# precision).
BF16_PAYS_FROM = 1.15


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> the fastest safe choice for `device`: bf16 on Ampere+ GPUs, fp16 on older
    ones; on a CPU bf16 where it is native and measured faster than fp32 (`cpu_bf16_pays`),
    else fp32. Other values pass through."""
    if precision == "int8" and device.type != "cpu":
        raise UsageError("--precision int8 is for CPUs; on a GPU use auto, bf16 or fp16")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and cpu_bf16_pays():
        return "bf16"
    return "fp32"


def cpu_bf16_pays() -> bool:
    """Whether `auto` takes bf16 on this CPU (`bf16_rule`)."""
    return bf16_rule()[0]


def bf16_rule() -> tuple[bool, str]:
    """Whether bf16 trains and translates faster than fp32 on this CPU, from its features
    (the ISA caps in force included), and why: oneDNN must compute bf16 natively, and the
    CPU be of a kind whose bf16 matmuls run at least BF16_PAYS_FROM times fp32's speed: AMX
    (Intel Xeon 4th generation and later), or AVX512-BF16 on an AMD CPU (Zen 4 and later).
    An Intel CPU with AVX512-BF16 but no AMX (Cooper Lake, or a Xeon whose hypervisor hides
    AMX) runs them slower than fp32 (docs/performance.md)."""
    from nmt import kernels  # the CPU's flags and caps, as the C kernels are chosen

    if not cpu_native("bf16"):
        return False, "no native bf16 (no AVX512-BF16 or AMX, or capped by ONEDNN_MAX_CPU_ISA)"
    if kernels.allowed("amx") is None:
        return True, "AMX computes bf16 matmuls faster than fp32"
    if kernels.allowed("avx512_bf16") is None and cpu_info().get("vendor_id") == "AuthenticAMD":
        return True, "an AMD CPU's AVX512-BF16 computes bf16 matmuls faster than fp32"
    return False, ("native bf16 without AMX on this CPU runs its matmuls slower than fp32 "
                   "(AVX512-BF16 on an Intel CPU: about half fp32's speed)")


def measure_bf16_speedup(size: int = 512, repeats: int = 7) -> dict[str, float]:
    """Time one (size x size) @ (size x size) linear in fp32 and in bf16 on one thread (the
    best of `repeats`, interleaved, after a warm-up; about 50 ms): their times in ms and
    fp32's over bf16's. One thread: a parent that forks workers must not have opened an
    OpenMP region of more (nmt/inference/workers.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        pairs = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x = torch.randn(size, size, generator=gen).to(dtype)
            w = torch.randn(size, size, generator=gen).to(dtype)
            pairs[name] = (x, w)
        best = dict.fromkeys(pairs, float("inf"))
        for round_ in range(repeats + 1):
            for name, (x, w) in pairs.items():
                start = time.perf_counter()
                torch.nn.functional.linear(x, w)
                if round_:  # the first round warms up
                    best[name] = min(best[name], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {"fp32_ms": best["fp32"] * 1e3, "bf16_ms": best["bf16"] * 1e3,
            "speedup": best["fp32"] / best["bf16"]}


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
    far slower than the oneDNN emulation a transposed operand gets, so a bf16 training step
    there loses much more to fp32 than a forward does (docs/performance.md)."""
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


def precision_note(precision: str, device: torch.device, training: bool,
                   setting: str | None = None) -> str | None:
    """One line on why `precision` (as resolved) is slow or was chosen on this CPU, or None:
    - bf16/fp16 emulated (no native kernels): "slow: ...", with the cost of one linear
      layer against fp32 (a training step's when `training`, else a forward's);
    - bf16 native but measured slower than fp32 here: "slow: ...", with that measurement;
    - `setting` auto resolved to fp32 although bf16 is native: "auto: ..." saying why.
    On a GPU, for int8, and where bf16 pays: None."""
    if device.type != "cpu":
        return None
    if precision in AUTOCAST_DTYPES and not cpu_native(precision):
        slowdown = emulation_slowdown(precision, training)
        what = "forward+backward" if training else "forward"
        return (f"slow: this CPU has no native {precision} kernels (oneDNN emulates them: "
                f"no AVX512-{precision.upper()}/AMX, or capped by ONEDNN_MAX_CPU_ISA); one "
                f"linear {what} measured {slowdown:.1f}x slower than fp32 here. "
                f"--precision auto picks {resolve_precision('auto', device)}")
    pays, why = bf16_rule()
    native_slow = cpu_native("bf16") and not pays
    if precision == "bf16" and native_slow:
        return f"slow: {why}. --precision auto picks fp32"
    if setting == "auto" and precision == "fp32" and native_slow:
        return f"auto: fp32, as {why}"
    return None


def grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """The dynamic loss scaler fp16 training needs (a disabled one otherwise), for `device`."""
    return torch.amp.GradScaler(device.type, enabled=enabled)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """torch.autocast for bf16/fp16 on the device's type (CPU included); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
