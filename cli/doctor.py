"""`nmt doctor [--json]`: this machine and install as nmt sees them (nmt/doctor.py)."""

from __future__ import annotations

import json

import typer

from nmt.cli.common import handle_errors


def command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object (for bug reports "
                                 "and benchmark records) instead of lines to read."),
    measure: bool = typer.Option(True, "--measure/--no-measure", show_default=True,
                                 help="Time a bf16 matmul against fp32 here (about a "
                                 "second), beside the rule `--precision auto` follows."),
) -> None:
    """Print the CPU and the class nmt sees, which C kernels load (and why others do not),
    what --precision auto picks and why, threads, torch, CUDA, GPUs and optional extras."""
    with handle_errors("doctor"):
        from nmt.doctor import report, text  # torch: load lazily

        facts = report(measure=measure)
        if as_json:
            print(json.dumps(facts))
        else:
            print(text(facts))
