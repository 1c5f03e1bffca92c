"""keep_freed_memory and limit_onednn_cache: the CPU memory policy of nmt/host_memory.py."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from nmt.host_memory import ONEDNN_CACHE_CAPACITY, keep_freed_memory, limit_onednn_cache


def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
    assert keep_freed_memory() is glibc
    for _ in range(3):  # blocks far above the old mmap threshold: served and freed by the heap
        big = torch.ones(3000, 10000)  # 120 MB
        assert float(big.sum()) == 3e7
        del big


def test_limit_onednn_cache_sets_the_default_and_respects_the_user(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    limit_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")  # the user's choice wins
    limit_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
