"""train_log.jsonl: one record per update after a resume, no torn lines, no crash on a full
disk."""

from __future__ import annotations

import errno
import json
import shutil

import torch
from helpers.data import make_copy_data

from nmt.config import TrainConfig, model_preset
from nmt.train.best import BestTracker
from nmt.train.log import JsonlLog, LogWindow, PlainReporter, RunLog, read_jsonl
from nmt.train.loop import train


def _records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_reopen_for_resume_drops_redone_updates_and_torn_line(tmp_path):
    path = tmp_path / "train_log.jsonl"
    lines = [json.dumps({"kind": "train", "step": s}) for s in range(1, 7)]
    lines.insert(4, json.dumps({"kind": "valid", "step": 4, "valid_loss": 1.5}))
    path.write_text("\n".join(lines) + '\n{"kind": "train", "st', encoding="utf-8")
    log = JsonlLog(path, resume_step=4)
    log.write({"kind": "train", "step": 5})
    log.close()
    records = _records(path)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 1), ("train", 2), ("train", 3), ("train", 4), ("valid", 4), ("train", 5)]


def test_reopen_for_resume_removes_a_killed_rewrites_temp_file(tmp_path):
    """A resume's rewrite of the log killed with SIGKILL leaves `.train_log.jsonl.*.tmp`;
    the next resume removes it (found by the kill -9 test in tests/train/test_faults_train.py),
    even when its own log needs no rewrite, and leaves other files alone."""
    path = tmp_path / "train_log.jsonl"
    path.write_text(json.dumps({"kind": "train", "step": 1}) + "\n", encoding="utf-8")
    stale = tmp_path / ".train_log.jsonl.abc123.tmp"
    stale.write_text("half a rewrite", encoding="utf-8")
    other = tmp_path / ".checkpoint_5.pt.abc123.tmp"
    other.write_text("not the log's", encoding="utf-8")
    JsonlLog(path, resume_step=1).close()
    assert not stale.exists()
    assert other.exists()
    assert [r["step"] for r in _records(path)] == [1]


def test_run_log_writes_on_rank_zero_and_does_nothing_elsewhere(tmp_path, capsys):
    """The trainer writes through a RunLog: records and lines on rank 0; on the other
    ranks (no log, no reporter) every call is a no-op."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    window = LogWindow()
    window.add(True, 20.0, 18.0, 10, 25)
    best = BestTracker()
    best.observe({"loss": 2.5}, 3)
    for out in (RunLog(), RunLog(JsonlLog(tmp_path / "log.jsonl"), PlainReporter())):
        out.say("hello")
        out.train(window, scaler, 60.0, step=3, epoch=1, lr=0.1, progress=0.5,
                  grad_norm=1.0)
        out.valid(3, 1, {"loss": 2.5}, best, True, 60.0)
        out.close()
    train, valid = read_jsonl(tmp_path / "log.jsonl")
    assert (train["kind"], train["loss"], train["loss_scale"], train["elapsed_minutes"]) \
        == ("train", 2.0, None, 1.0)
    assert (valid["valid_loss"], valid["best"], valid["best_step"]) == (2.5, 2.5, 3)
    err = capsys.readouterr().err
    assert err.count("hello") == 1 and "valid at update 3: loss 2.500 (best so far)" in err


def test_fresh_open_keeps_an_existing_log_untouched_without_resume_step(tmp_path):
    path = tmp_path / "train_log.jsonl"
    path.write_text('{"step": 9}\n', encoding="utf-8")
    JsonlLog(path).close()
    assert path.read_text(encoding="utf-8") == '{"step": 9}\n'


class _FullDisk:
    """A text handle that writes a few characters of a line, then fails like a full disk."""

    def __init__(self, real):
        self.real = real

    def write(self, text):
        self.real.write(text[:7])
        self.real.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        self.real.flush()

    def tell(self):
        return self.real.tell()

    def close(self):
        self.real.close()


def test_failed_append_warns_once_cuts_torn_line_and_recovers(tmp_path):
    path = tmp_path / "train_log.jsonl"
    warnings = []
    log = JsonlLog(path, warn=warnings.append)
    log.write({"step": 1})
    log._handle = _FullDisk(log._handle)
    log.write({"step": 2})  # torn, cut back
    log._handle = _FullDisk(log._handle)
    log.write({"step": 3})  # still failing: no second warning
    log.write({"step": 4})  # the disk has room again
    log.close()
    assert [r["step"] for r in _records(path)] == [1, 4]
    assert len(warnings) == 2
    assert "No space left on device" in warnings[0] and "training goes on" in warnings[0]
    assert "writing again" in warnings[1]


def test_resume_after_a_kill_logs_each_update_once(tmp_path):
    torch.set_num_threads(1)
    data = make_copy_data(tmp_path / "copy", n_train=60, n_valid=10)
    model = model_preset("tiny", dropout=0.1)

    def cfg(updates):
        return TrainConfig(max_updates=updates, max_tokens=256, warmup=4, max_len=32,
                           log_interval=1, valid_interval=1000, save_interval_updates=3,
                           keep_last=5, seed=3)

    run = tmp_path / "run"
    train(data, run, model, cfg(5), "cpu", progress=False)
    # As if killed after update 5 was logged but before its checkpoint: last = update 3.
    shutil.copyfile(run / "checkpoint_3.pt", run / "checkpoint_last.pt")
    (run / "checkpoint_5.pt").unlink()
    with (run / "train_log.jsonl").open("a", encoding="utf-8") as handle:
        handle.write('{"kind": "train", "step": 6, "lo')  # torn by the kill
    summary = train(data, run, model, cfg(7), "cpu", progress=False)
    assert summary.resumed_from == 3
    steps = [r["step"] for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 8))
