"""`nmt train DATA`: train (or resume) a Transformer on binarized data.

Multi-process: `--gpus N` / `--nproc N` re-launch this command under torchrun on one node.
Multi-node: run on every node
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500
             --rdzv_id RUN -m cli.main train DATA -o RUN ...
or `nmt train ... --gpus 8 --nnodes 2 --rdzv-endpoint HOST:29500` on each node.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from cli.common import console, handle_errors
from cli.progress import RichTrainProgress
from nmt.config import (
    DEFAULT_ARCH,
    DEVICES,
    MODEL_PRESETS,
    PRECISIONS,
    SETTABLE_MODEL_FIELDS,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
)
from nmt.errors import UsageError
from nmt.train.settings import resolve

_T = TrainConfig()
_M = ModelConfig()


def _preset_help(name: str) -> str:
    """'from --arch: tiny 2, small 3, base 6, big 6' for a ModelConfig field."""
    values = ", ".join(
        f"{arch} {MODEL_PRESETS[arch].get(name, getattr(_M, name))}" for arch in MODEL_PRESETS
    )
    return f"from --arch ({values})"


def _model_opt(name: str, help_text: str, flag: str | None = None) -> typer.models.OptionInfo:
    return typer.Option(
        None, flag or f"--{name.replace('_', '-')}", help=help_text, show_default=_preset_help(name)
    )


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
    # --- model knobs (None: the preset's value) ---
    encoder_layers: int = _model_opt("encoder_layers", "Encoder layers N."),
    decoder_layers: int = _model_opt("decoder_layers", "Decoder layers N."),
    d_model: int = _model_opt("d_model", "Model width d_model."),
    d_ff: int = _model_opt("d_ff", "Feed-forward inner size d_ff."),
    heads: int = _model_opt("heads", "Attention heads h."),
    d_k: int = _model_opt("d_k", "Per-head query/key size (None: d_model / h)."),
    d_v: int = _model_opt("d_v", "Per-head value size (None: d_model / h)."),
    dropout: float = _model_opt("dropout", "Residual + embedding dropout P_drop."),
    attention_dropout: float = _model_opt("attention_dropout", "Dropout on attention weights."),
    activation_dropout: float = _model_opt("activation_dropout", "Dropout after the FFN ReLU."),
    learned_positions: bool = typer.Option(
        None,
        "--learned-positions/--sinusoidal-positions",
        show_default="sinusoidal",
        help="Learned positional embeddings instead of sinusoids (Table 3 row E).",
    ),
    max_positions: int = _model_opt("max_positions", "Longest sequence the model accepts."),
    pre_norm: bool = typer.Option(
        None,
        "--pre-norm/--post-norm",
        show_default="post-norm",
        help="LayerNorm before each sub-layer instead of after.",
    ),
    # --- optimisation ---
    seed: int = typer.Option(None, "--seed", show_default=str(_T.seed), help="Random seed."),
    lr_schedule: str = typer.Option(
        None,
        "--lr-schedule",
        show_default=_T.lr_schedule,
        help="Learning-rate schedule; inverse_sqrt: the paper's warm-up then 1/sqrt(step).",
    ),
    lr_scale: float = typer.Option(
        None,
        "--lr-scale",
        show_default=str(_T.lr_scale),
        help="Multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).",
    ),
    warmup: int = typer.Option(
        None, "--warmup", show_default=str(_T.warmup), help="Warm-up updates of the schedule."
    ),
    adam_beta1: float = typer.Option(None, "--adam-beta1", show_default=str(_T.adam_beta1)),
    adam_beta2: float = typer.Option(None, "--adam-beta2", show_default=str(_T.adam_beta2)),
    adam_eps: float = typer.Option(None, "--adam-eps", show_default=str(_T.adam_eps)),
    weight_decay: float = typer.Option(None, "--weight-decay", show_default=str(_T.weight_decay)),
    clip_norm: float = typer.Option(
        None,
        "--clip-norm",
        show_default=str(_T.clip_norm),
        help="Clip the gradient norm; 0 = no clipping.",
    ),
    label_smoothing: float = typer.Option(
        None, "--label-smoothing", show_default=str(_T.label_smoothing), help="epsilon_ls."
    ),
    # --- batching ---
    max_tokens: int = typer.Option(
        None,
        "--max-tokens",
        show_default=str(_T.max_tokens),
        help="Tokens (padding included) per process per micro-batch.",
    ),
    update_freq: int = typer.Option(
        None,
        "--update-freq",
        show_default=str(_T.update_freq),
        help="Micro-batches accumulated per update.",
    ),
    batch_tokens: int = typer.Option(
        None,
        "--batch-tokens",
        show_default="off",
        help="Tokens per update (paper: 25000); derives "
        "update-freq = ceil(B / (processes x max-tokens)).",
    ),
    max_len: int = typer.Option(
        None,
        "--max-len",
        show_default=str(_T.max_len),
        help="Skip training pairs with a side longer than this (tokens incl. EOS).",
    ),
    precision: str = typer.Option(
        None,
        "--precision",
        show_default=str(_T.precision),
        help=f"One of {', '.join(PRECISIONS)} (autocast; fp16 uses dynamic loss scaling).",
    ),
    # --- length of training (totals) ---
    max_updates: int = typer.Option(
        None,
        "--max-updates",
        show_default=str(_T.max_updates),
        help="Total updates (a resumed run stops at the same place).",
    ),
    max_epochs: int = typer.Option(
        None, "--max-epochs", show_default=str(_T.max_epochs), help="Total epochs; 0 = no limit."
    ),
    max_minutes: float = typer.Option(
        None,
        "--max-minutes",
        show_default=str(_T.max_minutes),
        help="Total training minutes; 0 = no limit.",
    ),
    # --- checkpoints, validation, logging ---
    save_interval_minutes: float = typer.Option(
        None,
        "--save-interval-minutes",
        show_default=str(_T.save_interval_minutes),
        help="Save every this many minutes (paper: 10); 0 = off.",
    ),
    save_interval_updates: int = typer.Option(
        None,
        "--save-interval-updates",
        show_default=str(_T.save_interval_updates),
        help="Also save every this many updates; 0 = off.",
    ),
    keep_last: int = typer.Option(
        None,
        "--keep-last",
        show_default=str(_T.keep_last),
        help="Numbered checkpoints kept (paper averages 5 / 20).",
    ),
    valid_interval: int = typer.Option(
        None,
        "--valid-interval",
        show_default=str(_T.valid_interval),
        help="Validate every this many updates.",
    ),
    valid_bleu: bool = typer.Option(
        None,
        "--valid-bleu/--no-valid-bleu",
        show_default=str(_T.valid_bleu),
        help="Also decode the valid split: sacreBLEU and chrF.",
    ),
    valid_beam: int = typer.Option(
        None,
        "--valid-beam",
        show_default=f"translate's beam ({DecodeConfig().beam})",
        help="Beam for --valid-bleu decoding; 1 = greedy (faster).",
    ),
    best_metric: str = typer.Option(
        None,
        "--best-metric",
        show_default=str(_T.best_metric),
        help="loss | bleu | chrf: the validation score that picks RUN/checkpoint_best.pt "
        "(bleu/chrf decode the valid split).",
    ),
    patience: int = typer.Option(
        None,
        "--patience",
        show_default=str(_T.patience),
        help="Stop after this many validations in a row without a better --best-metric; "
        "0 = never.",
    ),
    ema_decay: float = typer.Option(
        None,
        "--ema-decay",
        show_default=str(_T.ema_decay),
        help="Keep an exponential moving average of the weights (e.g. 0.9999), validated "
        "and saved beside them; translate/average use it by default. 0 = off.",
    ),
    log_interval: int = typer.Option(
        None,
        "--log-interval",
        show_default=str(_T.log_interval),
        help="Log every this many updates.",
    ),
    max_nonfinite_in_a_row: int = typer.Option(
        None,
        "--max-nonfinite-in-a-row",
        show_default=str(_T.max_nonfinite_in_a_row),
        help="Abort (exit 7) after this many skipped non-finite updates in a row.",
    ),
    # --- fine-tuning ---
    init_from: Path = typer.Option(
        None,
        "--init-from",
        show_default="off",
        help="Start a new run from this model (a checkpoint, checkpoint_best.pt or an "
        "average): same vocabulary (nmt bpe DATA --spm-from MODEL) and architecture.",
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
) -> None:
    """Train a Transformer on DATA/bin; resumes when -o holds checkpoint_last.pt."""
    flags = dict(locals())  # every option by name, for TrainConfig below
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
        model_flags = {k: flags[k] for k in SETTABLE_MODEL_FIELDS}
        train_flags = {f.name: flags[f.name] for f in dataclasses.fields(TrainConfig)}
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
            )
        if summary.last_checkpoint is not None:
            console.print(
                f"nmt train: stopped at update {summary.step} (epoch "
                f"{summary.epoch}{', early stop' if summary.stopped_early else ''}); "
                f"last checkpoint {summary.last_checkpoint}",
                markup=False,
                soft_wrap=True,
            )
