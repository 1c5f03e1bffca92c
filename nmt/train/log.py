"""Training logs: RUN/train_log.jsonl (every metric) and progress on stderr.

On a terminal, a rich progress bar (update, loss, ppl, lr, tokens/s, ETA); otherwise one
plain line per `--log-interval` updates. Only rank 0 creates these; nothing goes to stdout.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class JsonlLog:
    """Appends one JSON object per line and flushes, so a crash loses at most one line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handle: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` (non-finite floats become null, which JSON allows)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._handle.write(json.dumps(clean, sort_keys=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


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
