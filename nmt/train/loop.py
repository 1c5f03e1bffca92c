"""The training loop behind `nmt train`: batches -> Transformer -> checkpoints.

One update = `update_freq` micro-batches per process, every process (rank) on its own shard
of the epoch's shuffled batch list. The loss of an update is the sum of token losses over
all its micro-batches and ranks divided by the number of target tokens in all of them
(computed on the host from the length arrays, so it needs no communication); DDP averages
gradients over ranks, so each rank scales its loss by world_size / tokens. Two ranks with
max-tokens T therefore make the same update as one process with update-freq 2.

Host synchronisation: one per update, after the gradients are complete: the loss sum, NLL
sum, gradient norm and rank 0's save/stop decisions travel in one small tensor (all-reduced
across ranks when distributed) and are read with a single `.tolist()`. The finiteness
check (loss and gradient norm) uses those numbers, so a NaN/inf never reaches the weights:
the optimizer step is skipped (fp16: GradScaler skips it and lowers the scale) and counted.
`encode()` gets `has_pad` from the host-side lengths, so the model adds no sync either.

Hot path (measured in bench/train_throughput.py): only the non-PAD target positions are
projected to the vocabulary (indices from the host-side lengths), the smoothed loss is one
fused autograd function (nmt/train/loss.py), Adam is foreach on CPU (fused on CUDA), and
on CPU glibc malloc keeps freed pages and oneDNN's primitive cache is capped
(nmt/host_memory.py). Threads: torch's default
(one per physical core); torchrun sets OMP_NUM_THREADS=1 per process itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from nmt.checkpoint import load_checkpoint
from nmt.config import ModelConfig, TrainConfig
from nmt.data.batching import Batch, batch_by_tokens, collate, epoch_order, shard
from nmt.data.dataset import ParallelData, load_vocab
from nmt.errors import CheckpointError, TrainingAborted, UsageError
from nmt.host_memory import keep_freed_memory, limit_onednn_cache
from nmt.model import Transformer
from nmt.precision import autocast, resolve_precision
from nmt.train.distributed import DistEnv, gather_objects, init_distributed, shutdown
from nmt.train.log import JsonlLog, ProgressReporter, warn_line
from nmt.train.loss import label_smoothed_nll, target_positions
from nmt.train.schedule import InverseSqrtSchedule, build_optimizer
from nmt.train.state import (
    LAST,
    DataState,
    build_payload,
    capture_rng,
    restore_training,
    write_checkpoint,
)
from nmt.train.validate import validate


@dataclass
class TrainSummary:
    """What a finished (or stopped) run reached."""

    step: int
    epoch: int
    resumed_from: int
    last_checkpoint: Path | None
    update_freq: int
    skipped_pairs: int
    skipped_updates: int
    losses: list[float] = field(default_factory=list)  # per-update train loss (nats/token)
    valid: dict[str, float] = field(default_factory=dict)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto -> cuda when available else cpu; cuda uses this process's local rank."""
    if name not in ("auto", "cpu", "cuda"):
        raise UsageError(f"unknown device {name!r}; choose one of: auto, cpu, cuda")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda asked for but no CUDA device is visible; "
                             "use --device cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def derive_update_freq(cfg: TrainConfig, world_size: int) -> int:
    """--batch-tokens B gives ceil(B / (world_size x max_tokens)); else --update-freq."""
    if cfg.batch_tokens:
        return max(1, math.ceil(cfg.batch_tokens / (world_size * cfg.max_tokens)))
    return cfg.update_freq


def _check_resume(payload: dict[str, Any], model_cfg: ModelConfig, path: Path) -> None:
    if payload.get("model_config") != model_cfg.to_dict():
        raise CheckpointError(f"{path}: holds a run with a different model config; "
                              "use the same flags to resume, or another -o directory")


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


@dataclass
class _Window:
    """Running sums between two log lines."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0  # target tokens (loss normaliser)
    src_tgt_tokens: int = 0  # non-padding source + target tokens (throughput)
    updates: int = 0
    start: float = field(default_factory=time.perf_counter)


class Trainer:
    """Holds the model, optimiser and data of one run; `run()` trains to the limits."""

    def __init__(self, data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                 train_cfg: TrainConfig, device: str = "auto",
                 meta: dict[str, Any] | None = None, progress: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.run_dir = Path(run_dir)
        self.cfg = train_cfg
        dev_type = "cuda" if device == "cuda" or (
            device == "auto" and torch.cuda.is_available()) else "cpu"
        self.env: DistEnv = init_distributed(dev_type)
        self.device = resolve_device(device, self.env.local_rank)
        if self.device.type == "cpu":
            limit_onednn_cache()  # one primitive per batch shape: bounded, not 1024 of them
            keep_freed_memory()  # big per-step tensors reuse pages instead of re-faulting
        self.vocab = load_vocab(self.data_dir)
        if model_cfg.vocab_size != len(self.vocab):
            model_cfg = dataclasses.replace(model_cfg, vocab_size=len(self.vocab))
        if train_cfg.max_len > model_cfg.max_positions:
            raise UsageError(f"--max-len {train_cfg.max_len} exceeds --max-positions "
                             f"{model_cfg.max_positions}; lower one or raise the other")
        if train_cfg.max_tokens < train_cfg.max_len:
            raise UsageError(f"--max-tokens {train_cfg.max_tokens} is below --max-len "
                             f"{train_cfg.max_len}: long pairs would never fit a batch")
        self.model_cfg = model_cfg
        self.train_data = ParallelData.open(self.data_dir, "train")
        self.valid_data = self._open_valid()
        self.update_freq = derive_update_freq(train_cfg, self.env.world_size)

        _seed_everything(train_cfg.seed)  # same initial weights on every rank
        self.model = Transformer(model_cfg).to(self.device)
        _seed_everything(train_cfg.seed + self.env.rank)  # own dropout stream per rank
        self.optimizer = build_optimizer(self.model.parameters(), train_cfg, self.device)
        self.schedule = InverseSqrtSchedule(self.optimizer, model_cfg.d_model,
                                            train_cfg.warmup, train_cfg.lr_scale)
        # `auto` becomes bf16/fp16/fp32 for this device (logged at start).
        self.precision = resolve_precision(train_cfg.precision, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.precision == "fp16")
        self.step = 0
        self.data_state = DataState()
        self.elapsed_before = 0.0
        self.resumed_from = 0
        self.meta = {"src_lang": "", "tgt_lang": "", "data_dir": str(self.data_dir.resolve()),
                     **(meta or {})}
        last = self.run_dir / LAST
        if last.is_file():
            payload = load_checkpoint(last, map_location=self.device)
            _check_resume(payload, model_cfg, last)
            self.data_state = restore_training(
                payload, model=self.model, optimizer=self.optimizer, scheduler=self.schedule,
                scaler=self.scaler, rank=self.env.rank, world_size=self.env.world_size)
            self.step = self.resumed_from = int(payload["step"])
            self.elapsed_before = float(payload.get("elapsed_seconds", 0.0))
        self.net: torch.nn.Module = self.model
        if self.env.active:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids)

        batches = batch_by_tokens(self.train_data.src.lengths, self.train_data.tgt.lengths,
                                  train_cfg.max_tokens, train_cfg.max_len)
        if len(batches.batches) < self.env.world_size:
            raise UsageError(f"{self.data_dir}: only {len(batches.batches)} training batches "
                             f"for {self.env.world_size} processes; lower --max-tokens")
        self.batches = batches
        self.src_cost = self.train_data.src.lengths + 1  # non-padding tokens incl. EOS
        self.tgt_cost = self.train_data.tgt.lengths + 1
        self.log: JsonlLog | None = None
        self.progress: ProgressReporter | None = None
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # A resumed run drops the records of updates it will redo (logged once each).
            self.log = JsonlLog(self.run_dir / "train_log.jsonl", resume_step=self.step,
                                warn=self._warn)
            if progress:
                self.progress = ProgressReporter(train_cfg.max_updates, self.step)

    def _open_valid(self) -> ParallelData | None:
        try:
            return ParallelData.open(self.data_dir, "valid")
        except Exception:  # no valid split binarized: validation is skipped (said at start)
            return None

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)

    def _warn(self, text: str) -> None:
        """A warning on stderr, through the progress bar when there is one."""
        if self.progress is not None:
            self.progress.message(f"warning: {text}")
        else:
            warn_line(text)

    # ----- data -----

    def _updates(self) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
        """(this rank's micro-batches, all ranks' batches) of each update, from the saved
        position on; advances `data_state` as it goes."""
        world, rank, k = self.env.world_size, self.env.rank, self.update_freq
        n_batches = len(self.batches.batches)
        while not self.cfg.max_epochs or self.data_state.epoch <= self.cfg.max_epochs:
            order = epoch_order(n_batches, self.cfg.seed, self.data_state.epoch, world)
            mine = shard(order, rank, world)
            pos = self.data_state.index // world
            while pos < len(mine):
                group = mine[pos:pos + k]
                global_ids = order[pos * world:(pos + len(group)) * world]
                pos += len(group)
                self.data_state.index = pos * world
                yield ([self.batches.batches[i] for i in group],
                       [self.batches.batches[i] for i in global_ids])
            self.data_state = DataState(self.data_state.epoch + 1, 0)

    def _collate(self, indices: np.ndarray) -> tuple[Batch, bool]:
        src = [self.train_data.src[i] for i in indices]
        tgt = [self.train_data.tgt[i] for i in indices]
        lens = self.src_cost[indices]
        batch = collate(src, tgt)
        if self.device.type == "cuda":
            batch.src, batch.tgt_in, batch.tgt_out = (t.pin_memory() for t in (
                batch.src, batch.tgt_in, batch.tgt_out))
        return batch.to(self.device), bool(lens.min() != lens.max())

    def _real_targets(self, batch: Batch, indices: np.ndarray) -> tuple[torch.Tensor | None,
                                                                          torch.Tensor]:
        """(flat indices of the non-PAD target positions or None, their gold ids): the
        model projects only those rows, so padding costs nothing in the output projection
        and the loss. Built from host-side lengths: no device sync."""
        width = batch.tgt_out.size(1)
        rows = target_positions(self.tgt_cost[indices], width)
        if rows is None:
            return None, batch.tgt_out
        select = torch.from_numpy(rows).to(self.device, non_blocking=True)  # (n_real,)
        return select, batch.tgt_out.reshape(-1).index_select(0, select)  # (n_real,)

    # ----- one update -----

    def _train_update(self, micro: list[np.ndarray], all_batches: list[np.ndarray],
                      flags: list[float]) -> tuple[float, float, float, list[float], int, int]:
        """Forward/backward over the micro-batches, then one synced check and maybe a step.

        Returns (loss sum, nll sum, grad norm, rank-0 flags, target tokens, src+tgt tokens),
        all global over ranks.
        """
        all_ids = np.concatenate(all_batches)
        tgt_tokens = int(self.tgt_cost[all_ids].sum())
        src_tgt_tokens = tgt_tokens + int(self.src_cost[all_ids].sum())
        scale = self.env.world_size / tgt_tokens
        loss_sum = torch.zeros((), device=self.device)
        nll_sum = torch.zeros((), device=self.device)
        self.net.train()
        for i, indices in enumerate(micro):
            batch, has_pad = self._collate(indices)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or not self.env.active else self.net.no_sync()
            with sync:
                select, target = self._real_targets(batch, indices)
                with autocast(self.device, self.precision):
                    logits = self.net(batch.src, batch.tgt_in, has_pad=has_pad, select=select)
                    loss, nll = label_smoothed_nll(logits, target, self.cfg.label_smoothing,
                                                   self.model_cfg.pad_id)
                self.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
            nll_sum += nll
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.clip_norm > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip_norm)
        else:
            gnorm = torch.nn.utils.get_total_norm([p.grad for p in params])
        stats = torch.stack([loss_sum, nll_sum,
                             *(torch.tensor(f, device=self.device) for f in flags)])
        if self.env.active:  # flags are non-zero on rank 0 only: the sum is rank 0's value
            torch.distributed.all_reduce(stats)
        values = torch.cat([stats, gnorm.float().reshape(1).to(self.device)]).tolist()  # sync
        return (values[0], values[1], values[-1], values[2:-1], tgt_tokens, src_tgt_tokens)

    def _apply_update(self, finite: bool) -> None:
        if self.precision == "fp16":
            self.scaler.step(self.optimizer)  # skips by itself when grads overflowed
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if finite:
            self.schedule.step()

    # ----- checkpoints -----

    def _save(self, elapsed: float) -> Path | None:
        rngs = gather_objects(self.env, capture_rng())  # collective: every rank calls it
        if not self.env.is_main:
            return None
        payload = build_payload(
            model=self.model, optimizer=self.optimizer, scheduler=self.schedule,
            scaler=self.scaler, step=self.step, data_state=self.data_state, rng=rngs,
            model_config=self.model_cfg.to_dict(), train_config=self.cfg.to_dict(),
            vocab=self.vocab.proto, meta=self.meta, elapsed_seconds=elapsed)
        path = write_checkpoint(payload, self.run_dir, self.cfg.keep_last)
        self._say(f"saved {path} (update {self.step})")
        return path

    # ----- main loop -----

    def run(self) -> TrainSummary:
        """Train until max-updates / max-epochs / max-minutes (all totals); save at the end."""
        cfg = self.cfg
        start = time.perf_counter()
        last_save = start
        summary = TrainSummary(self.step, self.data_state.epoch, self.resumed_from, None,
                               self.update_freq, self.batches.skipped, 0)

        def elapsed() -> float:
            return self.elapsed_before + time.perf_counter() - start

        self._say(f"{len(self.train_data)} training pairs in {len(self.batches.batches)} "
                  f"batches ({self.batches.skipped} longer than --max-len {cfg.max_len} "
                  f"skipped); {self.env.world_size} process(es) x max-tokens {cfg.max_tokens} "
                  f"x update-freq {self.update_freq}"
                  + (f" (derived from --batch-tokens {cfg.batch_tokens})"
                     if cfg.batch_tokens else "")
                  + f"; precision {self.precision} on {self.device.type}"
                  + (f"; resuming from update {self.step}" if self.step else ""))
        if self.valid_data is None:
            self._say("no binarized valid split: validation is skipped")
        window = _Window()
        streak = 0
        saved_step = self.step
        try:
            updates = self._updates()
            while self.step < cfg.max_updates:
                nxt = next(updates, None)  # pulled only when an update will run
                if nxt is None:
                    break  # --max-epochs reached
                micro, all_batches = nxt
                now = time.perf_counter()
                want_save = (cfg.save_interval_minutes > 0
                             and now - last_save >= cfg.save_interval_minutes * 60)
                want_stop = cfg.max_minutes > 0 and elapsed() >= cfg.max_minutes * 60
                flags = [float(want_save), float(want_stop)] if self.env.is_main else [0., 0.]
                loss, nll, gnorm, (save_flag, stop_flag), tokens, st_tokens = \
                    self._train_update(micro, all_batches, flags)
                finite = math.isfinite(loss) and math.isfinite(gnorm)
                lr = self.schedule.lr
                self._apply_update(finite)
                if finite:
                    self.step += 1
                    streak = 0
                    summary.losses.append(loss / tokens)
                    window.loss += loss
                    window.nll += nll
                    window.tokens += tokens
                else:
                    streak += 1
                    summary.skipped_updates += 1
                    self._say(f"update {self.step + 1}: non-finite loss or gradient; "
                              f"step skipped ({summary.skipped_updates} so far)")
                    if streak >= cfg.max_nonfinite_in_a_row:
                        raise TrainingAborted(
                            f"{streak} updates in a row had a non-finite loss or gradient; "
                            f"stopped at update {self.step} (last checkpoint intact); lower "
                            "--lr-scale, use --clip-norm or --precision bf16/fp32")
                window.src_tgt_tokens += st_tokens
                window.updates += 1
                if finite and (self.step % cfg.log_interval == 0):
                    self._log_train(window, lr, gnorm, elapsed(), summary)
                    window = _Window()
                if finite and self.step % cfg.valid_interval == 0:
                    summary.valid = self._validate(elapsed())
                if (save_flag or (cfg.save_interval_updates
                                  and finite and self.step % cfg.save_interval_updates == 0)):
                    summary.last_checkpoint = self._save(elapsed()) or summary.last_checkpoint
                    saved_step = self.step
                    last_save = time.perf_counter()
                if stop_flag:
                    break
            if self.step != saved_step or self.step == 0 or not (self.run_dir / LAST).exists():
                summary.last_checkpoint = self._save(elapsed()) or summary.last_checkpoint
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.log is not None:
                self.log.close()
            shutdown(self.env)
        summary.step, summary.epoch = self.step, self.data_state.epoch
        return summary

    def _log_train(self, window: _Window, lr: float, gnorm: float, elapsed: float,
                   summary: TrainSummary) -> None:
        if not self.env.is_main or window.tokens == 0:
            return
        seconds = max(time.perf_counter() - window.start, 1e-9)
        nll = window.nll / window.tokens
        record = {
            "kind": "train", "step": self.step, "epoch": self.data_state.epoch,
            "loss": window.loss / window.tokens, "nll": nll, "ppl": math.exp(min(nll, 50.0)),
            "lr": lr, "grad_norm": gnorm, "tokens_per_s": window.src_tgt_tokens / seconds,
            "target_tokens": window.tokens, "updates": window.updates,
            "update_freq": self.update_freq, "world_size": self.env.world_size,
            "skipped_updates": summary.skipped_updates, "skipped_pairs": self.batches.skipped,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
            "wall_time": time.time(), "elapsed_minutes": elapsed / 60,
        }
        assert self.log is not None
        self.log.write(record)
        if self.progress is not None:
            self.progress.update(record)

    def _validate(self, elapsed: float) -> dict[str, float]:
        if self.valid_data is None:
            return {}
        metrics = validate(self.model, self.valid_data, self.vocab, self.cfg, self.device,
                           self.env, bleu=self.cfg.valid_bleu, data_dir=self.data_dir)
        if self.env.is_main:
            assert self.log is not None
            self.log.write({"kind": "valid", "step": self.step, "epoch": self.data_state.epoch,
                            **{f"valid_{k}": v for k, v in metrics.items()},
                            "wall_time": time.time(), "elapsed_minutes": elapsed / 60})
            text = " | ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            self._say(f"valid at update {self.step}: {text}")
        return metrics


def train(data_dir: Path, run_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig,
          device: str = "auto", meta: dict[str, Any] | None = None,
          progress: bool = True) -> TrainSummary:
    """Train (or resume, if RUN/checkpoint_last.pt exists) and return where it stopped."""
    return Trainer(data_dir, run_dir, model_cfg, train_cfg, device, meta, progress).run()
