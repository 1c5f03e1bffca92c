"""Training curves: RUN/train_log.jsonl rendered as one PNG (`nmt plot RUN_DIR`).

The log (nmt/train/log.py) holds `kind: "train"` records (step, loss, nll, ppl, lr,
tokens_per_s, elapsed_minutes, ...) and `kind: "valid"` records (valid_loss, valid_nll,
valid_ppl, optionally valid_bleu). The figure has one row per quantity and two columns:
against updates (left) and against wall-clock minutes (right), so a run can be read both as
an optimisation curve and as a time-to-quality curve. matplotlib is an optional extra
(`pip install 'nmt[plot]'`); it is imported only when a plot is drawn.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt.errors import DataError, UsageError
from nmt.fileio import atomic_write_bytes

LOG_NAME = "train_log.jsonl"
MISSING_MATPLOTLIB = ("matplotlib is not installed, so nothing can be plotted; "
                      "run: pip install 'nmt[plot]'")


@dataclass
class RunLog:
    """The train and valid records of one run, in step order, superseded records dropped."""

    train: list[dict[str, Any]] = field(default_factory=list)
    valid: list[dict[str, Any]] = field(default_factory=list)


def _drop_superseded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After a resume the run repeats steps from its last checkpoint: when the step goes
    backwards, drop the earlier records at or beyond the new step (they belong to updates
    the resumed run threw away)."""
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def read_run_log(path: Path) -> RunLog:
    """Parse a train_log.jsonl; a truncated final line (a crash mid-write) is ignored, any
    other malformed line raises DataError naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no training log; run `nmt train DATA -o RUN` first, "
                        "then plot RUN") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the training log ({err})") from None
    log = RunLog()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last line of a crashed run may be cut short
                break
            raise DataError(f"{path}:{number}: not a JSON object ({err.msg}); "
                            "is this a train_log.jsonl written by `nmt train`?") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise DataError(f"{path}:{number}: record has no integer 'step'; "
                            "is this a train_log.jsonl written by `nmt train`?")
        kind = record.get("kind", "train")
        if kind == "train":
            log.train.append(record)
        elif kind == "valid":
            log.valid.append(record)
    log.train = _drop_superseded(log.train)
    log.valid = _drop_superseded(log.valid)
    if not log.train and not log.valid:
        raise DataError(f"{path}: no train or valid records yet; wait for the first "
                        "--log-interval updates")
    return log


def _series(records: list[dict[str, Any]], x_key: str, y_key: str
            ) -> tuple[list[float], list[float]]:
    """(x, y) of the records holding a finite number under both keys."""
    xs: list[float] = []
    ys: list[float] = []
    for record in records:
        x, y = record.get(x_key), record.get(y_key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


# (title, y label, log scale, [(records kind, key, legend label)])
_PANELS: list[tuple[str, str, bool, list[tuple[str, str, str]]]] = [
    ("Loss", "loss (nats / token)", False,
     [("train", "loss", "train (label-smoothed)"), ("train", "nll", "train NLL"),
      ("valid", "valid_loss", "valid (label-smoothed)"), ("valid", "valid_nll", "valid NLL")]),
    ("Perplexity", "perplexity", True,
     [("train", "ppl", "train"), ("valid", "valid_ppl", "valid")]),
    ("Learning rate", "learning rate", False, [("train", "lr", "lr")]),
    ("Dev BLEU", "BLEU (greedy, sacreBLEU)", False, [("valid", "valid_bleu", "valid")]),
    ("Throughput", "tokens / s (source + target)", False,
     [("train", "tokens_per_s", "train")]),
]


def _has(log: RunLog, kind: str, key: str) -> bool:
    records = log.train if kind == "train" else log.valid
    return any(isinstance(r.get(key), (int, float)) for r in records)


def render_png(log: RunLog, title: str) -> bytes:
    """The figure as PNG bytes: a row per quantity present in the log, columns = updates
    and minutes. Raises UsageError when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None
    panels = [p for p in _PANELS if any(_has(log, kind, key) for kind, key, _ in p[3])]
    fig = Figure(figsize=(12, 2.6 * len(panels) + 0.8), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(len(panels), 2, squeeze=False, sharex="col")
    for row, (name, ylabel, log_scale, curves) in enumerate(panels):
        for col, x_key in enumerate(("step", "elapsed_minutes")):
            ax = axes[row][col]
            for kind, key, label in curves:
                records = log.train if kind == "train" else log.valid
                xs, ys = _series(records, x_key, key)
                if xs:
                    marker = "o" if kind == "valid" else None
                    ax.plot(xs, ys, label=label, marker=marker, markersize=3, linewidth=1.2)
            if log_scale:
                ax.set_yscale("log")
            ax.set_title(f"{name} vs {'updates' if col == 0 else 'minutes'}", fontsize=10)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.grid(True, alpha=0.3)
            if len(ax.get_lines()) > 1:
                ax.legend(fontsize=8)
    axes[-1][0].set_xlabel("updates")
    axes[-1][1].set_xlabel("wall-clock minutes")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    """Render RUN_DIR/train_log.jsonl to `output` (default RUN_DIR/train_log.png),
    written atomically; returns the PNG's path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: not a directory; give the run directory of `nmt train -o`")
    output = Path(output) if output is not None else run_dir / "train_log.png"
    if output.suffix.lower() != ".png":
        raise UsageError(f"-o {output}: the plot is a PNG; give a path ending in .png")
    if not output.parent.is_dir():
        raise UsageError(f"-o {output}: folder {output.parent} does not exist; create it first")
    png = render_png(read_run_log(run_dir / LOG_NAME), title=f"nmt run {run_dir.name}")
    atomic_write_bytes(output, lambda handle: handle.write(png))
    return output


def require_matplotlib() -> None:
    """Raise UsageError (exit 2) with the install hint when matplotlib is missing, so a
    command can fail before doing work whose plots it could not draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None


_CELL_INCHES = 0.3  # side of one attention cell: room for a rotated piece label
_MAX_INCHES = 60.0  # cap on a figure side (6000 px at 100 dpi); long lines shrink the cells


def plot_attention(weights: Any, src_labels: list[str], tgt_labels: list[str],
                   heads: str = "mean", title: str = "") -> bytes:
    """An attention heatmap as PNG bytes, in the style of the paper's appendix figures.

    `weights` is array-like (heads, tgt_len, src_len): row i is the attention of output
    piece i over the source. Source pieces label the columns (on top, read left to right
    like the sentence), output pieces the rows. heads="mean" draws the head average in one
    panel; "all" draws one panel per head on a shared colour scale. Raises UsageError when
    matplotlib is missing.
    """
    import numpy as np

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None
    data = np.asarray(weights, dtype=np.float32)
    if data.ndim != 3 or data.shape[1:] != (len(tgt_labels), len(src_labels)):
        raise ValueError(f"weights of shape {data.shape} do not match "
                         f"{len(tgt_labels)} target x {len(src_labels)} source labels")
    if heads == "mean":
        panels, names = data.mean(axis=0, keepdims=True), ["mean over heads"]
    elif heads == "all":
        panels, names = data, [f"head {h + 1}" for h in range(data.shape[0])]
    else:
        raise UsageError(f"unknown heads mode {heads!r}; choose mean or all")
    n_tgt, n_src = data.shape[1:]
    cols = math.ceil(math.sqrt(len(panels)))  # a near-square grid: 4 heads 2x2, 8 as 3x3
    rows = -(-len(panels) // cols)
    # Per panel: room for the longest tick label (about 0.09 inch a character at 9 pt) on
    # the left (output pieces) and on top (source pieces, rotated), plus titles.
    margin_w = 0.8 + 0.09 * max(map(len, tgt_labels), default=1)
    margin_h = 0.9 + 0.09 * max(map(len, src_labels), default=1)
    want_w = cols * (n_src * _CELL_INCHES + 0.4) + margin_w + 1.2  # + the colorbar
    want_h = rows * (n_tgt * _CELL_INCHES + margin_h) + 0.6  # + the suptitle
    shrink = min(1.0, _MAX_INCHES / want_w, _MAX_INCHES / want_h)
    cell = _CELL_INCHES * shrink
    font = max(2.0, 9.0 * shrink)
    fig = Figure(figsize=(cols * (n_src * cell + 0.4) + margin_w * shrink + 1.2,
                          rows * (n_tgt * cell + margin_h * shrink) + 0.6),
                 layout="constrained")
    if title:
        fig.suptitle(title, fontsize=10)
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = float(panels.max()) if panels.size else 1.0
    image = None
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_axis_off()
            continue
        image = ax.imshow(panels[k], cmap="viridis", vmin=0.0, vmax=max(vmax, 1e-6),
                          interpolation="nearest", aspect="equal")
        ax.set_title(names[k], fontsize=9)
        ax.xaxis.tick_top()
        ax.set_xticks(range(n_src), src_labels, rotation=90, fontsize=font)
        ax.set_xlabel("source pieces", fontsize=8)
        if k % cols == 0:  # a row of panels shares the output pieces: label them once
            ax.set_yticks(range(n_tgt), tgt_labels, fontsize=font)
            ax.set_ylabel("output pieces", fontsize=8)
        else:
            ax.set_yticks(range(n_tgt), [])
    assert image is not None
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # a script the font lacks draws boxes, not stderr noise
        warnings.filterwarnings("ignore", message="Glyph .* missing")
        # "tight" grows the canvas if a long piece label would still be cut off
        fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", pad_inches=0.15)
    return buffer.getvalue()


def write_attention_png(path: Path, weights: Any, src_labels: list[str],
                        tgt_labels: list[str], heads: str = "mean", title: str = "") -> Path:
    """Render `plot_attention(...)` and write it to `path` atomically; returns `path`."""
    png = plot_attention(weights, src_labels, tgt_labels, heads, title)
    atomic_write_bytes(Path(path), lambda handle: handle.write(png))
    return Path(path)
