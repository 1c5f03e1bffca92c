"""bench/gpu_session.py, the one-command GPU visit: its dry run (CPU, toy sizes) runs every
step to the end, so the visit cannot rot between GPU sessions; the budget skips what does
not fit; a bad --only is a usage error. The dry run's two halves of bench/gpu_check.py are
also where that script's whole dry run is checked, check by check (run once, not twice:
tests/test_gpu_check.py has its other cases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_session.py"
CUDA_ONLY = {"translate_fp16", "host_syncs", "big_memory"}  # n/a on a CPU
EVERY_CHECK = {"train_cpu_fp32", "train_bf16", "train_fp16", "resume", "translate_cpu_fp32",
               "translate_fp32", "translate_bf16", "nbest", "sampling", "ensemble",
               "attention", "shape_8gpu", "torchrun_2proc"} | CUDA_ONLY


def _report(log: Path) -> dict:
    """bench/gpu_check.py's JSON report: the last line of a step's log."""
    return json.loads(log.read_text(encoding="utf-8").strip().splitlines()[-1])


def _session(tmp_path: Path, *args: str, shared: Path | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if shared is not None:
        env["NMT_SHARED_DATA"] = str(shared)
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_runs_every_step(tmp_path, multi30k_dir):
    result = _session(tmp_path, "--dry-run", "--only", "first,second,third", "--budget-s", "1200",
                      shared=multi30k_dir.parent, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in
             (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    names = [s["step"] for s in steps]
    assert names[:4] == ["tests", "check_train", "check_other", "matmul_peak"]
    assert names[-2:] == ["speed", "quality"]
    assert {"train_base_1gpu", "train_big_8gpu", "train_base_1gpu_profile",
            "train_base_1gpu_compile"} <= set(names)
    assert all(s["rc"] == 0 and not s["timed_out"] for s in steps), steps
    assert "where the time went:" in result.stdout
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "gpu_session" and summary["failed"] == []
    score = (tmp_path / "out" / "quality.log").read_text()
    assert "BLEU = " in score and "chrF2 = " in score
    # bench/gpu_check.py's dry run in the session's two halves: together every check, each
    # once, passed on the CPU (the CUDA-only ones n/a), none passed off as a GPU figure.
    train, other = (_report(tmp_path / "out" / f"{half}.log")
                    for half in ("check_train", "check_other"))
    assert all(r["bench"] == "gpu_check" and r["dry_run"] and r["failed"] == []
               for r in (train, other))
    assert not set(train["checks"]) & set(other["checks"])
    checks = {**train["checks"], **other["checks"]}
    assert set(checks) == EVERY_CHECK
    for name, check in checks.items():
        assert check["status"] == ("n/a" if name in CUDA_ONLY else "ok"), (name, check)
    assert checks["resume"]["killed"] and checks["resume"]["end"] == train["updates"]
    assert checks["translate_fp32"]["lines"] == train["lines"]
    assert checks["torchrun_2proc"]["world_sizes"] == [2]  # on the prepared Multi30k
    assert not checks["shape_8gpu"]["on_gpu"] and not checks["torchrun_2proc"]["on_gpu"]


def test_budget_skips_what_does_not_fit_and_bad_only_is_refused(tmp_path):
    result = _session(tmp_path, "--dry-run", "--only", "tests,speed", "--budget-s", "10")
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in
             (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s.get("skipped")) for s in steps] == [
        ("tests", None, "out of --budget-s"), ("speed", None, "out of --budget-s")]
    bad = _session(tmp_path, "--only", "tests,warp")
    assert bad.returncode == 2 and "--only: unknown warp" in bad.stderr


@pytest.mark.slow
def test_dry_run_of_the_levers(tmp_path):
    """The levers group (issue 71's GPU run) in its dry run: its eager steps run on the CPU
    (the compiled ones are the same script with --compile --cuda-graphs --max-buckets,
    tests/test_gpu_speed_benches.py: each compile costs CI a minute)."""
    steps = "levers_peak,levers_sdpa,levers_base_eager,levers_base_half,levers_base_planned"
    result = _session(tmp_path, "--dry-run", "--only", steps, "--budget-s", "600",
                      timeout=700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    names = [s["step"] for s in report["steps"] if s["step"] != "install"]
    assert names == steps.split(",")
    assert all(s["rc"] == 0 for s in report["steps"])
    sdpa = json.loads((tmp_path / "out" / "levers_sdpa.log").read_text().splitlines()[-1])
    assert sdpa["padding_mask"]["finite"] and sdpa["padding_mask"]["grads_finite"]
