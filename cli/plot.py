"""`nmt plot RUN_DIR [-o OUT.png]`: training curves of a run as one PNG."""

from __future__ import annotations

from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors


def command(
    run_dir: Path = typer.Argument(..., help="Run directory of `nmt train -o` (holds "
                                   "train_log.jsonl)."),
    output: Path = typer.Option(None, "-o", "--output", show_default="RUN_DIR/train_log.png",
                                help="PNG to write (atomically)."),
) -> None:
    """Plot loss, perplexity, learning rate, dev BLEU and tokens/s against updates and
    minutes (needs the optional extra: pip install 'nmt[plot]')."""
    with handle_errors("plot"):
        from nmt.plot import plot_run

        path = plot_run(run_dir, output)
        console.print(f"nmt plot: wrote {path}", markup=False, soft_wrap=True)
