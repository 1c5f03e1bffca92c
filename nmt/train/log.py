"""Training logs: RUN/train_log.jsonl (every metric) and progress through a reporter.

The trainer writes through a `RunLog`: the records of its log windows and validations go
to the file, and it tells a `TrainReporter` where it starts, every update, every log
record and every one-off message; how that is shown is the caller's: `PlainReporter`
writes one line per `--log-interval` updates to stderr (logs, pipes, library use); the CLI
draws a rich bar on a terminal (cli/progress.py). Only rank 0 reports; nothing goes to
stdout.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from nmt.data.batch_tokens import Batching, fill_note
from nmt.fileio import atomic_output, remove_stale_temps
from nmt.train.best import BestTracker

if TYPE_CHECKING:
    import torch

    from nmt.config import TrainConfig
    from nmt.data.batching import Batches


@dataclass
class LogWindow:
    """Running sums of the updates between two train records, and the record they make."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0  # target tokens (loss normaliser)
    src_tgt_tokens: int = 0  # non-padding source + target tokens (throughput)
    update_tgt_tokens: int = 0  # non-padding target tokens of every update, skipped ones too
    updates: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, finite: bool, loss: float, nll: float, tokens: int, src_tgt_tokens: int
            ) -> None:
        """Count one update (a skipped, non-finite one only in the token counts)."""
        if finite:
            self.loss += loss
            self.nll += nll
            self.tokens += tokens
        self.src_tgt_tokens += src_tgt_tokens
        self.update_tgt_tokens += tokens
        self.updates += 1

    def record(self, step: int, epoch: int, lr: float, progress: float, grad_norm: float,
               **rest: Any) -> dict[str, Any]:
        """The window's train record: loss, NLL, perplexity, tokens/s and what an update
        really held, around the given update's numbers; `rest` goes at the end."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        nll = self.nll / self.tokens
        return {
            "kind": "train", "step": step, "epoch": epoch,
            "loss": self.loss / self.tokens, "nll": nll, "ppl": math.exp(min(nll, 50.0)),
            "lr": lr, "progress": progress, "grad_norm": grad_norm,
            "tokens_per_s": self.src_tgt_tokens / seconds,
            "target_tokens": self.tokens, "updates": self.updates,
            # What an update really held (EOS included, no padding): --batch-tokens counts
            # padded slots of the longer side, so these come out below it.
            "source_tokens_per_update": round(
                (self.src_tgt_tokens - self.update_tgt_tokens) / self.updates),
            "target_tokens_per_update": round(self.update_tgt_tokens / self.updates),
            **rest,
        }


class RunLog:
    """Rank 0's record log and progress reporter as the trainer uses them; on the other
    ranks (both None) every call does nothing, so the loop need not ask which rank it is."""

    def __init__(self, records: RecordLog | None = None,
                 reporter: TrainReporter | None = None) -> None:
        self.records, self.reporter = records, reporter

    def say(self, text: str) -> None:
        """A one-off line through the reporter."""
        if self.reporter is not None:
            self.reporter.message(text)

    def start(self, total: int, done: int, budget_s: float, elapsed_s: float) -> None:
        """Training goes from update `done` to `total` (see TrainReporter.start)."""
        if self.reporter is not None:
            self.reporter.start(total, done, budget_s, elapsed_s)

    def advance(self, step: int, elapsed_s: float) -> None:
        """Update `step` is done."""
        if self.reporter is not None:
            self.reporter.advance(step, elapsed_s)

    def train(self, window: LogWindow, scaler: torch.amp.GradScaler, elapsed: float,
              **fields: Any) -> None:
        """The train record of `window` (none for an empty one): `fields` as
        `LogWindow.record` takes them, then fp16's loss scale and the clock. The scale is
        read here, on rank 0 alone: reading it waits for the device."""
        if self.records is None or window.tokens == 0:
            return
        record = window.record(
            **fields, loss_scale=scaler.get_scale() if scaler.is_enabled() else None,
            wall_time=time.time(), elapsed_minutes=elapsed / 60)
        self.records.write(record)
        if self.reporter is not None:
            self.reporter.update(record)

    def valid(self, step: int, epoch: int, metrics: dict[str, float], best: BestTracker,
              improved: bool, elapsed: float) -> None:
        """A valid record and its line (`best`: the tracker after this validation)."""
        if self.records is None:
            return
        self.records.write({"kind": "valid", "step": step, "epoch": epoch,
                            **{f"valid_{k}": v for k, v in metrics.items()},
                            "best": best.best, "best_step": best.best_step,
                            "wall_time": time.time(), "elapsed_minutes": elapsed / 60})
        text = " | ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        mark = " (best so far)" if improved else \
            f" (best {best.best:.3f} at update {best.best_step})"
        self.say(f"valid at update {step}: {text}{mark}")

    def close(self) -> None:
        """Training ended: the reporter stops, the log is closed."""
        if self.reporter is not None:
            self.reporter.close()
        if self.records is not None:
            self.records.close()


def start_line(cfg: TrainConfig, batching: Batching, world_size: int, pairs: int,
               batches: Batches, weighted: bool, precision: str, device: str,
               note: str | None, step: int) -> str:
    """The run's first line: its data (`batches`: the first epoch's), the batch of an
    update, the precision (`note`: why it is slow or was chosen on this device:
    nmt.precision.precision_note) and a resumed `step`."""
    return (f"{pairs} training pairs"
            + (" (corpora sampled by weight each epoch)" if weighted else "")
            + f" in {len(batches.batches)} batches ({batches.skipped} longer than "
            f"--max-len {cfg.max_len} skipped); {world_size} process(es) x max-tokens "
            f"{batching.micro_tokens} x update-freq {batching.update_freq}"
            + (f" (derived from --batch-tokens {cfg.batch_tokens} real tokens per side: "
               f"{fill_note(batching, world_size)})" if cfg.batch_tokens else "")
            + f"; precision {precision} on {device}"
            + (f" ({note})" if note else "")
            + (f"; resuming from update {step}" if step else ""))


def warner(progress: TrainReporter | None) -> Callable[[str], None]:
    """A warning function: through `progress` when there is one, else a line on stderr.
    (A closure over the reporter alone: nothing that holds it keeps a trainer alive.)"""
    def warn(text: str) -> None:
        if progress is not None:
            progress.message(f"warning: {text}")
        else:
            warn_line(text)
    return warn


class RecordLog(Protocol):
    """Where the trainer's log records go (JsonlLog; with --tensorboard a TeeLog)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLog:
    """Appends one JSON object per line and flushes, so a crash loses at most one line.

    Opened for a resumed run (`resume_step`), it first drops what the resumed run will redo:
    records of updates after `resume_step` (written after the checkpoint it resumes from)
    and a torn last line of a killed process, so each update is logged once, and the temp
    file of such a rewrite that was itself killed. A failed
    append (disk full, quota) must not kill a training run whose checkpoints may still fit:
    the file is cut back to its last whole line, one warning goes to `warn`, and later
    records are tried again.
    """

    def __init__(self, path: Path, resume_step: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self._warn = warn if warn is not None else warn_line
        self._failing = False
        if resume_step is not None:
            # a rewrite below killed in an earlier resume leaves its temp file (one writer)
            remove_stale_temps(self.path.parent, self.path.name)
            if self.path.is_file():
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
    per_update = (f"| tok/update {record['source_tokens_per_update']}+"
                  f"{record['target_tokens_per_update']} "
                  if "target_tokens_per_update" in record else "")
    return (f"update {record['step']} | epoch {record['epoch']} | loss {record['loss']:.3f} "
            f"| ppl {record['ppl']:.2f} | lr {record['lr']:.3g} "
            f"| tok/s {record['tokens_per_s']:.0f} {per_update}"
            f"| {record['elapsed_minutes']:.1f} min")


class TrainReporter(Protocol):
    """What the trainer reports (rank 0 only)."""

    def start(self, total: int, done: int, budget_s: float, elapsed_s: float) -> None:
        """Training goes to update `total` from `done`; `budget_s` > 0: --max-minutes in
        seconds, of which `elapsed_s` are spent (a resumed run)."""
        ...

    def advance(self, step: int, elapsed_s: float) -> None:
        """Update `step` is done, `elapsed_s` seconds into the run (every update)."""
        ...

    def update(self, record: dict[str, Any]) -> None:
        """A training log record (every --log-interval updates)."""
        ...

    def message(self, text: str) -> None:
        """A one-off line (validation, checkpoint saved, settings)."""
        ...

    def close(self) -> None:
        """Training ended."""
        ...


def time_left(total: int, done: int, step: int, budget_s: float, start_s: float,
              elapsed_s: float) -> float | None:
    """Seconds until training ends: by --max-updates at the rate since `done` (update
    count at `start_s` seconds), or by --max-minutes (`budget_s`), whichever ends first;
    None before the first update of this process gives a rate."""
    limits = []
    if budget_s > 0:
        limits.append(max(0.0, budget_s - elapsed_s))
    if step > done and elapsed_s > start_s:
        limits.append((total - step) * (elapsed_s - start_s) / (step - done))
    return min(limits) if limits else None


class PlainReporter:
    """One line per log record and per message on a text stream (stderr by default)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr

    def start(self, total: int, done: int, budget_s: float, elapsed_s: float) -> None:
        """Nothing to draw."""

    def advance(self, step: int, elapsed_s: float) -> None:
        """Nothing to draw between log lines."""

    def update(self, record: dict[str, Any]) -> None:
        """One line of the record's main figures."""
        self._line(_fmt(record))

    def message(self, text: str) -> None:
        """The text as a line."""
        self._line(text)

    def close(self) -> None:
        """Nothing to close."""

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
