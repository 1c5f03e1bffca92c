"""Prepare the next update's micro-batches while the current update computes.

On a GPU, collating a micro-batch (numpy padding), pinning it and queueing its host-to-device
copy and target selection take the host a few milliseconds per micro-batch; done in line,
the GPU idles meanwhile. `Prefetcher` hands out updates one at a time and, as soon as it
hands one out, pulls the following update from the same iterator and prepares its
micro-batches on one background thread. The iterator must not mutate trainer state as it
yields (`TrainFeed.updates` yields each update's data position instead), so reading one
update ahead changes nothing that is saved. With `enabled=False` (the CPU default: there the
host is the device and a second busy thread only competes with it) every micro-batch is
prepared in line, when asked for; both modes give identical batches in identical order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np

U = TypeVar("U")  # an update: carries its micro-batches' index arrays
P = TypeVar("P")  # a prepared micro-batch


class Prefetcher(Generic[U, P]):
    """Iterate (update, prepared micro-batch getters), one update prepared ahead."""

    def __init__(self, updates: Iterator[U], micro: Callable[[U], Sequence[np.ndarray]],
                 prepare: Callable[[np.ndarray], P], enabled: bool) -> None:
        self._updates = updates
        self._micro = micro
        self._prepare = prepare
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nmt-prefetch") if enabled \
            else None
        self._ahead: tuple[U, list[Future[P]]] | None = None
        self._done = False

    def _submit(self) -> tuple[U, list[Future[P]]] | None:
        """Pull the next update and queue its preparation (None at the end)."""
        update = next(self._updates, None)
        if update is None:
            self._done = True
            return None
        assert self._pool is not None
        return update, [self._pool.submit(self._prepare, ids) for ids in self._micro(update)]

    def next(self) -> tuple[U, list[Callable[[], P]]] | None:
        """The next update and, per micro-batch, a call returning it prepared; None when
        the updates are exhausted."""
        if self._pool is None:
            update = next(self._updates, None)
            if update is None:
                return None
            return update, [lambda ids=ids: self._prepare(ids) for ids in self._micro(update)]
        current = self._ahead if self._ahead is not None else (
            None if self._done else self._submit())
        if current is None:
            return None
        self._ahead = None if self._done else self._submit()
        update, futures = current
        return update, [f.result for f in futures]

    def close(self) -> None:
        """Stop the background thread (pending preparations are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
