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
