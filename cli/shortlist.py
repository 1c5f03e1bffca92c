"""`nmt shortlist DATA [-o FILE]`: learn a lexical shortlist from the binarized training data."""

from __future__ import annotations

from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors
from nmt.data.shortlist import FREQUENT, PER_SOURCE  # numpy only: cheap to import
from nmt.errors import UsageError

DEFAULT_NAME = "shortlist.npz"


def command(
    data: Path = typer.Argument(..., help="A data directory made by `nmt bpe`."),
    output: Path = typer.Option(None, "--output", "-o", show_default=f"DATA/{DEFAULT_NAME}",
                                help="Shortlist file (written atomically)."),
    per_source: int = typer.Option(PER_SOURCE, "--per-source", show_default=True,
                                   help="Target pieces kept per source piece, the most "
                                   "probable translations first."),
    frequent: int = typer.Option(FREQUENT, "--frequent", show_default=True,
                                 help="Most frequent target pieces, always candidates."),
) -> None:
    """Learn which target pieces each source piece translates into (IBM Model 1 over the
    training pairs); `nmt translate --shortlist FILE` then scores only a batch's candidates
    instead of the whole vocabulary: faster, at a small cost in BLEU (docs/performance.md)."""
    with handle_errors("shortlist"):
        from nmt.data.dataset import ParallelData, load_vocab
        from nmt.data.shortlist import learn_shortlist

        for name, value in (("--per-source", per_source), ("--frequent", frequent)):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        vocab = load_vocab(data)
        train = ParallelData.open(data, "train")
        shortlist = learn_shortlist(train.src.tokens, train.src.offsets, train.tgt.tokens,
                                    train.tgt.offsets, len(vocab), per_source, frequent)
        path = output or Path(data) / DEFAULT_NAME
        shortlist.save(path)
        console.print(f"nmt shortlist: {path}: {per_source} pieces per source piece, "
                      f"{len(shortlist.frequent)} frequent, from {len(train)} training pairs",
                      markup=False, soft_wrap=True)
