"""Shared fixtures: where the real parallel data lives, and a clean CLI runner."""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch's inductor caches compiled kernels on disk without keying them by
# ATEN_CPU_CAPABILITY: a kernel compiled in a run capped at AVX2 and loaded by an uncapped
# one crashed it ("double free or corruption"), and the reverse computed wrong results (torch
# 2.13.0, test_projected_loss's compiled test). A capped run (`make test`'s second pass)
# therefore compiles into a cache of its own.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
if _CAPABILITY and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_CAPABILITY}")

import torch  # noqa: E402  (after the cache directory is chosen)

REPO = Path(__file__).resolve().parents[1]
# Real data sits beside the project, never inside it (see ../shared/data/README.md).
SHARED_DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_data_path(*parts: str) -> Path:
    """Path under ../shared/data, skipping the calling test with a reason if it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data not found at {path} (expected ../shared/data beside the repo; "
                    "set NMT_SHARED_DATA to its location)")
    return path


@pytest.fixture
def multi30k_dir() -> Path:
    """../shared/data/multi30k: train/val/test_2016_flickr .en/.de, untokenized."""
    return shared_data_path("multi30k")


@pytest.fixture
def wmt14_dir() -> Path:
    """../shared/data/wmt14: newstest2013/2014 plain text and the 2014 SGML."""
    return shared_data_path("wmt14")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Run a test with one torch thread (its subprocesses run with one too, and on a small
    shared CPU two contending threads are many times slower than one)."""
    with torch_threads(1):
        yield
