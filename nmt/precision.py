"""Mixed precision policy: which autocast context each --precision value means."""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> the fastest safe choice for `device`: bf16 where the hardware computes it
    natively (Ampere+ GPUs; CPUs with AVX512-BF16 or AMX), fp16 on older GPUs, else fp32
    (emulated bf16 on a CPU without it is slower than fp32). Other values pass through."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and torch.backends.mkldnn.is_available() \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bf16"
    return "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """torch.autocast for bf16/fp16 on the device's type (CPU included); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
