"""TensorBoard event files beside RUN/train_log.jsonl (`nmt train --tensorboard DIR`).

The same records go to both: each train record's scalars under `train/` (loss, nll, ppl,
lr, progress, grad_norm, tokens_per_s, loss_scale), each validation record's under
`valid/`, by update number, and the run's settings once as text. A resumed run purges
the events of updates it will redo, as the JSONL log drops their records. Optional: the
`tensorboard` package (`pip install 'nmt[tensorboard]'`) is needed only with the flag.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nmt.errors import UsageError
from nmt.train.log import RecordLog, warn_line

TRAIN_SCALARS = ("loss", "nll", "ppl", "lr", "progress", "grad_norm", "tokens_per_s",
                 "loss_scale")
NOT_SCALARS = {"kind", "step", "epoch", "wall_time", "elapsed_minutes", "best_step"}


class TensorBoardLog:
    """Writes log records as TensorBoard scalars into `directory` (created). Like the JSONL
    log, a failed write (disk full) warns once through `warn` and training goes on."""

    def __init__(self, directory: Path, settings: dict[str, Any],
                 resume_step: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.directory = Path(directory)
        self._warn = warn if warn is not None else warn_line
        self._failing = False
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise UsageError("--tensorboard needs the tensorboard package: pip install "
                             "'nmt[tensorboard]' (or pip install tensorboard)") from err
        # purge_step: events at or after it, left by a killed run, are hidden on resume.
        purge = resume_step + 1 if resume_step else None
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge)
        self._writer.add_text("settings", settings_markdown(settings),
                              global_step=resume_step or 0)
        self._writer.flush()

    def write(self, record: dict[str, Any]) -> None:
        """Add the numeric fields of a `train` or `valid` record as scalars."""
        kind, step = record.get("kind"), int(record["step"])
        if kind == "train":
            names: tuple[str, ...] = TRAIN_SCALARS
        elif kind == "valid":
            names = tuple(k for k in record if k not in NOT_SCALARS)
        else:
            return
        try:
            for name in names:
                value = record.get(name)
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if math.isfinite(value):
                    tag = f"{kind}/{name.removeprefix('valid_')}"
                    self._writer.add_scalar(tag, value, step,
                                            walltime=record.get("wall_time"))
            self._writer.flush()
        except OSError as err:
            if not self._failing:
                self._failing = True
                self._warn(f"{self.directory}: cannot write TensorBoard events "
                           f"({err.strerror or err}); training goes on")

    def close(self) -> None:
        """Flush and close the event file."""
        try:
            self._writer.close()
        except OSError as err:
            self._warn(f"{self.directory}: cannot close the TensorBoard events "
                       f"({err.strerror or err})")


def settings_markdown(settings: dict[str, Any]) -> str:
    """The settings as a two-column markdown table (TensorBoard's text tab renders it)."""
    rows = [f"| {key} | {json.dumps(value, default=str)} |"
            for key, value in sorted(settings.items())]
    return "\n".join(["| setting | value |", "|---|---|", *rows])


class TeeLog:
    """Writes each record to several logs (the JSONL log and a TensorBoardLog)."""

    def __init__(self, *logs: RecordLog) -> None:
        self.logs = logs

    def write(self, record: dict[str, Any]) -> None:
        """Write `record` to every log."""
        for log in self.logs:
            log.write(record)

    def close(self) -> None:
        """Close every log."""
        for log in self.logs:
            log.close()
