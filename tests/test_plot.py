"""`nmt plot RUN_DIR`: a train_log.jsonl in the shape nmt/train/loop.py writes -> PNG."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
from helpers.cli import NmtCli

from nmt.errors import DataError
from nmt.plot import read_run_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train_record(step: int, minutes: float) -> dict:
    """A `kind: train` record with the keys of RunLog.train (nmt/train/log.py)."""
    nll = 8.0 * math.exp(-step / 300) + 2.0
    return {"kind": "train", "step": step, "epoch": 1 + step // 500, "loss": nll + 0.4,
            "nll": nll, "ppl": math.exp(nll), "lr": 7e-4 * min(step / 200, (200 / step) ** 0.5),
            "grad_norm": 1.5, "tokens_per_s": 9000.0 + step, "target_tokens": 4000,
            "updates": 50, "update_freq": 1, "world_size": 1, "skipped_updates": 0,
            "skipped_pairs": 0, "loss_scale": None, "wall_time": 1.7e9 + minutes * 60,
            "elapsed_minutes": minutes}


def valid_record(step: int, minutes: float, bleu: float | None) -> dict:
    """A `kind: valid` record with the keys of RunLog.valid (nmt/train/log.py)."""
    record = {"kind": "valid", "step": step, "epoch": 1, "valid_loss": 4.0 - step / 1000,
              "valid_nll": 3.5 - step / 1000, "valid_ppl": math.exp(3.5 - step / 1000),
              "wall_time": 1.7e9 + minutes * 60, "elapsed_minutes": minutes}
    if bleu is not None:
        record["valid_bleu"] = bleu
    return record


def write_log(run: Path, records: list[dict], tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "train_log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")
    return path


def resumed_run(run: Path, bleu: bool = True) -> Path:
    """Steps 50..600, a crash, a resume from step 400, steps 450..1000, a cut last line."""
    records = [train_record(s, s / 100) for s in range(50, 650, 50)]
    records += [valid_record(s, s / 100 + 0.05, 10.0 + s / 100 if bleu else None)
                for s in (200, 400, 600)]
    records += [train_record(s, s / 100 + 1.0) for s in range(450, 1050, 50)]
    records += [valid_record(s, s / 100 + 1.05, 10.0 + s / 100 if bleu else None)
                for s in (600, 800, 1000)]
    return write_log(run, records, tail='{"kind": "train", "step": 10')


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


def test_read_run_log_drops_superseded_and_cut_records(tmp_path: Path) -> None:
    log = read_run_log(resumed_run(tmp_path / "run"))
    steps = [r["step"] for r in log.train]
    assert steps == [*range(50, 450, 50), *range(450, 1050, 50)]
    assert [r["step"] for r in log.valid] == [200, 400, 600, 800, 1000]
    # the resumed run's record for step 600 replaced the crashed run's
    assert log.valid[2]["elapsed_minutes"] == pytest.approx(7.05)


def test_malformed_middle_line_names_file_and_line(tmp_path: Path, nmt_cli: NmtCli) -> None:
    path = write_log(tmp_path / "run", [train_record(50, 0.5)])
    path.write_text(path.read_text() + "not json\n" + json.dumps(train_record(100, 1)) + "\n")
    with pytest.raises(DataError, match=r"train_log.jsonl:2: not a JSON object"):
        read_run_log(path)
    result = nmt_cli.invoke("plot", str(tmp_path / "run"))
    assert result.returncode == 3
    assert "train_log.jsonl:2" in result.output


def test_missing_log_is_a_data_error(tmp_path: Path, nmt_cli: NmtCli) -> None:
    (tmp_path / "run").mkdir()
    result = nmt_cli.invoke("plot", str(tmp_path / "run"))
    assert result.returncode == 3
    assert "no training log" in result.output


def test_missing_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch,
                                                nmt_cli: NmtCli) -> None:
    run = resumed_run(tmp_path / "run").parent
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = nmt_cli.invoke("plot", str(run))
    assert result.returncode == 2
    assert "pip install 'nmt[plot]'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (run / "train_log.png").exists()


def test_plot_writes_png_with_a_row_per_quantity(tmp_path: Path, nmt_cli: NmtCli) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the nmt[plot] extra) is absent")
    run = resumed_run(tmp_path / "run").parent
    result = nmt_cli.invoke("plot", str(run))
    assert result.returncode == 0, result.output
    width, height_with_bleu = png_size(run / "train_log.png")
    assert width == 1200
    # without BLEU in the log, the dev BLEU row is left out: a shorter figure
    other = resumed_run(tmp_path / "run2", bleu=False).parent
    out = tmp_path / "curves.png"
    result = nmt_cli.invoke("plot", str(other), "-o", str(out))
    assert result.returncode == 0, result.output
    assert png_size(out)[1] < height_with_bleu
    assert not list(tmp_path.glob(".curves.png.*"))  # no temp file left behind


def test_output_must_be_png_in_an_existing_folder(tmp_path: Path, nmt_cli: NmtCli) -> None:
    run = resumed_run(tmp_path / "run").parent
    result = nmt_cli.invoke("plot", str(run), "-o", str(tmp_path / "x.pdf"))
    assert result.returncode == 2 and ".png" in result.output
    result = nmt_cli.invoke("plot", str(run), "-o", str(tmp_path / "no" / "x.png"))
    assert result.returncode == 2 and "does not exist" in result.output
