"""bench/wmt_rehearsal.py's smoke run (3,000 pairs, a tiny model): the WMT14 recipe's whole
path, from archives with the real layout through prep (checksums verified, every cleaning
rule given work), bpe, training at a token budget, averaging, translating all of
newstest2014 and both scores, recorded as well-formed wmt-rehearsal records that the docs'
tables render."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_data_path
from helpers.modules import by_path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


@pytest.mark.slow
def test_smoke_rehearsal_runs_every_stage_and_records_it(tmp_path: Path) -> None:
    shared = shared_data_path()
    out = tmp_path / "records.jsonl"
    env = {**os.environ, "NMT_SHARED_DATA": str(shared), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "wmt_rehearsal.py"),
                             "--smoke", "--work", str(tmp_path / "work"), "--keep",
                             "--record", str(out)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = by_path("rehearsal_record_under_test", RESULTS / "record.py")
    records = record.load("wmt-rehearsal", out)  # raises on a malformed record
    stages = {r["settings"]["stage"]: r for r in records}
    assert list(stages) == ["build", "prep", "bpe", "train", "average", "translate",
                            "score-paper", "score-sacrebleu"]
    assert all(r["settings"]["smoke"] and r["settings"]["pairs"] == 3000 for r in records)
    for name in ("prep", "bpe", "train", "translate"):
        fig = stages[name]["figures"]
        assert fig["wall_s"] > 0 and fig["cpu_s"] > 0 and fig["peak_mib"] > 0, name
    # prep verified the built archives against the recipe copy and cleaned every case.
    manifest = json.loads((tmp_path / "work" / "data-3000" / "manifest.json").read_text())
    assert all(a["verified"].get("sha256") for a in manifest["archives"].values())
    c = stages["prep"]["figures"]["cleaning"]
    assert c["input"] == 3000 and c["output"] == stages["prep"]["figures"]["pairs_out"]
    for kept, before in (("after_max_words", "after_min_words"),
                         ("after_max_ratio", "after_max_words"),
                         ("after_dedup", "after_overlap")):
        assert c[kept] < c[before], (kept, c)
    assert c["output"] > 0.95 * c["input"]  # the recombined text stays distinct
    assert manifest["splits"]["test"]["lines"] == 3003
    assert stages["bpe"]["figures"]["vocab_s"] >= 0 < stages["bpe"]["figures"]["encode_s"]
    train = stages["train"]
    assert train["figures"]["tokens_per_update"] > 0 and "update-freq" in train["settings"][
        "plan"]
    assert stages["translate"]["figures"]["lines"] == 3003
    paper = stages["score-paper"]
    assert "moses-de+compound-split" in paper["settings"]["signature"]
    assert "tok:13a" in stages["score-sacrebleu"]["settings"]["signature"]
    # The docs' tables render from such a run (here from the smoke records themselves).
    tables = by_path("rehearsal_tables_under_test", RESULTS / "tables.py")
    tables._load = lambda kind: record.load(kind, out)  # smoke records are kept out otherwise
    text = tables.wmt_rehearsal_table()
    assert "| prep | 3,000 |" in text and "36,000,000 (En-Fr, projected)" in text
    assert "3,003 lines" in text
