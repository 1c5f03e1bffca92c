"""Preemption: SIGTERM (sent by torchrun, Kubernetes, SLURM at the end of a job) and SLURM's
SIGUSR1 warning ask training to stop soon. Instead of dying mid-update and losing up to a
save interval, a rank notes the signal; the next update carries it to every rank in the
all-reduce that already carries the save/stop flags, so all ranks save the same update and
stop together (nmt.train.loop), and train() raises Preempted (exit 75)."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None))
                if s is not None)


class PreemptionWatch:
    """While open, SIGTERM and SIGUSR1 set `requested` (the signal's name) instead of
    ending the process. Only the main thread can install handlers: elsewhere (training
    called from another thread) the watch stays empty and the signals keep their effect."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self.requested = self.requested or signal.Signals(signum).name

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
