"""`nmt train DATA`: train (or resume) a Transformer on binarized data.

Multi-process: `--gpus N` / `--nproc N` re-launch this command under torchrun on one node.
Multi-node: run on every node
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500
             --rdzv_id RUN -m nmt.cli.main train DATA -o RUN ...
or `nmt train ... --gpus 8 --nnodes 2 --rdzv-endpoint HOST:29500` on each node.

The model and training settings are not spelled out here: each documented field of
`ModelConfig` (those in SETTABLE_MODEL_FIELDS) and `TrainConfig` becomes an option, named,
explained and shown with its default from the field itself (cli/options.py), so a new
field is a new flag with no edit here. The options below are the ones that are no field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from nmt.cli.common import console, handle_errors
from nmt.cli.options import config_options, with_options
from nmt.cli.progress import RichTrainProgress
from nmt.config import (
    DEFAULT_ARCH,
    DEVICES,
    MODEL_PRESETS,
    SETTABLE_MODEL_FIELDS,
    ModelConfig,
    TrainConfig,
)
from nmt.errors import UsageError
from nmt.train.settings import resolve


def _preset_help(field: dataclasses.Field[Any]) -> str:
    """'from --arch (tiny 2, small 3, base 6, big 6)': a model field's default is its arch's."""
    values = ", ".join(f"{arch} {preset.get(field.name, field.default)}"
                       for arch, preset in MODEL_PRESETS.items())
    return f"from --arch ({values})"


def _with_config_options(func: Callable[..., None]) -> Callable[..., None]:
    """`func` with the ModelConfig and TrainConfig options after its `arch` option."""
    return with_options(func, "arch", [*config_options(ModelConfig, SETTABLE_MODEL_FIELDS,
                                                       _preset_help),
                                       *config_options(TrainConfig)])


@_with_config_options
def command(
    data: Path = typer.Argument(..., help="DATA directory prepared by `nmt prep` + `nmt bpe`."),
    output: Path = typer.Option(
        Path("runs/train"),
        "-o",
        "--output",
        show_default=True,
        help="Run directory (checkpoints, train_log.jsonl). Re-running "
        "the same command resumes from its checkpoint_last.pt.",
    ),
    arch: str = typer.Option(
        None,
        "--arch",
        show_default=f"the recipe's, else {DEFAULT_ARCH}",
        help=f"Model preset: {', '.join(MODEL_PRESETS)}.",
    ),
    # (here: every ModelConfig and TrainConfig option, see _with_config_options)
    # --- fine-tuning ---
    init_from: Path = typer.Option(
        None,
        "--init-from",
        show_default="off",
        help="Start a new run from this model (a checkpoint, checkpoint_best.pt or an "
        "average): same vocabulary (nmt bpe DATA --spm-from MODEL) and architecture.",
    ),
    tensorboard: Path = typer.Option(
        None,
        "--tensorboard",
        show_default="off",
        help="Also write the log's scalars (loss, nll, ppl, lr, tokens/s, validation) and "
        "the settings as TensorBoard event files to this folder (needs the tensorboard "
        "package: pip install 'nmt[tensorboard]').",
    ),
    reset_optimizer: bool = typer.Option(
        False,
        "--reset-optimizer",
        show_default=True,
        help="With --init-from: fresh Adam state and learning-rate schedule (warm-up again) "
        "instead of the model file's.",
    ),
    # --- devices and processes ---
    device: str = typer.Option(
        DEVICES[0], "--device", show_default=True, help=f"{', '.join(DEVICES)}."
    ),
    gpus: int = typer.Option(
        1,
        "--gpus",
        show_default=True,
        help="GPUs on this node: >1 re-launches under torchrun (NCCL).",
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        show_default=True,
        help="CPU processes on this node: >1 re-launches under torchrun (gloo).",
    ),
    nnodes: int = typer.Option(
        1,
        "--nnodes",
        show_default=True,
        help="Nodes (multi-node: run the same command on each; needs --rdzv-endpoint).",
    ),
    rdzv_endpoint: str = typer.Option(
        None,
        "--rdzv-endpoint",
        show_default="standalone",
        help="HOST:PORT of torchrun's c10d rendezvous.",
    ),
    **settings: Any,
) -> None:
    """Train a Transformer on DATA/bin; resumes when -o holds checkpoint_last.pt.

    `settings`: the ModelConfig and TrainConfig options by field name, None where not given.
    """
    with handle_errors("train"):
        import sys

        from nmt.train.distributed import peer_failures_as_errors, relaunch, under_torchrun
        from nmt.train.loop import train

        if gpus < 1 or nproc < 1 or nnodes < 1:
            raise UsageError("--gpus, --nproc and --nnodes must be >= 1")
        if gpus > 1 and nproc > 1:
            raise UsageError("give --gpus (CUDA) or --nproc (CPU), not both")
        if gpus > 1 and device == "cpu":
            raise UsageError("--gpus needs --device cuda or auto; use --nproc for CPU")
        if nnodes > 1 and not rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        if tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise UsageError("--tensorboard needs the tensorboard package: pip install "
                             "'nmt[tensorboard]' (or pip install tensorboard)")
        model_flags = {k: v for k, v in settings.items() if k in SETTABLE_MODEL_FIELDS}
        train_flags = {k: v for k, v in settings.items() if k not in SETTABLE_MODEL_FIELDS}
        model_cfg, train_cfg, sources = resolve(data, arch, model_flags, train_flags)
        if init_from is not None:  # not config fields, but they change what is trained
            sources["init_from"] = f"{init_from} (flag)"
        if reset_optimizer:
            sources["reset_optimizer"] = "True (flag)"
        if sources:
            console.print(
                "nmt train: settings not at their defaults: "
                + ", ".join(
                    f"{k}={src}"
                    for k, src in sorted(sources.items())
                ),
                markup=False,
                soft_wrap=True,
            )
        if device not in DEVICES:
            raise UsageError(
                f"unknown --device {device!r}; choose one of: {', '.join(DEVICES)}"
            )
        procs = max(gpus, nproc)
        if (procs > 1 or nnodes > 1) and not under_torchrun():
            code = relaunch(procs, sys.argv[1:], nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)
            raise typer.Exit(code)
        with peer_failures_as_errors():
            summary = train(
                data,
                output,
                model_cfg,
                train_cfg,
                device="cuda" if gpus > 1 and device == "auto" else device,
                progress=RichTrainProgress(console),
                init_from=init_from,
                reset_optimizer=reset_optimizer,
                tensorboard=tensorboard,
            )
        if summary.last_checkpoint is not None:
            console.print(
                f"nmt train: stopped at update {summary.step} (epoch "
                f"{summary.epoch}{', early stop' if summary.stopped_early else ''}); "
                f"last checkpoint {summary.last_checkpoint}",
                markup=False,
                soft_wrap=True,
            )
