"""Rich progress bars on stderr for the library's `Reporter` protocol (nmt.data.download).

The library only reports (start, advance, done); drawing belongs to the CLI, so `nmt/` never
imports rich.
"""

from __future__ import annotations

import time
from typing import Any


class RichReporter:
    """A Reporter drawing rich progress bars on a stderr console. Bars are shown only when
    that console is a terminal, so logs and pipes get no control sequences. Refreshes are
    driven by `advance` (at most 10 a second), not by a thread, so worker processes can
    still be forked safely."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  DownloadColumn(), TimeRemainingColumn(), console=console,
                                  disable=not console.is_terminal, transient=True,
                                  auto_refresh=False)
        self._task: Any = None
        self._last = 0.0

    def __enter__(self) -> RichReporter:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, label: str, total: int | None) -> None:
        """Add a bar for `label`."""
        self._task = self._progress.add_task(label, total=total)

    def advance(self, amount: int) -> None:
        """Move the current bar."""
        if self._task is not None:
            self._progress.advance(self._task, amount)
            now = time.monotonic()
            if now - self._last > 0.1:
                self._last = now
                self._progress.refresh()

    def done(self) -> None:
        """Remove the current bar."""
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None


def _clock(seconds: float | None) -> str:
    """h:mm:ss, or -:--:-- when not known yet."""
    if seconds is None:
        return "-:--:--"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class RichTrainProgress:
    """nmt.train.log.TrainReporter as a rich bar on a terminal: it moves at every update,
    shows the last log record's loss, lr and tokens/s, and the time left until
    --max-updates or --max-minutes, whichever ends first. Off a terminal (a log file, a
    pipe) it writes PlainReporter's lines instead, without control sequences."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        from nmt.train.log import PlainReporter

        self.console = console
        self.plain = None if console.is_terminal else PlainReporter(console.file)
        self._progress = Progress(
            TextColumn("update {task.completed}/{task.total}"), BarColumn(),
            TextColumn("{task.fields[stats]}"), TextColumn("{task.fields[left]} left"),
            console=console, transient=False, auto_refresh=False)
        self._task: Any = None
        self._origin = (0, 0.0)  # (update, seconds) when this process started
        self._limits = (0, 0.0)  # (--max-updates, --max-minutes in seconds)
        self._last = 0.0

    def start(self, total: int, done: int, budget_s: float, elapsed_s: float) -> None:
        """Show the bar at update `done` of `total`."""
        if self.plain is not None:
            return
        self._origin, self._limits = (done, elapsed_s), (total, budget_s)
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=done,
                                             stats="", left=_clock(budget_s - elapsed_s
                                                                   if budget_s else None))

    def advance(self, step: int, elapsed_s: float) -> None:
        """Move the bar to `step`; redraw at most 10 times a second."""
        from nmt.train.log import time_left

        if self._task is None:
            return
        total, budget = self._limits
        left = time_left(total, self._origin[0], step, budget, self._origin[1], elapsed_s)
        self._progress.update(self._task, completed=step, left=_clock(left))
        now = time.monotonic()
        if now - self._last > 0.1:
            self._last = now
            self._progress.refresh()

    def update(self, record: dict[str, Any]) -> None:
        """The last log record's figures beside the bar."""
        if self.plain is not None:
            self.plain.update(record)
        elif self._task is not None:
            stats = (f"loss {record['loss']:.3f} ppl {record['ppl']:.2f} "
                     f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s")
            self._progress.update(self._task, stats=stats)
            self._progress.refresh()

    def message(self, text: str) -> None:
        """A line above the bar."""
        if self.plain is not None:
            self.plain.message(text)
        else:
            self._progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        """Leave the final bar on screen."""
        if self._task is not None:
            self._progress.refresh()
            self._progress.stop()
            self._task = None
