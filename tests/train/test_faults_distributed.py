"""Issue 6, distributed faults: one of 2 gloo ranks of `nmt train --nproc 2` dies from
SIGKILL mid-training; the job must end within a bounded time (no hang), say which rank
died, exit 8, and leave the last checkpoint loadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from helpers.data import FAST_FLAGS, MODEL_FLAGS, multi30k_data

from nmt.checkpoint import load_checkpoint

BOUND_S = 60.0  # the whole job must be gone this long after the kill


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> Path:
    """The DATA of test_faults_train: 300 real Multi30k pairs (+20 valid), joint BPE 400."""
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=300, n_valid=20,
                         vocab_size=400)


def _find_rank(tag: str, rank: int) -> int | None:
    """PID of the training worker of `rank` started with NMT_TEST_TAG=tag (from /proc)."""
    want = {f"NMT_TEST_TAG={tag}".encode(), f"RANK={rank}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return int(entry.name)
    return None


def _wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_killing_one_of_two_gloo_ranks_ends_the_job_naming_it(m30k, tmp_path, victim,
                                                               nmt_cli):
    run = tmp_path / "run"
    tag = uuid.uuid4().hex
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = nmt_cli.popen("train", m30k, "-o", run, *MODEL_FLAGS, *FAST_FLAGS, "--nproc",
                             "2", "--max-updates", "500", env={"NMT_TEST_TAG": tag},
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        _wait_for(lambda: "saved " in log.read_text(), 240, "the first checkpoint")
        time.sleep(random.Random(victim).uniform(0.0, 1.0))  # seeded: mid-update or save
        pid = _wait_for(lambda: _find_rank(tag, victim), 10, f"rank {victim}'s process")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=BOUND_S + 30)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = log.read_text()
    print(f"\nrank {victim} SIGKILLed: job gone after {took:.1f} s, exit {code}")
    assert took < BOUND_S, stderr
    assert code == 8, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("nmt train: error: ")]
    assert errors and f"rank {victim}" in errors[-1] and "SIGKILL" in errors[-1], stderr
    assert "Traceback" not in stderr, stderr  # the surviving rank reports one line too
    assert _find_rank(tag, 1 - victim) is None, "the surviving rank is still running"
    payload = load_checkpoint(run / "checkpoint_last.pt")  # intact, whatever was cut off
    assert payload["step"] >= 1 and len(payload["rng"]) == 2


def test_launcher_names_the_rank_a_signal_killed_and_passes_nmt_codes_on() -> None:
    """The fast half of the test above, without processes: what the launcher makes of
    torchrun's failure record. A rank killed by a signal is named (the earliest if
    several); ranks that exited with an nmt code pass the code on, preferred over a
    peer's follow-on crash (1)."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    from nmt.errors import DistributedError
    from nmt.train.distributed import _child_failure_code

    def failure(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                              error_file=str(Path("/nonexistent/error.json")))

    killed = ChildFailedError("train", {0: failure(0, 1), 1: failure(1, -signal.SIGKILL)})
    with pytest.raises(DistributedError, match=r"rank 1 \(local rank 1, pid 101\) died "
                                               r"from SIGKILL \(rank\(s\) 0 failed too\)"):
        _child_failure_code(killed)
    assert _child_failure_code(ChildFailedError("t", {0: failure(0, 1),
                                                      1: failure(1, 6)})) == 6
    assert _child_failure_code(ChildFailedError("t", {0: failure(0, 1)})) == 1
