"""keep_freed_memory: applies on glibc Linux, is idempotent, and big tensors still work."""

from __future__ import annotations

import platform

import torch

from nmt.host_memory import keep_freed_memory


def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
    assert keep_freed_memory() is glibc
    for _ in range(3):  # blocks far above the old mmap threshold: served and freed by the heap
        big = torch.ones(3000, 10000)  # 120 MB
        assert float(big.sum()) == 3e7
        del big
