"""bench/gpu_check.py in its CPU dry run: every step of the GPU check runs (toy sizes), so
the script a GPU session depends on cannot rot between GPU sessions. The whole dry run is
checked, check by check, where bench/gpu_session.py's dry run runs it
(tests/test_gpu_session.py), so that it runs once per suite; here the 8-GPU shape alone and
the script's parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _gpu_check(*args: str) -> dict:
    """Run bench/gpu_check.py ARGS; its JSON line (it must exit 0)."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), *args],
                            capture_output=True, text=True, timeout=1500, env=ENV,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _load_gpu_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/gpu_check.py as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.slow
def test_gpu_check_dry_run_8_gpu_shape_and_torchrun_smoke(tmp_path):
    """The two checks of the 8-GPU shape alone (--only), on a tiny prepared DATA: the
    per-GPU shape timed with both losses, and `nmt train` in 2 gloo processes under
    torchrun ending at the same update on both ranks, on the CPU and saying so."""
    from helpers.data import make_copy_data

    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    report = _gpu_check("--dry-run", "--out", str(tmp_path / "out"), "--data", str(data),
                        "--only", "shape_8gpu,torchrun_2proc")
    assert report["dry_run"] and report["failed"] == []
    assert set(report["checks"]) == {"shape_8gpu", "torchrun_2proc"}
    shape = report["checks"]["shape_8gpu"]
    assert shape["status"] == "ok" and shape["gpus"] == 8 and shape["update_freq"] == 1
    # 2048 real tokens per side over 8 GPUs, derived from the bench's WMT-like lengths:
    # micro-batches of 256 slots would hold fewer real tokens (the smoke's 3,308).
    assert shape["micro_tokens"] == shape["expected_micro_tokens"] == 292
    assert set(shape["by_loss"]) == {"reference", "fused"}
    assert all(f["finite"] and f["step_time_s"] > 0 for f in shape["by_loss"].values())
    assert shape["fastest_loss"] in shape["by_loss"]
    assert shape["first_update_loss_max_abs_diff"] < 1e-3
    # CPU figures are never passed off as GPU ones.
    assert not shape["on_gpu"] and shape["device"] == "cpu"
    assert "not GPU figures" in shape["detail"] and "GPU memory n/a" in shape["detail"]
    assert all("peak_memory_allocated_gib" not in f for f in shape["by_loss"].values())
    run = report["checks"]["torchrun_2proc"]
    assert run["status"] == "ok" and run["nproc"] == 2 and run["backend"] == "gloo"
    assert not run["on_gpu"] and "dry run" in run["detail"]
    assert run["world_sizes"] == [2]  # every logged update ran in 2 processes
    # 2048 real tokens per side: more than 2048 / (2 x 512) = 2 micro-batches, the data's
    # batches being less than full.
    assert run["update_freqs"] == [run["expected_update_freq"]] == [3]
    assert run["step"] == run["updates"] == 8
    assert run["rng_states"] == 2  # both ranks reached the last save
    ckpt = tmp_path / "out" / "runs" / "torchrun" / "checkpoint_last.pt"
    from nmt.checkpoint import load_checkpoint

    assert load_checkpoint(ckpt)["step"] == 8


def test_loss_tracking_and_guarded_checks_without_running_any(monkeypatch) -> None:
    """The fast loop's share: the script imports without a GPU, compares loss curves over
    the second half of the common updates, and turns a crashing check into a FAIL row
    (the other checks still run) instead of ending the script."""
    gpu_check = _load_gpu_check(monkeypatch)
    cpu = {10: 5.0, 20: 4.0, 30: 3.0, 40: 2.5}
    diff, ok = gpu_check.tracks({10: 9.0, 20: 9.0, 30: 3.1, 40: 2.4, 50: 1.0}, cpu, 0.15)
    assert diff == pytest.approx(0.1) and ok  # early updates and update 50 not compared
    assert gpu_check.tracks({30: 3.5, 40: 3.0}, cpu, 0.15)[1] is False
    assert gpu_check.tracks({}, cpu, 0.15)[1] is False

    def broken() -> None:
        raise RuntimeError("CUDA error: out of memory")

    (row,) = gpu_check.guarded("big_memory", broken)
    assert row.name == "big_memory" and row.status == "FAIL"
    assert row.detail == "RuntimeError: CUDA error: out of memory"
    assert gpu_check.guarded("n", lambda: gpu_check.Check("n")) == [gpu_check.Check("n")]


def test_torchrun_plan_and_only_without_running_any(monkeypatch) -> None:
    """Where the 2-process smoke runs: NCCL on 2 GPUs when 2 are visible; with one GPU (NCCL
    cannot put two ranks on one device) or in a dry run, gloo on the CPU, and the note
    says so. An unknown --only name is a usage error before anything runs."""
    gpu_check = _load_gpu_check(monkeypatch)
    two = gpu_check.torchrun_plan(dry=False, cuda_devices=2)
    assert two.backend == "nccl" and two.on_gpu and two.flags[:2] == ("--gpus", "2")
    assert "cuda" in two.flags and "bf16" in two.flags
    one = gpu_check.torchrun_plan(dry=False, cuda_devices=1)
    assert one.backend == "gloo" and not one.on_gpu and one.flags[:2] == ("--nproc", "2")
    assert "cpu" in one.flags and "NCCL path not exercised" in one.note
    dry = gpu_check.torchrun_plan(dry=True, cuda_devices=8)
    assert dry.backend == "gloo" and not dry.on_gpu and "dry run" in dry.note
    for plan in (two, one, dry):  # update-freq > 1 per process: DDP's no_sync path too
        assert plan.batch_tokens >= 2 * 2 * plan.max_tokens and plan.updates >= 2
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"),
                             "--only", "shape_8gpu,nope"], capture_output=True, text=True,
                            timeout=60, env=ENV, cwd=REPO)
    assert result.returncode == 2 and "unknown nope" in result.stderr
