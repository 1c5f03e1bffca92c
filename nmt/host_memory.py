"""Keep freed host memory inside the process while training or translating on CPU.

glibc's malloc serves every block above its mmap threshold with a fresh mmap and gives it
back on free, so the large tensors a training step or a beam-search step allocates and
frees again (logits, activations) would be page-faulted in from scratch every time.
Switching mmap off and raising the trim threshold keeps freed blocks in the heap for the
next step. The price is memory: the setting is process-wide and nothing freed is given
back, so oneDNN's per-shape primitive cache (bf16 matmuls meet a new row count almost
every update) is sized down for training and up for long-running translators. The
measurements behind each setting: docs/performance.md ("Host memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_done = False


def keep_freed_memory() -> bool:
    """Tell glibc malloc to reuse freed blocks instead of unmapping them (once per
    process). Returns whether it applied: False on non-glibc platforms, a no-op there."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (libc.mallopt(_M_MMAP_MAX, 0) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1)
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok


# oneDNN primitives kept per process (oneDNN's own default: 1024). Training: each update
# is a new (rows, d) shape, used once: a small cache bounds the memory (module doc).
TRAIN_ONEDNN_CACHE = 64
# Training whose rows come in steps (nmt/model/row_buckets.py): its few shapes recur, and
# so do many attention shapes.
TRAIN_BUCKETED_ONEDNN_CACHE = 1024
# Inference: beam search meets a new row count at almost every step (rows shrink as
# sentences finish) and brings it back in the next batch of that size, so a long-lived
# process (`nmt serve`, a program holding a Translator, `nmt translate` on a large file)
# needs several thousand primitives in its working set. With oneDNN's 1024 they are evicted
# and rebuilt (about 1-2 ms each, a JIT-compiled kernel) over and over: measured on this
# project's CPU (Intel Xeon, AVX-512/AMX, bf16, 1 thread, the demo model), after a few
# minutes of mixed batches 32-sentence batches ran at 92-109 sentences/s instead of 127,
# a 1-line translation took 64-71 ms instead of 53, and 520-line batches 156-171 instead of
# 175; with 4096, 129-146, 51-56 ms and 192-216, for about 0.6 GB more peak memory (3.75
# vs 3.18 GB after the same load). 8192 gave the same speed.
INFERENCE_ONEDNN_CACHE = 4096


def size_onednn_cache(capacity: int) -> None:
    """Make oneDNN keep `capacity` primitives unless the user set
    ONEDNN_PRIMITIVE_CACHE_CAPACITY. oneDNN reads the variable when it creates its first
    primitive, so this must run before the process's first oneDNN operation (the trainer
    calls it before building the model, the translator before loading one); later calls
    change nothing, and the first caller's size holds (a translator inside a training
    process keeps the trainer's)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
