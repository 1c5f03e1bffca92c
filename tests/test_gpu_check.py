"""bench/gpu_check.py in its CPU dry run: every step of the GPU check runs (toy sizes), so
the script a GPU session depends on cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_ONLY = {"translate_fp16", "host_syncs", "big_memory"}


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_check(multi30k_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NMT_SHARED_DATA": str(multi30k_dir.parent)}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"),
                             "--dry-run", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=1500, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "gpu_check" and report["dry_run"] and report["failed"] == []
    checks = report["checks"]
    expected = {"train_cpu_fp32", "train_bf16", "train_fp16", "resume", "translate_cpu_fp32",
                "translate_fp32", "translate_bf16", "nbest", "sampling", "ensemble",
                "attention"} | CUDA_ONLY
    assert set(checks) == expected
    for name, check in checks.items():
        assert check["status"] == ("n/a" if name in CUDA_ONLY else "ok"), (name, check)
    assert checks["resume"]["killed"] and checks["resume"]["end"] == report["updates"]
    assert checks["translate_fp32"]["lines"] == report["lines"]


def test_loss_tracking_and_guarded_checks_without_running_any(monkeypatch) -> None:
    """The fast loop's share: the script imports without a GPU, compares loss curves over
    the second half of the common updates, and turns a crashing check into a FAIL row
    (the other checks still run) instead of ending the script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
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
