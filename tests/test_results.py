"""bench/results: the records behind the docs' figures parse and hold the required fields,
every results table renders as a markdown table, and the benches' --record appends a
well-formed record (bench/gpu_train_speed.py's CPU smoke, bench/record_demo.py on a fake
run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.modules import by_path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


record = by_path("results_record_under_test", RESULTS / "record.py")
tables = by_path("results_tables_under_test", RESULTS / "tables.py")


@pytest.mark.parametrize("kind", record.KINDS)
def test_records_parse_with_the_required_fields(kind):
    path = RESULTS / f"{kind}.jsonl"
    assert path.exists(), f"{path} missing (an empty file where nothing is measured yet)"
    records = record.load(kind)  # raises on a malformed line, naming it
    for rec in records:
        assert set(record.REQUIRED) <= set(rec) and rec["kind"] == kind
        assert not record.problems(rec)
        assert rec["figures"] and rec["cpu"]["class"] in (None, *tables.CLASS_ORDER)
    dates = [rec["date"] for rec in records]
    assert dates == sorted(dates), "records are kept in the order measured"
    if kind != "gpu-translate":  # the one kind no GPU visit has measured yet
        assert records


def test_problems_names_what_is_wrong():
    good = record.make("demo", "nmt", {"minutes": 15}, {"bleu": 40.0}, None,
                       command="make demo", date="2026-12-05", commit="abc1234")
    assert record.problems(good) == []
    assert record.problems({**good, "kind": "nope"})
    assert record.problems({**good, "date": "5 Dec"})
    assert record.problems({**good, "figures": {"bleu": "high"}})
    assert record.problems({k: v for k, v in good.items() if k != "commit"})
    gpu = record.make("gpu-train", "nmt", {}, {"step_time_ms": 1.0}, None, command="x",
                      date="2026-12-05", commit="abc1234")
    assert set(record.GPU_FIELDS) <= set(gpu["gpu"])


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_tables_render_as_markdown(name):
    text = tables.TABLES[name]()
    assert text == tables.TABLES[name](), "deterministic"
    lines = text.splitlines()
    assert len(lines) >= 3 and set(lines[1]) <= set("|-")
    columns = {line.count(" | ") for line in lines if not set(line) <= set("|-")}
    assert len(columns) == 1, lines
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:])


def test_demo_table_shows_the_latest_run_and_the_range_of_its_recipe():
    text = tables.TABLES["results-demo"]()
    zen5 = next(line for line in text.splitlines()
                if "Zen 5" in line and "native" in line)
    assert "40.73" in zen5 and "4,383" in zen5 and "(1 run)" in zen5


def test_append_writes_whole_lines(tmp_path):
    path = tmp_path / "sub" / "demo.jsonl"
    recs = [record.make("demo", "nmt", {}, {"bleu": b}, None, command="make demo",
                        date="2026-12-05", commit="abc1234") for b in (1.0, 2.0)]
    assert record.append(recs, path) == 2 and record.append([], path) == 0
    assert [r["figures"]["bleu"] for r in record.load("demo", path)] == [1.0, 2.0]
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=":3:"):
        record.load("demo", path)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=600, env=ENV, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_gpu_train_speed_smoke_records(tmp_path):
    """--record PATH on the CPU smoke appends one record per loss, from the bench's own
    report and `nmt doctor`'s CPU facts."""
    path = tmp_path / "gpu-train.jsonl"
    _run(["bench/gpu_train_speed.py", "--smoke", "--record", str(path)])
    (rec,) = record.load("gpu-train", path)
    assert rec["system"] == "nmt" and rec["settings"]["smoke"] is True
    assert rec["settings"]["arch"] == "tiny" and rec["settings"]["loss"] == "reference"
    assert rec["figures"]["step_time_ms"] > 0 and rec["figures"]["tokens_per_s"] > 0
    assert rec["command"].startswith("python bench/gpu_train_speed.py --smoke --record")
    assert rec["cpu"]["flags"] is not None and rec["cpu"]["class"]
    assert rec["gpu"]["device"] is None  # a CPU: no GPU pretended


def test_record_demo_reads_a_finished_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "test.score").write_text(
        "BLEU = 40.73 70.6/47.4/34.2/25.0 (BP = 0.990 ratio = 0.991)\nsignature: x\n"
        "chrF2 = 64.42\nsignature: y\n")
    log = [{"kind": "train", "step": 4350, "elapsed_minutes": 14.9},
           {"kind": "valid", "step": 4383, "elapsed_minutes": 15.0}]
    (run / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    (run / "checkpoint_4383.pt").write_bytes(b"")
    (run / "decoding.json").write_text(json.dumps({"alpha": 1.4, "beam": 4}))
    path = tmp_path / "demo.jsonl"
    _run(["bench/record_demo.py", str(run), "--minutes", "15.7", "--record", str(path)])
    (rec,) = record.load("demo", path)
    assert rec["figures"] == {"bleu": 40.73, "chrf": 64.42, "updates": 4383,
                              "train_minutes": 15.0, "minutes": 15.7}
    assert rec["settings"]["alpha"] == "tuned (1.4)" and rec["command"].endswith("make demo")
