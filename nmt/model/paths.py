"""Which of its two code paths the network takes: the GPU's (SDPA attention, torch's
dropout) or the CPU's (the softmax written out, a cheaper dropout mask).

The choice follows the tensors' device. `cuda_paths()` makes a CPU take the GPU's path, so
that what a GPU dispatches can be counted and tested on a machine without one
(bench/gpu_train_speed.py --count-ops): the same ops, run by the CPU's kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

_AS_CUDA = False


def cpu_path(t: Tensor) -> bool:
    """Whether work on `t` takes the CPU's path."""
    return t.device.type == "cpu" and not _AS_CUDA


@contextlib.contextmanager
def cuda_paths() -> Iterator[None]:
    """Within it, CPU tensors take the GPU's path (not thread-safe: a bench's or a test's
    switch)."""
    global _AS_CUDA
    before, _AS_CUDA = _AS_CUDA, True
    try:
        yield
    finally:
        _AS_CUDA = before
