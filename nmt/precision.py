"""Mixed precision policy: which autocast context each --precision value means."""

from __future__ import annotations

import contextlib

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
    if device.type == "cpu" and torch.backends.mkldnn.is_available() \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bf16"
    return "fp32"


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
