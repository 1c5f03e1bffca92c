"""Training logs: RUN/train_log.jsonl (every metric) and progress on stderr.

On a terminal, a rich progress bar (update, loss, ppl, lr, tokens/s, ETA); otherwise one
plain line per `--log-interval` updates. Only rank 0 creates these; nothing goes to stdout.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from nmt.fileio import atomic_output


class JsonlLog:
    """Appends one JSON object per line and flushes, so a crash loses at most one line.

    Opened for a resumed run (`resume_step`), it first drops what the resumed run will redo:
    records of updates after `resume_step` (written after the checkpoint it resumes from)
    and a torn last line of a killed process, so each update is logged once. A failed
    append (disk full, quota) must not kill a training run whose checkpoints may still fit:
    the file is cut back to its last whole line, one warning goes to `warn`, and later
    records are tried again.
    """

    def __init__(self, path: Path, resume_step: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self._warn = warn if warn is not None else warn_line
        self._failing = False
        if resume_step is not None and self.path.is_file():
            _drop_after(self.path, resume_step)
        self._handle: TextIO = self.path.open("a", encoding="utf-8")
        self._good = self._handle.tell()  # end of the last whole line

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` (non-finite floats become null, which JSON allows)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        try:
            self._handle.write(json.dumps(clean, sort_keys=False) + "\n")
            self._handle.flush()
        except OSError as err:
            self._recover(err)
            return
        self._good = self._handle.tell()
        if self._failing:
            self._failing = False
            self._warn(f"{self.path}: writing again; records in between were lost")

    def _recover(self, err: OSError) -> None:
        """Cut a torn line off and reopen, so the next record starts a line of its own."""
        try:
            self._handle.close()
        except OSError:
            pass  # the buffered bytes could not be written either: they are what we cut
        try:
            with self.path.open("r+b") as raw:
                raw.truncate(self._good)
        except OSError:
            pass
        self._handle = self.path.open("a", encoding="utf-8")
        if not self._failing:
            self._failing = True
            self._warn(f"{self.path}: cannot append ({err.strerror or err}); training goes "
                       "on, log records are lost until it can")

    def close(self) -> None:
        """Close the file (a failed final flush is reported like a failed write)."""
        try:
            self._handle.close()
        except OSError as err:
            self._recover(err)
            self._handle.close()


def warn_line(text: str) -> None:
    """One `warning: ...` line on stderr (training's warnings without a progress bar)."""
    sys.stderr.write(f"warning: {text}\n")
    sys.stderr.flush()


def _drop_after(path: Path, step: int) -> None:
    """Rewrite a JSONL log (atomically) without records of updates after `step` and without
    lines that are not whole JSON objects (the torn last line of a killed writer)."""
    kept: list[str] = []
    changed = False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            changed = True
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) > step:
            changed = True
            continue
        kept.append(line)
    if changed:
        with atomic_output(path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a JSONL log (for tests and tools)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]


def _fmt(record: dict[str, Any]) -> str:
    return (f"update {record['step']} | epoch {record['epoch']} | loss {record['loss']:.3f} "
            f"| ppl {record['ppl']:.2f} | lr {record['lr']:.3g} "
            f"| tok/s {record['tokens_per_s']:.0f} | {record['elapsed_minutes']:.1f} min")


class ProgressReporter:
    """A rich bar on an interactive stderr, plain lines otherwise."""

    def __init__(self, total: int, start: int, stream: TextIO | None = None,
                 interactive: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if interactive is None:
            interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interactive = interactive
        self._progress: Progress | None = None
        if interactive:
            console = Console(file=self.stream, highlight=False)
            self._progress = Progress(
                TextColumn("update {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=console,
                transient=False)
            self._task = self._progress.add_task("train", total=total, completed=start,
                                                 stats="")
            self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        """Show a training record (called every log interval)."""
        if self._progress is not None:
            stats = (f"loss {record['loss']:.3f} ppl {record['ppl']:.2f} "
                     f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s")
            self._progress.update(self._task, completed=record["step"], stats=stats)
        else:
            self.stream.write(_fmt(record) + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A one-off line (validation results, checkpoint saved, derived settings)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Stop the bar."""
        if self._progress is not None:
            self._progress.stop()
