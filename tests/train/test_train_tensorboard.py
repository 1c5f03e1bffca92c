"""`nmt train --tensorboard DIR`: the JSONL log's scalars and the settings as TensorBoard
events, read back with TensorBoard's own reader; a resumed run logs each update once; a
missing package is a one-line usage error."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from helpers.data import FAST, MODEL, MODEL_FLAGS, multi30k_data

from nmt.config import TrainConfig
from nmt.train.log import read_jsonl
from nmt.train.loop import train

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed "
                    "(pip install -e '.[dev]' installs it)")


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> Path:
    """300 real Multi30k pairs (+20 valid), joint BPE 400."""
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=300, n_valid=20,
                         vocab_size=400)


def _events(directory: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _cfg(**changes) -> TrainConfig:
    settings = dict(log_interval=5, valid_interval=10, save_interval_updates=10,
                    lr_schedule="linear")
    return dataclasses.replace(TrainConfig(**FAST), **{**settings, **changes})


def test_scalars_and_settings_match_the_jsonl_log(m30k, tmp_path, one_thread):
    run, board = tmp_path / "run", tmp_path / "board"
    train(m30k, run, MODEL, _cfg(max_updates=20), "cpu", progress=False, tensorboard=board)
    records = read_jsonl(run / "train_log.jsonl")
    events = _events(board)
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/nll", "train/ppl", "train/lr", "train/progress",
            "train/tokens_per_s", "train/grad_norm", "valid/loss", "valid/nll",
            "valid/ppl"} <= tags, tags
    for record in (r for r in records if r["kind"] == "train"):
        for name in ("loss", "lr", "progress", "tokens_per_s"):
            [event] = [e for e in events.Scalars(f"train/{name}") if e.step == record["step"]]
            assert event.value == pytest.approx(record[name], rel=1e-6)
    valid = [r for r in records if r["kind"] == "valid"]
    assert [e.step for e in events.Scalars("valid/loss")] == [r["step"] for r in valid] \
        == [10, 20]
    assert [e.value for e in events.Scalars("valid/loss")] == pytest.approx(
        [r["valid_loss"] for r in valid], rel=1e-6)
    [settings] = events.Tensors("settings/text_summary")
    text = settings.tensor_proto.string_val[0].decode()
    assert "| lr_schedule | \"linear\" |" in text and "| model.d_model | 64 |" in text


def test_resumed_run_logs_each_update_once(m30k, tmp_path, one_thread):
    """A run that logged updates 11-12 after its last save at 10 (as a killed one does:
    here the update-10 checkpoint is put back as the resume point), resumed to 20: each
    update appears once in TensorBoard, 11 and 12 with the resumed run's numbers."""
    import shutil

    run, board = tmp_path / "run", tmp_path / "board"
    cfg = dict(log_interval=1, save_interval_updates=10)
    train(m30k, run, MODEL, _cfg(max_updates=12, **cfg), "cpu", progress=False,
          tensorboard=board)
    (run / "checkpoint_last.pt").unlink()
    shutil.copy(run / "checkpoint_10.pt", run / "checkpoint_last.pt")
    train(m30k, run, MODEL, _cfg(max_updates=20, **cfg), "cpu", progress=False,
          tensorboard=board)
    events = _events(board).Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 21))
    records = {r["step"]: r for r in read_jsonl(run / "train_log.jsonl")
               if r["kind"] == "train"}
    assert sorted(records) == list(range(1, 21))
    assert [e.value for e in events] == pytest.approx(
        [records[step]["loss"] for step in range(1, 21)], rel=1e-6)


def test_without_the_package_it_is_a_usage_error(m30k, tmp_path, nmt_cli, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    result = nmt_cli.invoke("train", str(m30k), "-o", str(tmp_path / "run"), *MODEL_FLAGS,
                            "--max-updates", "1", "--tensorboard", str(tmp_path / "tb"))
    output = result.out + result.err
    assert result.returncode == 2, output
    assert "--tensorboard needs the tensorboard package: pip install 'nmt[tensorboard]'" \
        in output
    assert "Traceback" not in output and not (tmp_path / "run").exists()
