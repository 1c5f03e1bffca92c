"""Issue 6, training faults: kill -9 at random moments, a full disk at checkpoint time,
non-finite losses, and a hostile checkpoint on resume. Each test injects the fault into the
real `nmt train` code path (subprocess CLI where the process boundary matters) on a small
slice of the real Multi30k data, and checks that nothing saved is lost or broken."""

from __future__ import annotations

import errno
import os
import pickle
import random
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import RunsCode
from helpers.cli import NmtCli
from helpers.data import FAST, FAST_FLAGS, MODEL, MODEL_FLAGS, multi30k_data

from nmt.checkpoint import FORMAT, load_checkpoint
from nmt.config import TrainConfig
from nmt.train.log import read_jsonl
from nmt.train.loop import train


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> Path:
    """300 real Multi30k pairs (+20 valid), joint BPE 400, binarized by the `nmt bpe` code."""
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=300, n_valid=20,
                         vocab_size=400)


def _train_args(data: Path, run: Path, *flags: str) -> list[str]:
    """`nmt train` arguments of the fault runs (tiny model, dropout on, CPU)."""
    return ["train", str(data), "-o", str(run), *MODEL_FLAGS, *flags]


def _all_finite(payload: dict) -> bool:
    return all(torch.isfinite(t).all() for t in payload["model"].values())


def _temps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.endswith(".tmp"))


# ----- kill -9 at random moments, 20 times, then finish: exact resume -----

KILL_FLAGS = ["--max-tokens", "512", "--warmup", "10", "--seed", "7", "--log-interval", "1",
              "--valid-interval", "1000", "--save-interval-minutes", "0",
              "--save-interval-updates", "1", "--keep-last", "2"]
KILL_UPDATES = 40  # a killed run makes 1-2 updates after its first save; 20 kills < 40


# Test-only instrumentation of the killed processes (nothing in the library): torch.save's
# writes and every fsync are slowed down, so that a good share of random kills lands inside
# a checkpoint write (a 2.4 MB checkpoint is otherwise written in ~20 ms). Numerics are
# untouched.
SLOW_WRITES = """
import os, time, torch
_save, _fsync = torch.save, os.fsync
class _Slow:
    def __init__(self, f):
        self.f = f
    def write(self, b):
        time.sleep(0.0002)
        return self.f.write(b)
    def flush(self):
        self.f.flush()
def _slow_fsync(fd):
    time.sleep(0.05)
    _fsync(fd)
torch.save = lambda obj, f, *a, **k: _save(obj, _Slow(f), *a, **k)
os.fsync = _slow_fsync
from nmt.cli.main import main
main()
"""


def _kill_cfg() -> TrainConfig:
    return TrainConfig(max_tokens=512, warmup=10, seed=7, log_interval=1, valid_interval=1000,
                       save_interval_minutes=0, save_interval_updates=1, keep_last=2,
                       max_updates=KILL_UPDATES)


def _saved_steps(text: str) -> list[int]:
    """Updates whose checkpoint write completed (the line is printed after the rename)."""
    return [int(line.rsplit("(update ", 1)[1].rstrip(")"))
            for line in text.splitlines() if line.startswith("saved ") and "(update " in line]


def _run_and_kill(cli: NmtCli, args: list[str], log: Path, rng: random.Random,
                  at_start: bool, timeout: float = 180) -> tuple[bool, str]:
    """Start `nmt ARGS`; SIGKILL it at a seeded random moment. Returns (killed, its stderr).

    at_start: a delay from process start (import, data loading, resume); otherwise a delay
    after this run's first completed save, so that the kill lands in training or inside a
    checkpoint write (every update saves).
    """
    with log.open("w") as err:
        proc = cli.popen(*args, stdout=subprocess.DEVNULL, stderr=err)
    start = time.monotonic()
    delay = rng.uniform(0.0, 6.0) if at_start else None
    armed_at = start if at_start else None
    while proc.poll() is None:
        now = time.monotonic()
        if now - start > timeout:
            proc.kill()
            proc.wait()
            raise AssertionError(f"nmt train did not finish in {timeout} s")
        if armed_at is None and "saved " in log.read_text():
            armed_at, delay = now, rng.uniform(0.0, 0.8)
        if armed_at is not None and now - armed_at >= delay:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return proc.returncode == -signal.SIGKILL, log.read_text()
        time.sleep(0.01)
    return False, log.read_text()


@pytest.mark.slow
def test_kill_9_twenty_times_then_resume_equals_uninterrupted_run(m30k, tmp_path, one_thread,
                                                                  nmt_cli):
    run = tmp_path / "run"
    args = _train_args(m30k, run, *KILL_FLAGS, "--max-updates", str(KILL_UPDATES))
    slow = nmt_cli.instrumented(SLOW_WRITES)  # python -c SLOW_WRITES train DATA ...
    rng = random.Random(20240601)
    kills = tries = 0
    last_step = 0
    seen_temps: set[str] = set()
    while kills < 20:
        tries += 1
        assert tries <= 40, "training finished before 20 kills landed; raise KILL_UPDATES"
        killed, stderr = _run_and_kill(slow, args, tmp_path / f"stderr_{tries}.txt", rng,
                                       at_start=tries % 4 == 0)
        assert killed or "stopped at update" in stderr, stderr
        kills += killed
        seen_temps |= set(_temps(run)) if run.exists() else set()
        if not (run / "checkpoint_last.pt").exists():
            assert not _saved_steps(stderr), "a completed save vanished"
            continue
        payload = load_checkpoint(run / "checkpoint_last.pt")  # always loads
        step = payload["step"]
        completed = _saved_steps(stderr)
        assert step >= max(completed, default=0), (step, completed)  # no saved progress lost
        assert step >= last_step  # never goes backwards across kills
        last_step = step
    final = slow.run(*args)
    assert final.returncode == 0, final.err
    assert _temps(run) == [], "a killed write's temp file outlived the next run"
    assert seen_temps, "no kill landed inside a checkpoint write"
    for line in (run / "train_log.jsonl").read_text().splitlines():
        assert line.endswith("}"), f"torn log line: {line!r}"
    resumed = load_checkpoint(run / "checkpoint_last.pt")
    assert resumed["step"] == KILL_UPDATES

    whole = train(m30k, tmp_path / "whole", MODEL, _kill_cfg(), "cpu", progress=False)
    assert whole.step == KILL_UPDATES and whole.resumed_from == 0
    reference = load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt")
    assert resumed["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name  # bit-exact
    assert resumed["data_state"] == reference["data_state"]
    print(f"\nkill -9: {kills} kills in {tries} runs; {len(seen_temps)} checkpoint temp files "
          f"left by kills inside a write; final step {resumed['step']} == uninterrupted run")


# ----- a full disk at checkpoint time -----

def _fresh_run(data: Path, run: Path, updates: int) -> dict:
    """Train `updates` updates in-process (same config as FAST_FLAGS); return the
    checkpoint_last payload and its bytes, to compare after the fault."""
    train(data, run, MODEL, TrainConfig(**FAST, max_updates=updates), "cpu", progress=False)
    return {"bytes": (run / "checkpoint_last.pt").read_bytes(),
            "payload": load_checkpoint(run / "checkpoint_last.pt")}


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("nmt train: error: ")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]


def _assert_intact(run: Path, before: dict) -> None:
    """checkpoint_last is byte-for-byte the one saved before the fault, loads, is finite;
    no temp file is left behind."""
    assert (run / "checkpoint_last.pt").read_bytes() == before["bytes"]
    payload = load_checkpoint(run / "checkpoint_last.pt")
    assert payload["step"] == before["payload"]["step"] and _all_finite(payload)
    assert _temps(run) == []


class _FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes, like a disk that fills up
    in the middle of a checkpoint (what the real file object would raise)."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def _fill_disk_on_write(monkeypatch, nth: int, room: int = 100_000) -> None:
    """The `nth` file opened for writing by nmt.fileio's atomic writes (1: the numbered
    checkpoint of the next save, 2: its copy to checkpoint_last) hits a full disk."""
    import builtins

    import nmt.fileio as fileio

    opened = [0]

    def fake_open(file, mode="r", *args, **kwargs):
        handle = builtins.open(file, mode, *args, **kwargs)
        if mode != "wb":
            return handle
        opened[0] += 1
        return _FullDisk(handle, room) if opened[0] == nth else handle

    monkeypatch.setattr(fileio, "open", fake_open, raising=False)


@pytest.mark.parametrize("where", ["numbered", "last"])
def test_disk_full_at_checkpoint_keeps_previous_and_exits_6(m30k, tmp_path, monkeypatch,
                                                            one_thread, where, nmt_cli):
    """ENOSPC halfway through the numbered checkpoint, or through its copy to
    checkpoint_last (a file system without hard links, where checkpoint_last is a copy):
    one error line, exit 6, the previous checkpoint_last untouched."""
    run = tmp_path / "run"
    before = _fresh_run(m30k, run, updates=2)
    if where == "last":
        import nmt.train.state as state

        def no_links(src, dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

        monkeypatch.setattr(state.os, "link", no_links)
    _fill_disk_on_write(monkeypatch, nth=1 if where == "numbered" else 2)
    result = nmt_cli.invoke(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "4"))
    assert result.returncode == 6, result.err
    line = _one_error_line(result.err)
    assert "No space left on device" in line
    assert ("checkpoint_last.pt" in line) == (where == "last")
    _assert_intact(run, before)
    if where == "last":  # the numbered file was complete before the copy failed
        assert load_checkpoint(run / "checkpoint_3.pt")["step"] == 3
    else:
        assert not (run / "checkpoint_3.pt").exists()


def _limit_file_size(limit: int):
    def apply() -> None:  # in the child, before exec: writes past `limit` bytes get EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_file_size_limit_in_a_real_process_exits_6(m30k, tmp_path, one_thread, nmt_cli):
    """A real kernel write failure (RLIMIT_FSIZE -> EFBIG) in `nmt train` itself: works
    as root too, where a read-only directory would not stop the writes."""
    run = tmp_path / "run"
    before = _fresh_run(m30k, run, updates=2)
    limit = len(before["bytes"]) // 2
    done = nmt_cli.run(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "4"),
                       preexec_fn=_limit_file_size(limit))
    assert done.returncode == 6, done.err
    line = _one_error_line(done.err)
    assert "cannot write checkpoint" in line and "File too large" in line
    _assert_intact(run, before)
    again = nmt_cli.run(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "4"))
    assert again.returncode == 0, again.err  # space is back
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 4


# ----- non-finite losses -----

def _poison_forward(monkeypatch, bad_calls: set[int], value: float) -> list[int]:
    """Make the model's logits `value` (NaN) on the given 1-based forward calls; the
    non-finite numbers then flow through the real loss and backward."""
    from nmt.model.transformer import Transformer

    real = Transformer.forward
    calls = [0]

    def forward(self, *args, **kwargs):
        calls[0] += 1
        logits = real(self, *args, **kwargs)
        return logits * value if calls[0] in bad_calls else logits

    monkeypatch.setattr(Transformer, "forward", forward)
    return calls


def _poison_loss(monkeypatch, bad_calls: set[int]) -> list[int]:
    """Make the training loss +inf on the given 1-based calls (its gradient is then
    inf/NaN too)."""
    import nmt.train.step as step  # the training update calls the loss from there

    real = step.label_smoothed_nll
    calls = [0]

    def loss_fn(*args, **kwargs):
        calls[0] += 1
        loss, nll = real(*args, **kwargs)
        return (loss * float("inf"), nll) if calls[0] in bad_calls else (loss, nll)

    monkeypatch.setattr(step, "label_smoothed_nll", loss_fn)
    return calls


@pytest.mark.parametrize("kind", ["nan_logits", "inf_loss"])
def test_nonfinite_updates_are_skipped_and_counted(m30k, tmp_path, monkeypatch, one_thread,
                                                   kind, nmt_cli):
    run = tmp_path / "run"
    bad = {3, 5}
    calls = (_poison_forward(monkeypatch, bad, float("nan")) if kind == "nan_logits"
             else _poison_loss(monkeypatch, bad))
    result = nmt_cli.invoke(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "6",
                                         "--max-nonfinite-in-a-row", "2"))
    assert result.returncode == 0, result.err
    assert calls[0] == 8  # 6 updates + 2 skipped attempts
    assert result.err.count("non-finite loss or gradient; step skipped") == 2
    records = [r for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # attempts: 1 2 (3 bad) 4 (5 bad) 6 7 8 -> updates 1 2 . 3 . 4 5 6
    assert [r["skipped_updates"] for r in records] == [0, 0, 1, 2, 2, 2]
    assert all(r["loss"] is not None for r in records)  # skipped losses never averaged in
    payload = load_checkpoint(run / "checkpoint_last.pt")
    assert payload["step"] == 6 and _all_finite(payload)
    assert payload["scheduler"]["step_count"] == 6  # skipped updates do not advance the lr


@pytest.mark.parametrize("kind", ["nan_logits", "inf_loss"])
def test_nonfinite_in_a_row_aborts_with_exit_7_and_saves_nothing(m30k, tmp_path, monkeypatch,
                                                                 one_thread, kind, nmt_cli):
    run = tmp_path / "run"
    before = _fresh_run(m30k, run, updates=2)
    bad = set(range(2, 100))  # the resumed run makes update 3, then only NaN/inf
    calls = (_poison_forward(monkeypatch, bad, float("nan")) if kind == "nan_logits"
             else _poison_loss(monkeypatch, bad))
    result = nmt_cli.invoke(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "10",
                                         "--max-nonfinite-in-a-row", "3"))
    assert result.returncode == 7, result.err
    line = _one_error_line(result.err)
    assert "3 updates in a row had a non-finite loss" in line and "update 3" in line
    assert calls[0] == 4
    good = load_checkpoint(run / "checkpoint_3.pt")
    last = load_checkpoint(run / "checkpoint_last.pt")
    assert last["step"] == 3 and _all_finite(last)  # the last good update, nothing after
    assert all(torch.equal(last["model"][k], good["model"][k]) for k in good["model"])
    assert not all(torch.equal(last["model"][k], before["payload"]["model"][k])
                   for k in good["model"])  # update 3 did happen before the poison
    assert sorted(p.name for p in run.glob("checkpoint_*.pt")) == [
        "checkpoint_1.pt", "checkpoint_2.pt", "checkpoint_3.pt", "checkpoint_last.pt"]
    assert _temps(run) == []


# ----- a hostile checkpoint on resume -----

def _plant(run: Path, marker: Path, kind: str) -> Path:
    """RUN/checkpoint_last.pt as a torch zip or a bare pickle that runs `touch marker`."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / "checkpoint_last.pt"
    evil = RunsCode(f"touch {marker}")
    if kind == "zip":
        torch.save({"format": FORMAT, "step": 5, "model_config": {}, "vocab": b"",
                    "model": evil, "optimizer": evil}, path)
    else:
        path.write_bytes(pickle.dumps({"format": FORMAT, "step": 5, "model": evil}))
    return path


def test_control_the_planted_files_run_code_when_loaded_unsafely(tmp_path):
    """Without this, a refusal could be a broken file rather than a blocked attack."""
    for kind in ("zip", "pickle"):
        marker = tmp_path / f"control_{kind}"
        path = _plant(tmp_path / kind, marker, kind)
        if kind == "zip":
            torch.load(path, weights_only=False)
        else:  # torch.load would run it too, then complain about the magic number
            pickle.loads(path.read_bytes())
        assert marker.exists(), kind


@pytest.mark.parametrize("kind", ["zip", pytest.param("pickle", marks=pytest.mark.slow)])
def test_train_resume_refuses_hostile_checkpoint(m30k, tmp_path, kind, nmt_cli):
    run = tmp_path / "run"
    marker = tmp_path / "pwned"
    planted = _plant(run, marker, kind)
    planted_bytes = planted.read_bytes()
    done = nmt_cli.run(*_train_args(m30k, run, *FAST_FLAGS, "--max-updates", "2"))
    assert done.returncode == 6, done.err
    line = _one_error_line(done.err)
    assert "checkpoint_last.pt" in line and "refused to load" in line
    assert not marker.exists(), "the pickle ran code"
    assert planted.read_bytes() == planted_bytes  # not overwritten by a fresh run either
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_last.pt"]
