"""Batching across requests: lines from concurrent requests share the model's batches.

A worker thread per served model (one per decoding process when the model has several,
so that batches of concurrent requests run side by side) takes every job queued and
translates each group of jobs with the same decoding options in one call of the Python
API (which sorts the lines by length and batches them by tokens, as `nmt translate`
does). Each job's lines come back to it in order. A sentence's translation does not
depend on the other lines of its batch (tested: tests/inference/test_decoding.py,
tests/serve/test_serve.py), so a request gets what it would alone, only sooner under load. The
queue is bounded in lines: a full one refuses new jobs (QueueFull; the server answers 503
with Retry-After) instead of growing without limit.

When a batch starts: as soon as no request has come for `idle_ms` (a lone request waits
only that long), but not while the previous batch's results are still being handed to
their requests (`delivered`), and never later than `max_wait_ms` after the batch's first
job was taken. The delivery wait is what keeps batches whole under load: while the HTTP
side writes one batch's answers it reads no new requests, so a batch started then would
hold only the requests queued during the last one, and the rest would form a second,
small batch behind it; the two would alternate at half size for as long as the load
lasts (docs/serving.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The batcher holds `max_queue_lines` lines already: retry later."""


@dataclass
class Job:
    """One request's lines, the options they are translated with (`key` groups jobs that
    may share a call), their estimated tokens, and the future their results go to."""

    lines: list[str]
    options: dict[str, Any]
    tokens: int
    future: Future = field(default_factory=Future)
    handed: bool = False  # its results are set and not yet `delivered`

    @property
    def key(self) -> Hashable:
        """Jobs with equal keys share a call. Sampling jobs never do: a call's seed
        restarts the generator, so a sample must not depend on its neighbours."""
        own = (id(self),) if self.options.get("sampling") else ()
        return (*own, *sorted((k, _hashable(v)) for k, v in self.options.items()))


def _hashable(value: object) -> Hashable:
    return tuple(value) if isinstance(value, list) else value  # type: ignore[return-value]


# run(lines, options) -> one result per line, in order
Runner = Callable[[list[str], dict[str, Any]], list[Any]]


class Batcher:
    """`parallel` worker threads that run `runner` over batches of queued jobs, one batch
    each at a time; one of them forms a batch at a time."""

    def __init__(self, runner: Runner, max_batch_tokens: int, max_wait_ms: float,
                 max_queue_lines: int, name: str = "model", idle_ms: float = 3.0,
                 parallel: int = 1) -> None:
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.idle = min(idle_ms, max_wait_ms) / 1000.0
        self.max_queue_lines = max_queue_lines
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._handed_over = threading.Condition(self._lock)  # `_handing` fell to 0
        self._queued_lines = 0
        self._handing = 0  # jobs whose results are set and not yet delivered
        self._held: Job | None = None  # taken from the queue but over this batch's budget
        self._forming = threading.Lock()  # one thread forms a batch at a time
        self._threads = [threading.Thread(target=self._work, name=f"nmt-serve-{name}-{i}",
                                          daemon=True) for i in range(max(parallel, 1))]
        for thread in self._threads:
            thread.start()

    def submit(self, lines: list[str], options: dict[str, Any], tokens: int) -> Job:
        """Queue `lines` (a request's, in order) with their decoding `options`; the job's
        future gets the list of results, and the caller then says `delivered(job)`, also
        when it gave up waiting. QueueFull when the queue is at its limit."""
        job = Job(lines, options, max(tokens, 1))
        with self._lock:
            if self._queued_lines and self._queued_lines + len(lines) > self.max_queue_lines:
                raise QueueFull(f"{self._queued_lines} lines queued")
            self._queued_lines += len(lines)
        self._queue.put(job)
        return job

    def delivered(self, job: Job) -> None:
        """The request of `job` has its results (or is gone): the next batch need not
        wait for it any more."""
        with self._lock:
            if job.handed:
                job.handed = False
                self._handing -= 1
                if not self._handing:
                    self._handed_over.notify_all()

    @property
    def queued_lines(self) -> int:
        """Lines waiting or being translated."""
        with self._lock:
            return self._queued_lines

    def close(self, timeout: float = 30.0) -> None:
        """Finish every queued job, then stop the worker threads."""
        self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _work(self) -> None:
        while True:
            with self._forming:
                jobs = self._collect()
            if jobs is None:
                return
            groups: dict[Hashable, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._run(group)

    def _collect(self) -> list[Job] | None:
        """The next batch (see the module doc): a held-over job or the next queued one,
        then, once the previous batch's results are delivered, whatever arrives with gaps
        under `idle`, within `max_wait` and the token budget. None: stop."""
        first = self._held or self._queue.get()
        self._held = None
        if first is None:
            self._queue.put(None)  # for the other worker threads
            return None
        jobs, tokens = [first], first.tokens
        deadline = time.monotonic() + self.max_wait
        with self._lock:
            self._handed_over.wait_for(lambda: not self._handing,
                                       timeout=max(deadline - time.monotonic(), 0.0))
        while tokens < self.max_batch_tokens:
            remaining = min(deadline - time.monotonic(), self.idle)
            try:
                job = self._queue.get(timeout=remaining) if remaining > 0 \
                    else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # close(): finish this batch, then stop
                self._queue.put(None)
                break
            if tokens + job.tokens > self.max_batch_tokens:
                self._held = job  # opens the next batch
                break
            jobs.append(job)
            tokens += job.tokens
        return jobs

    def _run(self, group: list[Job]) -> None:
        """Translate a group of jobs with the same options in one call and hand each its
        results; an error goes to every job of the group (the worker lives on)."""
        lines = [line for job in group for line in job.lines]
        try:
            results = self.runner(lines, group[0].options)
        except BaseException as err:
            for job in group:
                self._done(job, error=err)
            return
        start = 0
        for job in group:
            self._done(job, results[start:start + len(job.lines)])
            start += len(job.lines)

    def _done(self, job: Job, results: list[Any] | None = None,
              error: BaseException | None = None) -> None:
        with self._lock:
            self._queued_lines -= len(job.lines)
            if not job.future.set_running_or_notify_cancel():
                return  # the client went away
            job.handed = True
            self._handing += 1
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(results)
