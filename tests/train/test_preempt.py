"""Preemption with gloo on the CPU: SIGTERM to one rank, or to the
launcher of `nmt train --nproc 2`, makes every rank save the same update and stop with
exit 75; running the same command again resumes, and the final weights equal those of a
run never interrupted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import NmtCli
from helpers.data import make_copy_data

from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.errors import Preempted
from nmt.train.log import read_jsonl
from nmt.train.loop import Trainer

pytestmark = pytest.mark.slow  # several multi-process training runs
REPO = Path(__file__).resolve().parents[2]
MODEL = model_preset("tiny", dropout=0.0)
UPDATES = 300
FLAGS = ("--arch", "tiny", "--dropout", "0", "--max-updates", str(UPDATES), "--max-tokens",
         "256", "--warmup", "4", "--max-len", "32", "--log-interval", "1",
         "--valid-interval", "100000", "--save-interval-minutes", "0", "--seed", "5",
         "--precision", "fp32")


def _cfg() -> TrainConfig:
    return TrainConfig(max_updates=UPDATES, max_tokens=256, warmup=4, max_len=32,
                       log_interval=1, valid_interval=100_000, save_interval_minutes=0,
                       seed=5, precision="fp32")


def preempt_worker(rank: int, world: int, port: int, data: str, run: str, out: str,
                   deferred: bool) -> None:
    """One rank, reading its statistics deferred or at once; writes 'done STEP' or the
    Preempted message, exits 0 or 75."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        summary = Trainer(data, run, MODEL, _cfg(), "cpu", progress=False,
                          deferred=deferred).run()
        text, code = f"done {summary.step}", 0
    except Preempted as err:
        text, code = f"preempted: {err}", err.exit_code
    Path(out, f"rank{rank}.txt").write_text(text)
    sys.exit(code)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(data: Path, run: Path, out: Path, deferred: bool) -> list[subprocess.Popen]:
    """Two ranks; `deferred` runs CUDA's deferred read-back on the CPU."""
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, "-c", "from test_preempt import preempt_worker; "
         f"preempt_worker({rank}, 2, {port}, {str(data)!r}, {str(run)!r}, {str(out)!r}, "
         f"{deferred})"],
        cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO / "tests"), str(REPO)])},
        stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


def _wait_for_updates(run: Path, count: int, procs: list[subprocess.Popen]) -> None:
    """Until the run has logged `count` updates (the processes must still be running)."""
    log = run / "train_log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "training ended before the signal"
        if log.is_file() and sum(r["kind"] == "train" for r in read_jsonl(log)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("training did not start")


def _finish(procs: list[subprocess.Popen]) -> list[int]:
    codes = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        codes.append(proc.returncode)
        assert proc.returncode in (0, 75), err[-3000:]
    return codes


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "checkpoint_last.pt")["model"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("deferred", [False, True], ids=["in-line", "deferred"])
def test_sigterm_to_one_rank_saves_everywhere_and_resumes_exactly(tmp_path: Path,
                                                                   deferred: bool) -> None:
    """Both ways of reading an update's statistics: in-line (CPU) and deferred (CUDA's,
    where the flag is read one update late and the update launched after it dropped)."""
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    reference = tmp_path / "reference"
    assert _finish(_start(data, reference, tmp_path, deferred)) == [0, 0]

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    procs = _start(data, run, out, deferred)
    _wait_for_updates(run, 5, procs)
    procs[1].send_signal(signal.SIGTERM)  # rank 1 alone, as a node's scheduler would
    assert _finish(procs) == [75, 75]
    texts = [(out / f"rank{r}.txt").read_text() for r in (0, 1)]
    step = load_checkpoint(run / "checkpoint_last.pt")["step"]
    assert 5 <= step < UPDATES
    assert texts[1].startswith(f"preempted: stopped by SIGTERM at update {step}, saved in ")
    assert texts[0].startswith(f"preempted: stopped by a preemption signal on another rank "
                               f"at update {step}")

    assert _finish(_start(data, run, out, deferred)) == [0, 0]  # the same command again
    assert (out / "rank0.txt").read_text() == f"done {UPDATES}"
    assert _same(_weights(run), _weights(reference))


def test_sigterm_to_the_launcher(tmp_path: Path, nmt_cli: NmtCli) -> None:
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    reference = tmp_path / "reference"
    done = nmt_cli.run("train", data, "-o", reference, "--nproc", "2", *FLAGS)
    assert done.returncode == 0, done.err[-3000:]

    run = tmp_path / "run"
    args = ("train", data, "-o", run, "--nproc", "2", *FLAGS)
    launcher = nmt_cli.popen(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_updates(run, 5, [launcher])
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, err.decode()[-3000:]
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("nmt train: error: the launcher got SIGTERM: every rank saved"), last
    step = load_checkpoint(run / "checkpoint_last.pt")["step"]
    assert 5 <= step < UPDATES

    again = nmt_cli.run(*args)
    assert again.returncode == 0, again.err[-3000:]
    assert f"resuming from update {step}" in again.err
    assert _same(_weights(run), _weights(reference))
