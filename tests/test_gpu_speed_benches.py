"""bench/gpu_train_speed.py and bench/gpu_translate_speed.py in their CPU smoke modes, so
the scripts a GPU session runs for issue 14 cannot rot between GPU sessions. Checks the
JSON line's fields, not speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(args: list[str], env: dict[str, str] | None = None) -> dict:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=600, env=env or ENV, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("loss", ["reference", "fused"])
def test_train_speed_smoke(loss):
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--loss", loss])
    assert report["bench"] == "gpu_train_speed" and report["smoke"] and report["loss"] == loss
    assert report["arch"] == "tiny" and report["device"] == "cpu" and report["updates"] == 2
    assert report["finite"] and report["tokens_per_s"] > 0 and report["step_time_s"] > 0
    assert report["src_tokens"] > 0 and report["tgt_tokens"] > 0
    assert report["mfu"] is None  # no peak for a CPU
    params = report["params"]
    assert params["encoder"] + params["decoder"] + params["output_projection"] == \
        params["total"]
    assert report["model_tflops"] > 0 and report["attention_tflops"] > 0


def test_train_speed_mfu_with_a_given_peak():
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--peak-tflops", "1"])
    assert report["mfu"] == pytest.approx(report["model_tflops"] / 1.0)
    assert report["mfu_with_attention"] > report["mfu"]
    assert report["mfu_6n_all_tokens"] > report["mfu"]


def test_translate_speed_smoke(wmt14_dir, tmp_path):
    env = {**ENV, "NMT_SHARED_DATA": str(wmt14_dir.parent)}
    report = _run(["bench/gpu_translate_speed.py", "--smoke", "--cache", str(tmp_path)], env)
    assert report["bench"] == "gpu_translate_speed" and report["smoke"]
    assert report["lines"] == 20 and report["beam"] == 4 and report["alpha"] == 0.6
    nmt = report["nmt"]["fp32"]
    assert nmt["sentences"] == 20 and nmt["sentences_per_s"] > 0 and nmt["tgt_tokens"] > 0
    if report["ct2"]:  # ctranslate2 importable (the dev extra) or bench/.venv-ct2 present
        ct2 = report["ct2"]["float32"]
        assert ct2["sentences"] == 20 and ct2["logp_max_abs_diff"] < 1e-3
        assert report["ratios"]["ct2_float32_over_nmt_fp32"] > 0
    else:
        assert report["ct2_skipped"]
