"""Keep freed host memory inside the process while training or translating on CPU.

glibc's malloc serves every block above its mmap threshold with a fresh mmap and gives it
back on free, so the large tensors a training step or a beam-search step allocates and
frees again (logits, activations) would be page-faulted in from scratch every time.
Switching mmap off and raising the trim threshold keeps freed blocks in the heap for the
next step. The price is memory: the setting is process-wide and nothing freed is given
back, so oneDNN's per-shape primitive cache (bf16 matmuls meet a new row count almost
every update) is sized down for training and up for long-running translators. The
measurements behind each setting: docs/performance.md ("Measurements behind the code").

A training process also wants glibc's heap in transparent huge pages: with 4 KiB pages it
slows down as its heap spreads (docs/training.md, "On a CPU"). glibc takes
that setting only from the environment at process start, so `nmt train` re-executes
itself once with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from collections.abc import Mapping

from nmt.switches import switch

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
# Training whose rows come in steps (nmt/train/linears.py): its few shapes recur, and
# so do many attention shapes.
TRAIN_BUCKETED_ONEDNN_CACHE = 1024
# Inference: beam search meets a new row count at almost every step (rows shrink as
# sentences finish) and brings it back in the next batch of that size, so a long-lived
# process (`nmt serve`, a program holding a Translator, `nmt translate` on a large file)
# needs several thousand primitives in its working set. With oneDNN's 1024 they are evicted
# and rebuilt (each a JIT-compiled kernel) over and over, which slows a long-lived process
# down; 4096 costs some peak memory (docs/performance.md, "Measurements behind the code").
INFERENCE_ONEDNN_CACHE = 4096


def size_onednn_cache(capacity: int) -> None:
    """Make oneDNN keep `capacity` primitives unless the user set
    ONEDNN_PRIMITIVE_CACHE_CAPACITY. oneDNN reads the variable when it creates its first
    primitive, so this must run before the process's first oneDNN operation (the trainer
    calls it before building the model, the translator before loading one); later calls
    change nothing, and the first caller's size holds (a translator inside a training
    process keeps the trainer's)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


HUGETLB_TUNABLE = "glibc.malloc.hugetlb"  # glibc 2.35+: 1 = madvise the heap's huge pages
HUGE_PAGE_SETTING = f"{HUGETLB_TUNABLE}=1"  # what `nmt train` adds to GLIBC_TUNABLES
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise or never), None without
    THP (not Linux, or a kernel built without it)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_version(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return (0,)


def _hugetlb_settings(environ: Mapping[str, str]) -> list[str]:
    """The values GLIBC_TUNABLES gives the heap's huge-page tunable, in order."""
    return [item.partition("=")[2] for item in environ.get("GLIBC_TUNABLES", "").split(":")
            if item.partition("=")[0] == HUGETLB_TUNABLE]


def huge_page_heap_env(environ: Mapping[str, str], libc: tuple[str, str] | None = None,
                       mode: str | None = "") -> dict[str, str] | None:
    """The environment to re-execute a training process in so that glibc (`libc`, as
    platform.libc_ver() gives it; this machine's by default) puts its heap in transparent
    huge pages (THP `mode`; this kernel's by default); None where that cannot apply or is
    decided already: not glibc 2.35+, THP never or absent, or a GLIBC_TUNABLES that sets
    the tunable either way (the user's choice stands, and a process started with it is not
    re-executed again)."""
    libc = platform.libc_ver() if libc is None else libc
    mode = thp_mode() if mode == "" else mode
    if libc[0] != "glibc" or _glibc_version(libc[1]) < (2, 35):
        return None
    if mode not in ("always", "madvise"):
        return None
    if _hugetlb_settings(environ):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    env = dict(environ)
    env["GLIBC_TUNABLES"] = (f"{tunables}:{HUGE_PAGE_SETTING}" if tunables
                             else HUGE_PAGE_SETTING)
    return env


def heap_in_huge_pages(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process was started with glibc's heap in huge pages (its last
    setting of the tunable is 1)."""
    settings = _hugetlb_settings(environ)
    return bool(settings) and settings[-1] == "1"


def reexec_with_huge_page_heap() -> None:
    """Replace this process by the same command line with glibc's heap in huge pages
    (huge_page_heap_env), once; returns where that does not apply or exec fails. Only
    for a process's entry point, before it has done anything (the CLI's `nmt train`);
    the switch NMT_HUGE_PAGE_HEAP=0 turns it off."""
    if switch("NMT_HUGE_PAGE_HEAP") == "0":
        return
    env = huge_page_heap_env(os.environ)
    if env is None or not sys.executable:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
