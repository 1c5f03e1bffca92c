"""`nmt average RUN_DIR --last N -o OUT` or `nmt average A.pt B.pt ... -o OUT`."""

from __future__ import annotations

from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors
from nmt.errors import UsageError


def command(
    inputs: list[Path] = typer.Argument(..., help="A run directory (with --last) or "
                                        "checkpoint files to average."),
    output: Path = typer.Option(..., "--output", "-o", help="Averaged model file (written "
                                "atomically; loads in `nmt translate`)."),
    last: int = typer.Option(None, "--last", show_default="every file given",
                             help="Average the N checkpoints of RUN_DIR with the highest "
                             "step stored inside them (paper: base 5, big 20)."),
    weights: str = typer.Option("auto", "--weights", show_default=True,
                                help="auto | raw | ema: average the EMA weights of runs "
                                "trained with --ema-decay (auto: when every input has them)."),
) -> None:
    """Average model parameters (summed in float64) of several checkpoints of one run."""
    with handle_errors("average"):
        from nmt.average import average_checkpoints, last_checkpoints  # torch: load lazily

        if last is not None:
            if len(inputs) != 1 or not inputs[0].is_dir():
                raise UsageError("--last N takes exactly one run directory")
            paths = last_checkpoints(inputs[0], last)
        else:
            dirs = [str(p) for p in inputs if p.is_dir()]
            if dirs:
                raise UsageError(f"{dirs[0]} is a directory; pass --last N to pick its "
                                 "newest checkpoints, or list checkpoint files")
            paths = list(inputs)
        summary = average_checkpoints(paths, output, weights)
        steps = ", ".join(str(item["step"]) for item in summary["inputs"])
        console.print(f"nmt average: wrote {output} from {len(paths)} checkpoints "
                      f"(steps {steps}; {summary['weights']} weights)", markup=False,
                      soft_wrap=True)
