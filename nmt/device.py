"""Which device a command runs on, and the CUDA settings every nmt process wants.

`--device auto|cpu|cuda` means the same for `train` and `translate`: auto picks CUDA when a
GPU is visible. A process that will use CUDA gets, before its first CUDA allocation,
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless the user set that variable:
training and translation batches change shape at every step, and without expandable
segments the caching allocator fragments into blocks of each old shape (the usual cause of
"reserved but unallocated" memory and late OOMs on long runs).
"""

from __future__ import annotations

import os

import torch

from nmt.config import DEVICES
from nmt.errors import UsageError

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto -> cuda when available else cpu; cuda is this process's local rank's GPU.

    Asking for CUDA where none is visible is a usage error. Choosing CUDA also sets the
    allocator default (see the module docstring).
    """
    if name not in DEVICES:
        raise UsageError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda asked for but no CUDA device is visible; "
                         "use --device cpu")
    set_cuda_allocator_default()
    return torch.device("cuda", local_rank)


def set_cuda_allocator_default() -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set it or CUDA
    is already initialised (the allocator reads it once). Returns whether it was set."""
    if ALLOC_CONF in os.environ or torch.cuda.is_initialized():
        return False
    os.environ[ALLOC_CONF] = DEFAULT_ALLOC_CONF
    return True


def allow_tf32(device: torch.device) -> None:
    """fp32 training on CUDA: matmuls and convolutions in TF32 (10-bit mantissa products,
    fp32 accumulation), the speed of Ampere+ tensor cores for fp32 weights. Applied only
    to training; `nmt translate --precision fp32` keeps full fp32 products."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
