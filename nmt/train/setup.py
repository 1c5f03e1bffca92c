"""What a training run is built from, before its first update: the process and device,
the checked model config, the data's splits and batches, the model with its optimizer,
schedule, precision and scaler, and the logs. Functions of their inputs, so the loop
(nmt/train/loop.py) only orders them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt.config import ModelConfig, TrainConfig
from nmt.data.dataset import ParallelData, corpus_ranges, read_meta
from nmt.device import allow_tf32, resolve_device, set_cuda_allocator_default
from nmt.errors import UsageError
from nmt.host_memory import (
    TRAIN_BUCKETED_ONEDNN_CACHE,
    TRAIN_ONEDNN_CACHE,
    keep_freed_memory,
    size_onednn_cache,
)
from nmt.model.transformer import Transformer
from nmt.precision import grad_scaler, resolve_precision
from nmt.train.distributed import DistEnv, init_distributed
from nmt.train.half import HalfWeights, use_half_weights
from nmt.train.linears import Linear, choice, training_linear, use
from nmt.train.log import (
    JsonlLog,
    PlainReporter,
    RecordLog,
    RunLog,
    TrainReporter,
    warner,
)
from nmt.train.sampling import EpochBatches
from nmt.train.schedule import Schedule, build_optimizer, build_schedule
from nmt.train.tensorboard import TeeLog, TensorBoardLog


def join(device: str, precision: str = "auto") -> tuple[DistEnv, torch.device]:
    """Join the process group (under torchrun) and pick this process's device, set up for
    training: CUDA's allocator before its first allocation; on a CPU, a bounded oneDNN
    kernel cache (one kernel per batch shape; larger where rows come in steps,
    nmt/train/linears.py, and shapes recur) and freed memory kept for reuse.
    `precision` is the setting (auto too): the cache is sized before anything, the
    measurement behind `auto` included, runs a oneDNN kernel."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        set_cuda_allocator_default()
    env = init_distributed("cuda" if cuda else "cpu")
    dev = resolve_device(device, env.local_rank)
    if dev.type == "cpu":
        bucketed = buckets_rows(dev, "bf16" if precision == "auto" else precision)
        size_onednn_cache(TRAIN_BUCKETED_ONEDNN_CACHE if bucketed else TRAIN_ONEDNN_CACHE)
        keep_freed_memory()
    return env, dev


def checked_model_config(model_cfg: ModelConfig, cfg: TrainConfig, vocab_size: int
                         ) -> ModelConfig:
    """The model config with the data's vocabulary size; --max-len and --max-tokens
    checked against it (UsageError)."""
    if model_cfg.vocab_size != vocab_size:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    if cfg.max_len > model_cfg.max_positions:
        raise UsageError(f"--max-len {cfg.max_len} exceeds --max-positions "
                         f"{model_cfg.max_positions}; lower one or raise the other")
    if 0 < cfg.max_tokens < cfg.max_len:
        raise UsageError(f"--max-tokens {cfg.max_tokens} is below --max-len "
                         f"{cfg.max_len}: long pairs would never fit a batch")
    return model_cfg


def open_valid(data_dir: Path) -> ParallelData | None:
    """The valid split; None when none was binarized (validation is then skipped, as the
    start says). One that is there but unreadable is a DataError, not skipped."""
    if "valid" not in read_meta(data_dir)["splits"]:
        return None
    return ParallelData.open(data_dir, "valid")


def epoch_batches(data_dir: Path, data: ParallelData, micro_tokens: int, cfg: TrainConfig,
                  world_size: int, epoch: int) -> EpochBatches:
    """Each epoch's batch list (shuffled per epoch by `epoch_order`): one fixed list, or a
    per-epoch draw when the data's corpora carry sampling weights. Every process needs a
    batch of `epoch`, the one training starts in (UsageError)."""
    batches = EpochBatches(data.src.lengths, data.tgt.lengths, corpus_ranges(data_dir),
                           micro_tokens, cfg.max_len, cfg.seed)
    count = len(batches.get(epoch).batches)
    if count < world_size:
        raise UsageError(f"{data_dir}: only {count} training batches "
                         f"for {world_size} processes; lower --max-tokens")
    return batches


@dataclass
class Model:
    """The network and what updates it."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler
    precision: str  # resolved: fp32, bf16 or fp16
    linear: Linear | None  # what its linear layers compute with (nmt/train/linears.py)
    half: HalfWeights | None  # the bf16 copy that computes, `model` its master (or None)

    @property
    def compute(self) -> Transformer:
        """The network the micro-batches run on."""
        return self.model if self.half is None else self.half.model


def buckets_rows(device: torch.device, precision: str) -> bool:
    """Whether training on `device` in `precision` rounds its linear layers' rows up, so that
    oneDNN's kernels come in a few shapes (the table's `torch-rows64`, nmt/train/linears.py).
    `join` asks before `auto` is resolved, as bf16: what `auto` is where rows are bucketed."""
    return choice(device, precision) == "torch-rows64"


def build_model(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, rank: int
                ) -> Model:
    """The same initial weights on every rank (seeded by --seed), then each rank's own
    dropout stream; Adam, the schedule, the precision `auto` resolves to, the scaler, and
    the linear layers' function where the table picks another than PyTorch's (the output
    projection's is the training step's: `LossOptions.project`); with --half-weights, the
    bf16 copy that computes (nmt/train/half.py), whose linears on CUDA run `rows_linear`."""
    seed_everything(cfg.seed)
    model = Transformer(model_cfg).to(device)
    seed_everything(cfg.seed + rank)
    optimizer = build_optimizer(model.parameters(), cfg, device)
    precision = resolve_precision(cfg.precision, device)
    if precision == "fp32":
        allow_tf32(device)
    linear = training_linear(device, precision)
    if linear is not None:
        use(model, linear)
    half = None
    if use_half_weights(cfg.half_weights, device, precision):
        half = HalfWeights(model, pad_vocab=True, rows_linears=device.type == "cuda")
    return Model(model, optimizer, build_schedule(optimizer, model_cfg.d_model, cfg),
                 grad_scaler(device, enabled=precision == "fp16"), precision, linear, half)


def seed_everything(seed: int) -> None:
    """torch's, Python's and numpy's global generators."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


def open_logs(run_dir: Path, step: int, progress: bool | TrainReporter,
              tensorboard: Path | None, settings: dict[str, Any]) -> RunLog:
    """Rank 0's log (RUN/train_log.jsonl, and TensorBoard events in `tensorboard` with
    `settings` as text) and progress reporter (True: plain lines; False: none). A resumed
    run (`step` > 0) drops the records of updates it will redo, so each is logged once.
    The logs warn through the reporter, never through a method of the trainer: such a
    reference cycle kept the memory-mapped data open after the run returned."""
    reporter = (PlainReporter() if progress is True else None if progress is False
                else progress)
    warn = warner(reporter)
    run_dir.mkdir(parents=True, exist_ok=True)
    log: RecordLog = JsonlLog(run_dir / "train_log.jsonl", resume_step=step, warn=warn)
    if tensorboard is not None:
        log = TeeLog(log, TensorBoardLog(tensorboard, settings, resume_step=step, warn=warn))
    return RunLog(log, reporter)
