"""When `nmt serve`'s batcher starts a batch (nmt/serve/batcher.py), without HTTP: a lone
request waits only the idle gap, requests arriving closer than the gap share a batch, and
a batch does not start while the previous batch's answers are still being delivered (the
cause of half-size alternating batches under load), but never later than --max-wait-ms."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from nmt.serve.batcher import Batcher


class Recorder:
    """A runner that records each call's lines and start time (echoes the lines)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.calls: list[tuple[float, list[str]]] = []
        self.seconds = seconds
        self.called = threading.Event()

    def __call__(self, lines: list[str], _options: dict[str, Any]) -> list[str]:
        self.calls.append((time.monotonic(), list(lines)))
        self.called.set()
        time.sleep(self.seconds)
        return [line.upper() for line in lines]

    def batches(self) -> list[list[str]]:
        return [lines for _, lines in self.calls]


@contextlib.contextmanager
def _batcher(runner: Recorder, max_wait_ms: float, idle_ms: float) -> Iterator[Batcher]:
    batcher = Batcher(runner, 4096, max_wait_ms, 1000, "test", idle_ms=idle_ms)
    try:
        yield batcher
    finally:
        batcher.close()


def test_a_lone_request_waits_the_idle_gap_not_the_longest_wait() -> None:
    runner = Recorder()
    with _batcher(runner, max_wait_ms=3000, idle_ms=5) as batcher:
        start = time.monotonic()
        job = batcher.submit(["a"], {}, 1)
        assert job.future.result(timeout=10) == ["A"]
        assert runner.calls[0][0] - start < 1.0  # not the 3 s a batch may wait at most


def test_requests_closer_than_the_idle_gap_share_one_batch() -> None:
    runner = Recorder()
    with _batcher(runner, max_wait_ms=5000, idle_ms=200) as batcher:
        jobs = []
        for i in range(8):
            jobs.append(batcher.submit([f"line {i}"], {}, 1))
            time.sleep(0.01)
        assert [job.future.result(timeout=10) for job in jobs] == [
            [f"LINE {i}"] for i in range(8)]
        assert runner.batches() == [[f"line {i}" for i in range(8)]]


def test_the_next_batch_waits_until_the_last_answers_are_delivered() -> None:
    """Job a's answer is set but its request has not taken it (`delivered`): b waits in
    the queue (the HTTP side is busy writing answers, and the requests it would read next
    belong in b's batch); c comes, a is delivered, and b and c go in one batch."""
    runner = Recorder()
    with _batcher(runner, max_wait_ms=5000, idle_ms=20) as batcher:
        a = batcher.submit(["a"], {}, 1)
        assert a.future.result(timeout=10) == ["A"]
        b = batcher.submit(["b"], {}, 1)
        time.sleep(0.3)
        assert runner.batches() == [["a"]]  # b held back while a is being delivered
        c = batcher.submit(["c"], {}, 1)
        batcher.delivered(a)
        assert b.future.result(timeout=10) == ["B"] and c.future.result(timeout=10) == ["C"]
        assert runner.batches() == [["a"], ["b", "c"]]
        batcher.delivered(b)
        batcher.delivered(c)
        batcher.delivered(c)  # twice is harmless
        d = batcher.submit(["d"], {}, 1)
        start = time.monotonic()
        assert d.future.result(timeout=10) == ["D"]
        assert time.monotonic() - start < 1.0  # nothing left to wait for


def test_an_answer_never_delivered_delays_the_next_batch_at_most_the_longest_wait() -> None:
    runner = Recorder()
    with _batcher(runner, max_wait_ms=300, idle_ms=5) as batcher:
        a = batcher.submit(["a"], {}, 1)
        a.future.result(timeout=10)  # never delivered: a request that vanished unnoticed
        start = time.monotonic()
        b = batcher.submit(["b"], {}, 1)
        assert b.future.result(timeout=10) == ["B"]
        waited = runner.calls[1][0] - start
        assert 0.25 < waited < 2.0


def test_a_request_that_went_away_holds_nothing_back() -> None:
    """A job cancelled (its client disconnected) before its batch ran is never handed
    over, so the next batch has nothing to wait for."""
    runner = Recorder(seconds=0.3)
    with _batcher(runner, max_wait_ms=3000, idle_ms=5) as batcher:
        a = batcher.submit(["a"], {}, 1)
        assert runner.called.wait(10)
        gone = batcher.submit(["gone"], {}, 1)
        assert gone.future.cancel()
        a.future.result(timeout=10)
        batcher.delivered(a)
        batcher.delivered(gone)  # the app's `finally` runs for it too
        time.sleep(0.4)  # gone's batch has run by now
        start = time.monotonic()
        c = batcher.submit(["c"], {}, 1)
        assert c.future.result(timeout=10) == ["C"]
        assert time.monotonic() - start < 1.5  # not held for the 3 s longest wait


def test_with_two_workers_two_batches_run_side_by_side() -> None:
    """A model served by two decoding processes takes a second batch while the first runs
    (each call waits here until the other has started: one runner thread would time out)."""
    both = threading.Barrier(2, timeout=10)

    def runner(lines: list[str], _options: dict[str, Any]) -> list[str]:
        both.wait()
        return [line.upper() for line in lines]

    batcher = Batcher(runner, 4096, 5.0, 1000, "test", idle_ms=1.0, parallel=2)
    try:
        first = batcher.submit(["a"], {}, 1)
        time.sleep(0.1)  # its batch has started and waits for company
        second = batcher.submit(["b"], {}, 1)
        assert first.future.result(timeout=20) == ["A"]
        assert second.future.result(timeout=20) == ["B"]
        batcher.delivered(first)
        batcher.delivered(second)
    finally:
        batcher.close()
    assert all(not thread.is_alive() for thread in batcher._threads)  # close stops them all
