"""bench/gpu_model.py, the model of one GPU update's time from CPU counts: on a synthetic
counts file it fits the host cost to the two measured H200 figures and reports the error on
each, never predicts a slower update for fewer host ops, calls an update under CUDA graphs
device-limited, and refuses a file without the base eager records (exit 2, one line). The
fit itself recovers a known host cost. No timing: the figures are the model's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_model.py"
BASE_PARAMS = 63_082_496


def _load(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/gpu_model.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("gpu_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_model", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def _record(arch: str, lever: str, shape: str, host_ops: int, kernels: int,
            host_cost_class: str = "eager", params: int = BASE_PARAMS) -> dict[str, Any]:
    """A plausible counted update: base's WMT-like shapes (about 93 % of the padded tokens
    real, both sides), each token multiplying about half the parameters."""
    micro_batches, micro_tokens = (3, 8805) if shape == "1gpu" else (1, 3308)
    tokens = round(2 * micro_batches * micro_tokens * 0.93)
    return {"arch": arch, "lever": lever, "shape": shape,
            "micro_batches": micro_batches, "micro_tokens": micro_tokens,
            "tokens_per_update": tokens, "host_ops_per_update": host_ops,
            "kernels_per_update": kernels,
            "model_flops_per_update": 6 * params * tokens / 2,
            "attention_flops_per_update": 0.05 * 6 * params * tokens / 2,
            "bytes_per_update": 1.2e6 * tokens, "host_cost_class": host_cost_class}


def _counts() -> list[dict[str, Any]]:
    """Base eager at both shapes (3 x 3,330 + 6 and 3,336 host ops), the levers at the
    1-GPU shape with no more of anything than eager, and big eager."""
    return [
        _record("base", "eager", "1gpu", 3 * 3330 + 6, 3 * 1630 + 6),
        _record("base", "eager", "8gpu", 3336, 1636),
        _record("base", "bf16-weights", "1gpu", 3 * 2850 + 6, 3 * 1150 + 6),
        _record("base", "compile", "1gpu", 3 * 900 + 6, 3 * 900 + 6, "compiled"),
        _record("base", "cuda-graphs", "1gpu", 3 + 40, 3 * 900 + 6, "graphed"),
        _record("big", "eager", "1gpu", 3 * 3330 + 6, 3 * 1630 + 6, params=214_245_376),
    ]


def _run(tmp_path: Path, records: list[dict[str, Any]], *args: str
         ) -> subprocess.CompletedProcess[str]:
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"records": records}), encoding="utf-8")
    return subprocess.run([sys.executable, str(SCRIPT), str(counts), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fit_calibration_and_levers(tmp_path):
    proc = _run(tmp_path, _counts())
    result = _result(proc)
    assert result["bench"] == "gpu_model" and result["host_cost_fitted"] is True
    assert 1.0 < result["host_cost_us"] < 50.0
    calibration = {row["shape"]: row for row in result["calibration"]}
    assert set(calibration) == {"1gpu", "8gpu"}
    for row, measured in ((calibration["1gpu"], 140.2), (calibration["8gpu"], 40.0)):
        assert row["measured_ms"] == measured and row["shape_matches"]
        assert row["predicted_ms"] == pytest.approx(measured * (1 + row["error_pct"] / 100),
                                                    abs=0.01)
        assert abs(row["error_pct"]) < 30  # these counts are host-bound like the H200's
    assert result["assumptions"] and result["constants"]["matmul_efficiency"] == 0.7

    preds = {(p["arch"], p["shape"], p["lever"]): p for p in result["predictions"]}
    eager = preds[("base", "1gpu", "eager")]
    assert eager["limit"] == "host"
    # Every lever counts no more host ops (and no more of anything else) than eager: none
    # may predict a slower update, and the one with fewest host ops is the fastest.
    levers = [p for k, p in preds.items() if k[:2] == ("base", "1gpu")]
    assert all(p["ms_per_update"] <= eager["ms_per_update"] for p in levers)
    graphs = preds[("base", "1gpu", "cuda-graphs")]
    assert graphs["limit"] == "device" and graphs["host_ms"] < graphs["device_ms"]
    assert graphs["ms_per_update"] == min(p["ms_per_update"] for p in levers)
    assert 0 < graphs["mfu"] < 1 and graphs["mfu_datasheet"] < graphs["mfu"]
    # Tables in the levers' order, per arch and shape.
    out = proc.stdout
    assert out.index("base, 1gpu") < out.index("base, 8gpu") < out.index("big, 1gpu")
    table = out[out.index("base, 1gpu"):out.index("base, 8gpu")]
    assert (table.index("eager") < table.index("bf16-weights") < table.index("compile")
            < table.index("cuda-graphs"))


def test_given_host_cost_and_h100(tmp_path):
    h200 = _result(_run(tmp_path, _counts(), "--host-cost-us", "12"))
    assert h200["host_cost_us"] == 12 and h200["host_cost_fitted"] is False
    assert len(h200["calibration"]) == 2  # errors still reported, not fitted
    h100 = _result(_run(tmp_path, _counts(), "--host-cost-us", "12", "--device", "h100"))
    assert h100["device_name"] == "NVIDIA H100 SXM"
    for a, b in zip(h200["predictions"], h100["predictions"], strict=True):
        assert b["device_ms"] > a["device_ms"]  # same peak assumed, less bandwidth
        assert b["host_ms"] == a["host_ms"]


@pytest.mark.parametrize("drop", ["1gpu", "8gpu"])
def test_refuses_counts_without_base_eager(tmp_path, drop):
    records = [r for r in _counts()
               if not (r["arch"] == "base" and r["lever"] == "eager" and r["shape"] == drop)]
    proc = _run(tmp_path, records)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "base eager" in lines[0] and drop in lines[0]


def test_refuses_malformed_record(tmp_path):
    records = _counts()
    del records[2]["kernels_per_update"]
    proc = _run(tmp_path, records)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "kernels_per_update" in proc.stderr


def test_fit_host_cost_recovers_known_cost(monkeypatch):
    gm = _load(monkeypatch)
    consts = gm.Consts(gm.DEVICES["h200"], host_cost_eager_us=12.5)
    records = [gm.Record.from_json(r) for r in _counts()[:2]]
    # A third figure the device limits (few host ops, much traffic) must not bias the fit.
    records.append(gm.Record.from_json({**_counts()[1], "host_ops_per_update": 100,
                                        "bytes_per_update": 4e11}))
    measured = [gm.predict(r, consts).ms_per_update for r in records]
    assert gm.predict(records[2], consts).limit == "device"
    assert gm.fit_host_cost(records, measured) == pytest.approx(12.5, rel=1e-9)
    # Figures 10 % slower than the model at 8 us: between, and each within 10 %.
    slow = [1.1 * gm.predict(r, replace(consts, host_cost_eager_us=8.0)).ms_per_update
            for r in records[:2]]
    assert 8.0 < gm.fit_host_cost(records[:2], slow) < 8.0 * 1.12
    with pytest.raises(ValueError):
        gm.fit_host_cost(records[:2], [140.2])


def test_fewer_host_ops_never_slower(monkeypatch):
    gm = _load(monkeypatch)
    base = gm.Record.from_json(_counts()[0])
    for device in gm.DEVICES.values():
        consts = gm.Consts(device, host_cost_eager_us=13.0)
        for cls in gm.HOST_COST_CLASSES:
            times = [gm.predict(replace(base, host_ops_per_update=n, host_cost_class=cls),
                                consts).ms_per_update
                     for n in range(10_000, -1, -250)]
            assert all(b <= a for a, b in pairwise(times))
