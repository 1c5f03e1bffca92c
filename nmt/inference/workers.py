"""Batch-level parallelism on CPU: forked worker processes that decode with one copy of the
weights.

A `WorkerPool` forks N processes from a process that has loaded its models. The weights
(and their packed or int8 copies) are shared with the parent page for page (copy-on-write,
never written); each worker adds only its own decoding memory: activations, key/value
caches and oneDNN's kernels. Each worker decodes one batch at a time with T torch threads;
a batch goes to whichever worker is free, in the order submitted, and its result comes
back as a `Future`. Processes rather than threads: beam search is many small torch calls,
and a second Python thread of decoding waits for the GIL (docs/performance.md).

Why the parent must not have used OpenMP threads before forking: GNU OpenMP's thread pool
does not survive a fork, and a child that opens a parallel region of more than one thread
then hangs. `fork_safe_threads` keeps the parent at one thread while it loads and forks;
a worker of T > 1 threads opens a parallel region before it says it is ready, so a broken
pool is a clear error at start-up instead of a hang.

Failure: an exception in a worker goes to that batch's future (with the worker's
traceback); a worker that dies (killed, out of memory) fails its batch with `WorkerDied`
and the others go on. Workers ignore SIGINT (the parent decides), exit when the parent
closes the pool or dies (their pipe ends; on Linux also PR_SET_PDEATHSIG), and never run
the parent's exit handlers.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from nmt.errors import UsageError, WorkerDied

if TYPE_CHECKING:
    from nmt.config import DecodeConfig


class Engine(Protocol):
    """What a worker needs of the translator it was forked with (nmt/inference/translate.py's
    `Engine`): its device, a copy with other search settings, and the search itself."""

    device: torch.device

    def configured(self, cfg: DecodeConfig) -> Engine: ...

    def translate_ids(self, sources: Sequence[Sequence[int]],
                      prefixes: Sequence[Sequence[int]] | None = None, *,
                      seed: int | None = None) -> list: ...


READY_TIMEOUT_S = 60.0  # a worker that has not started by then is killed (see module doc)
_PR_SET_PDEATHSIG = 1


@dataclass
class _Task:
    """One batch: its search settings, source ids, prefixes, sampling seed and future."""

    cfg: DecodeConfig
    sources: list[list[int]]
    prefixes: list[list[int]] | None
    seed: int | None
    future: Future


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as its cause."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n(in a translation worker)\n{self.text}"


@contextlib.contextmanager
def fork_safe_threads() -> Iterator[None]:
    """Run the block (loading models, forking workers) with one torch thread, so that the
    parent opens no OpenMP parallel region before it forks; restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class WorkerPool:
    """N forked processes decoding batches of `engine` (a loaded translator), T threads
    each. Use it as a context manager or call `close()`; see the module doc."""

    def __init__(self, engine: Engine, workers: int, threads: int) -> None:
        check_workers(workers, threads, engine.device.type)
        self.workers, self.threads = workers, threads
        self._lock = threading.Lock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._busy: dict[int, _Task] = {}  # worker index -> its batch
        self._closed = False
        self._conns: dict[int, Connection] = {}
        self._pids: dict[int, int] = {}
        self._wake_r, self._wake_w = Pipe(duplex=False)
        gc.collect()
        gc.freeze()  # the parent's objects stay out of the children's collections: pages shared
        try:
            for index in range(workers):
                parent_end, child_end = Pipe()
                pid = os.fork()
                if pid == 0:  # the worker: never returns
                    for conn in (parent_end, *self._conns.values(), self._wake_r,
                                 self._wake_w):
                        conn.close()  # its siblings' pipes: their ends stay the parent's
                    _worker_main(child_end, engine, threads)
                child_end.close()
                self._conns[index], self._pids[index] = parent_end, pid
            self._await_ready()
        except BaseException:
            self._kill_all()
            raise
        finally:
            gc.unfreeze()
        self._idle = list(range(workers))
        self._collector = threading.Thread(target=self._collect, name="nmt-workers",
                                           daemon=True)
        self._collector.start()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        with self._lock:
            return list(self._pids.values())

    def submit(self, cfg: DecodeConfig, sources: Sequence[Sequence[int]],
               prefixes: Sequence[Sequence[int]] | None = None, seed: int | None = None
               ) -> Future:
        """Queue one batch; its future gets the engine's `translate_ids` result (a list of
        hypotheses per source) or the exception raised, WorkerDied if its worker died."""
        task = _Task(cfg, [list(s) for s in sources],
                     None if prefixes is None else [list(p) for p in prefixes], seed, Future())
        with self._lock:
            if self._closed:
                raise RuntimeError("this worker pool is closed")
            if not self._conns:
                task.future.set_exception(WorkerDied("every translation worker has died"))
                return task.future
            self._queue.append(task)
            self._dispatch()
        return task.future

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers: the idle ones at once, a busy one after its batch (killed after
        `timeout` seconds); queued batches are cancelled. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queued, self._queue = list(self._queue), collections.deque()
            for conn in self._conns.values():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for task in queued:
            task.future.cancel()
        self._finish(timeout)

    def terminate(self) -> None:
        """Stop now (Ctrl-C, SIGTERM): kill the workers; what is queued or running is
        cancelled. Idempotent."""
        with self._lock:
            self._closed = True
            tasks = list(self._queue) + list(self._busy.values())
            self._queue.clear()
            self._busy.clear()
            pids = list(self._pids.values())
        for task in tasks:  # a running batch cannot be cancelled: it fails
            if not task.future.cancel() and not task.future.done():
                task.future.set_exception(CancelledError())
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._finish(5.0)

    def _finish(self, timeout: float) -> None:
        """Let the collector end, then reap the workers (SIGKILL after `timeout`)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(None)
        self._collector.join(timeout)
        self._reap(timeout)

    def _dispatch(self) -> None:
        """Give queued batches to idle workers (the lock held)."""
        while self._queue and self._idle:
            task = self._queue.popleft()
            if task.future.cancelled():
                continue
            index = self._idle.pop(0)
            try:
                self._conns[index].send((task.cfg, task.sources, task.prefixes, task.seed))
            except OSError:  # it died meanwhile (the collector buries it): try another
                self._queue.appendleft(task)
                continue
            self._busy[index] = task
            task.future.set_running_or_notify_cancel()

    def _collect(self) -> None:
        """The collector thread: hand each result to its future and the worker the next
        batch; notice dead workers."""
        while True:
            with self._lock:
                conns = {conn: index for index, conn in self._conns.items()}
                if self._closed and not self._busy:
                    return
            ready = wait([*conns, self._wake_r])
            for conn in ready:
                if conn is self._wake_r:
                    with contextlib.suppress(EOFError, OSError):
                        self._wake_r.recv()
                    continue
                index = conns[conn]  # type: ignore[index]
                try:
                    message = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._buried(index)
                    continue
                with self._lock:
                    task = self._busy.pop(index, None)
                    if not self._closed:
                        self._idle.append(index)
                        self._dispatch()
                if task is not None:
                    _settle(task.future, message)

    def _buried(self, index: int) -> None:
        """Worker `index` is gone: reap it and fail its batch (and, when it was the last,
        every queued one)."""
        with self._lock:
            conn, pid = self._conns.pop(index), self._pids.pop(index)
            task = self._busy.pop(index, None)
            if index in self._idle:
                self._idle.remove(index)
            orphans: list[_Task] = []
            if not self._conns:  # nobody left to run what is queued
                orphans, self._queue = list(self._queue), collections.deque()
        conn.close()
        status = _reap_one(pid, 5.0)
        if task is not None and not task.future.done():
            task.future.set_exception(WorkerDied(
                f"translation worker {index + 1} (pid {pid}) {status} while translating a "
                f"batch of {len(task.sources)} lines"))
        for orphan in orphans:
            if orphan.future.set_running_or_notify_cancel():
                orphan.future.set_exception(WorkerDied("every translation worker has died"))

    def _await_ready(self) -> None:
        """Wait for every worker's start-up message (see the module doc on OpenMP)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = dict(self._conns)
        while waiting:
            left = deadline - time.monotonic()
            ready = wait(list(waiting.values()), timeout=max(left, 0.0))
            if not ready:
                raise WorkerDied(
                    f"{len(waiting)} translation worker(s) did not start within "
                    f"{READY_TIMEOUT_S:.0f} s: with more than one thread per worker, this "
                    "process must not have run multi-threaded torch work before the "
                    "workers were forked (load the translator first, or use one thread "
                    "per worker)")
            for index, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        conn.recv()
                    except (EOFError, OSError) as err:
                        raise WorkerDied(f"translation worker {index + 1} failed to "
                                         "start") from err
                    del waiting[index]

    def _kill_all(self) -> None:
        """Start-up failed: kill and reap whatever was forked (no collector runs yet)."""
        for pid in list(self._pids.values()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._reap(5.0)

    def _reap(self, timeout: float) -> None:
        """Wait for every worker to exit (SIGKILL after `timeout`); close the pipes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pids, conns = list(self._pids.values()), list(self._conns.values())
            self._pids.clear()
            self._conns.clear()
        for pid in pids:
            _reap_one(pid, max(deadline - time.monotonic(), 0.0))
        for conn in conns:
            conn.close()


def _settle(future: Future, message: tuple[Any, BaseException | None, str]) -> None:
    """Set a batch's future from a worker's (result, error, traceback text)."""
    result, error, text = message
    if future.done():  # cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
        return
    if text:
        error.__cause__ = RemoteTraceback(text)
    future.set_exception(error)


def _reap_one(pid: int, timeout: float) -> str:
    """Wait up to `timeout` s for child `pid` to exit (then SIGKILL it); how it ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "exited"
        if done:
            if os.WIFSIGNALED(status):
                return f"was killed by signal {os.WTERMSIG(status)}"
            return f"exited with status {os.WEXITSTATUS(status)}"
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (elsewhere the pipe's end does)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker_main(conn: Connection, engine: Engine, threads: int) -> None:
    """A worker's life: start (see the module doc), then decode batches until told to stop
    or the pipe ends. Leaves with os._exit, never through the parent's code."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        torch.set_num_threads(threads)
        if threads > 1:  # opens an OpenMP parallel region now rather than at the first batch
            torch.ones(1 << 18).add_(1.0).sum()
        conn.send(os.getpid())
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message is None:
                break
            cfg, sources, prefixes, seed = message
            try:
                result = engine.configured(cfg).translate_ids(sources, prefixes, seed=seed)
                reply: tuple[Any, BaseException | None, str] = (result, None, "")
            except Exception as err:  # goes to the batch's future, the worker lives on
                reply = (None, _portable(err), traceback.format_exc())
            try:
                conn.send(reply)
            except (EOFError, OSError):
                break
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _portable(err: Exception) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


class WorkerPlan(NamedTuple):
    """How a translator spreads over the CPU: `workers` processes of `threads` torch threads
    each (one worker: this process, with `threads` threads), and the sentence that says so."""

    workers: int
    threads: int
    note: str


def check_workers(workers: int | None, threads: int | None, device_type: str) -> None:
    """UsageError unless `workers` and `threads` (None: not chosen) are >= 1 and several
    workers are asked for only on a CPU."""
    for name, value in (("--workers", workers), ("--threads-per-worker", threads)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if workers not in (None, 1) and device_type != "cpu":
        raise UsageError(f"--workers {workers}: worker processes decode on the CPU; on "
                         f"{device_type} use one worker")


def plan_workers(workers: int | None, threads: int | None, device_type: str, cores: int,
                 latency: bool = False) -> WorkerPlan:
    """Fill in what the user left open (None). On a CPU, throughput wants every core as a
    one-thread worker (each decodes its own batches: docs/performance.md); `latency` (an
    interactive terminal, one line at a time) wants one worker with every core. Elsewhere
    (a GPU) one worker."""
    check_workers(workers, threads, device_type)
    if device_type != "cpu":
        return WorkerPlan(1, threads or torch.get_num_threads(), "")
    chosen = workers if workers is not None else (1 if latency else cores)
    per = threads if threads is not None else max(1, cores // chosen)
    if workers is not None and threads is not None:
        return WorkerPlan(chosen, per, "")  # all the user's choice: nothing to say
    why = " (one line at a time: one worker)" if latency and workers is None else ""
    note = (f"{chosen} worker{'s' if chosen > 1 else ''} x {per} "
            f"thread{'s' if per > 1 else ''} on {cores} core{'s' if cores > 1 else ''}{why}; "
            "--workers/--threads-per-worker to change")
    return WorkerPlan(chosen, per, note)
