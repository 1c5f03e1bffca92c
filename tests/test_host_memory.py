"""keep_freed_memory, size_onednn_cache and the heap in huge pages: the CPU memory policy of
nmt/host_memory.py, the oneDNN kernel cache a translator sizes before its first primitive,
and `nmt train`'s re-execution with glibc's heap in transparent huge pages."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmt.host_memory import (
    INFERENCE_ONEDNN_CACHE,
    TRAIN_ONEDNN_CACHE,
    heap_in_huge_pages,
    huge_page_heap_env,
    keep_freed_memory,
    size_onednn_cache,
    thp_mode,
)

REPO = Path(__file__).resolve().parents[1]


def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
    assert keep_freed_memory() is glibc
    for _ in range(3):  # blocks far above the old mmap threshold: served and freed by the heap
        big = torch.ones(3000, 10000)  # 120 MB
        assert float(big.sum()) == 3e7
        del big


def test_size_onednn_cache_sets_the_default_and_respects_the_user(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    size_onednn_cache(TRAIN_ONEDNN_CACHE)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(TRAIN_ONEDNN_CACHE)
    size_onednn_cache(INFERENCE_ONEDNN_CACHE)  # the first size holds
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(TRAIN_ONEDNN_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")  # the user's choice wins
    size_onednn_cache(INFERENCE_ONEDNN_CACHE)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


# In a fresh process: load a translator, then run one packed linear layer over 1,100 row
# counts twice and count the oneDNN inner-product primitives built (ONEDNN_VERBOSE).
_KERNEL_CACHE_PROBE = """
import os, sys, torch
torch.set_num_threads(1)
from nmt import Translator
Translator.load(sys.argv[1], precision="fp32", quiet=True)
print("capacity", os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), file=sys.stderr)
from nmt.inference.packed_linear import PackedLinear, works
if not works(torch.float32):
    print("no packed linears", file=sys.stderr)
    sys.exit(0)
layer = PackedLinear(torch.randn(32, 16), torch.randn(32))
x = torch.randn(1100, 16)
with torch.inference_mode():
    for _ in range(2):
        for rows in range(1, 1101):
            layer(x[:rows])
"""


def _primitives_built(ckpt: Path, capacity: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env["ONEDNN_VERBOSE"] = "profile_create"
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    done = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_PROBE, str(ckpt)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    if "no packed linears" in done.stderr:
        pytest.skip("oneDNN packed linears are not available in this torch build")
    built = sum(1 for line in done.stdout.splitlines()
                if "create:cache_miss" in line and ",inner_product," in line)
    return done.stderr.split("capacity ")[1].split()[0], built


def test_a_translator_keeps_thousands_of_kernels(tmp_path: Path):
    """Translator.load sizes oneDNN's cache before its first primitive, so a long-lived
    process stops rebuilding kernels: 1,100 row counts seen twice are built once (with
    oneDNN's default of 1024 the second pass rebuilds every one: the LRU cycles), and a
    capacity the user set is kept."""
    from conftest import shared_data_path
    from helpers.checkpoints import make_checkpoint, make_vocab

    ckpt = make_checkpoint(make_vocab(shared_data_path("multi30k"), tmp_path),
                           tmp_path / "model.pt")
    capacity, built = _primitives_built(ckpt, None)
    assert capacity == str(INFERENCE_ONEDNN_CACHE)
    assert 1100 <= built < 1300
    capacity, built = _primitives_built(ckpt, "1024")
    assert capacity == "1024"
    assert built >= 2200


GLIBC = ("glibc", "2.36")
HUGE = "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ, libc, mode, tunables", [
    ({}, GLIBC, "madvise", HUGE),
    ({}, GLIBC, "always", HUGE),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC, "madvise",
     "glibc.malloc.arena_max=2:" + HUGE),  # the user's other tunables kept
    ({}, ("glibc", "2.35"), "madvise", HUGE),
    ({}, ("glibc", "2.34"), "madvise", None),  # before the tunable existed
    ({}, ("", ""), "madvise", None),  # musl, macOS
    ({}, GLIBC, "never", None),
    ({}, GLIBC, None, None),  # a kernel without THP
    ({"GLIBC_TUNABLES": HUGE}, GLIBC, "madvise", None),  # already re-executed
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, "madvise", None),  # the user's no
])
def test_huge_page_heap_env_decides_when_to_re_execute(environ, libc, mode, tunables):
    env = huge_page_heap_env({"PATH": "/bin", **environ}, libc, mode)
    if tunables is None:
        assert env is None
    else:
        assert env == {"PATH": "/bin", **environ, "GLIBC_TUNABLES": tunables}
        assert heap_in_huge_pages(env)


@pytest.mark.parametrize("tunables, on", [
    (None, False), ("", False), (HUGE, True), ("glibc.malloc.hugetlb=0", False),
    ("glibc.malloc.arena_max=2:" + HUGE, True), (HUGE + ":glibc.malloc.hugetlb=0", False),
    ("glibc.malloc.hugetlb=2", False),  # 2 is hugetlbfs pages, not what the trainer asks
])
def test_heap_in_huge_pages_reads_the_last_setting(tunables, on):
    assert heap_in_huge_pages({} if tunables is None else {"GLIBC_TUNABLES": tunables}) is on


def test_thp_mode_reads_the_bracketed_mode(tmp_path: Path):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert thp_mode(str(mode)) == "madvise"
    mode.write_text("[always] madvise never\n")
    assert thp_mode(str(mode)) == "always"
    assert thp_mode(str(tmp_path / "absent")) is None


# The child prints its GLIBC_TUNABLES on every start, then runs the CLI: a re-executed
# process prints twice.
_SHOW_TUNABLES = ("import os, sys; print('tunables=' + os.environ.get('GLIBC_TUNABLES', ''), "
                  "file=sys.stderr, flush=True); from nmt.cli.main import main; main()")


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
def test_only_nmt_train_re_executes_with_the_heap_in_huge_pages(tmp_path: Path, nmt_cli):
    cli = nmt_cli.instrumented(_SHOW_TUNABLES)
    env = {"GLIBC_TUNABLES": None, "NMT_HUGE_PAGE_HEAP": None}
    applies = huge_page_heap_env(cli.env(env)) is not None  # on this machine
    train = cli.run("train", tmp_path / "absent", "-o", tmp_path / "run", env=env)
    assert train.returncode not in (0, -9), train.err  # the missing data dir's error
    starts = [line for line in train.err.splitlines() if line.startswith("tunables=")]
    assert starts == (["tunables=", "tunables=" + HUGE] if applies else ["tunables="])
    assert sum("absent" in line for line in train.err.splitlines()) == 1  # said once
    off = cli.run("train", tmp_path / "absent", "-o", tmp_path / "run",
                  env={**env, "NMT_HUGE_PAGE_HEAP": "0"})  # the switch turns it off
    assert [line for line in off.err.splitlines() if line.startswith("tunables=")] == [
        "tunables="]
    score = cli.run("score", "--help", env=env)  # other commands are left alone
    assert score.returncode == 0
    assert [line for line in score.err.splitlines() if line.startswith("tunables=")] == [
        "tunables="]
