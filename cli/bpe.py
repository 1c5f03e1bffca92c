"""`nmt bpe DATA`: learn the joint sentencepiece BPE model and binarize every split."""

from __future__ import annotations

from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors
from nmt.data.bpe import BpeConfig, run_bpe

_DEFAULTS = BpeConfig()


def command(
    data: Path = typer.Argument(..., help="DATA directory written by `nmt prep` "
                                "(train/valid/test .src/.tgt, manifest.json)."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", show_default="the recipe's, from "
                                   "DATA/manifest.json",
                                   help="Number of pieces in the joint vocabulary."),
    sample: int = typer.Option(_DEFAULTS.sample, "--sample", show_default=True,
                               help="Lines (source and target together) sampled to train "
                               "BPE; 0 = every line."),
    threads: int = typer.Option(_DEFAULTS.threads, "--threads", show_default=True,
                                help="Threads for training and encoding; 0 = all cores."),
    spm_from: Path | None = typer.Option(None, "--spm-from", show_default="none: learn a new "
                                         "model", help="Encode with the sentencepiece model "
                                         "stored in this nmt checkpoint (or a .model file) "
                                         "instead of learning one, so the ids match that "
                                         "model's (fine-tuning)."),
) -> None:
    """Learn DATA/spm.model over train.src + train.tgt (or take it from --spm-from), then
    write DATA/bin/*.npy."""
    with handle_errors("bpe"):
        cfg = BpeConfig(vocab_size=vocab_size, sample=sample, threads=threads,
                        spm_from=spm_from)
        run_bpe(data, cfg, report=lambda message: console.print(f"nmt bpe: {message}",
                                                                markup=False, soft_wrap=True))
