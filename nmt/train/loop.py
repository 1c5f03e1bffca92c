"""The training loop behind `nmt train`: batches -> Transformer -> checkpoints.

One update = `update_freq` micro-batches per process, every process (rank) on its own shard
of the epoch's shuffled batch list. The loss of an update is the sum of token losses over
all its micro-batches and ranks divided by the number of target tokens in all of them
(computed on the host from the length arrays, so it needs no communication); DDP averages
gradients over ranks, so each rank scales its loss by world_size / tokens. Two ranks with
max-tokens T therefore make the same update as one process with update-freq 2.

Host synchronisation: one per update, after the gradients are complete: the loss sum, NLL
sum and gradient norm (plus, when distributed, rank 0's save/stop decisions, all-reduced
from a reused pinned buffer) travel in one small tensor read with a single `.tolist()`.
On CUDA the next update's micro-batches are collated, pinned and copied on a background
thread meanwhile (nmt/train/prefetch.py). The finiteness
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
import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from nmt.checkpoint import (
    BEST,
    load_checkpoint,
    model_payload,
    model_state,
    save_checkpoint,
)
from nmt.config import ModelConfig, TrainConfig
from nmt.data.dataset import ParallelData, corpus_ranges, language_pair, load_vocab
from nmt.device import allow_tf32, resolve_device, set_cuda_allocator_default
from nmt.errors import (
    CheckpointError,
    DistributedError,
    NmtError,
    Preempted,
    TrainingAborted,
    UsageError,
)
from nmt.host_memory import keep_freed_memory, limit_onednn_cache
from nmt.model.transformer import Transformer
from nmt.precision import emulation_note, grad_scaler, resolve_precision
from nmt.train.best import BestTracker
from nmt.train.distributed import (
    DistEnv,
    broadcast_object,
    gather_objects,
    init_distributed,
    shutdown,
)
from nmt.train.ema import WeightAverage
from nmt.train.feed import Micro, TrainFeed, Update
from nmt.train.init_from import check_init_from
from nmt.train.log import JsonlLog, PlainReporter, TrainReporter, warn_line
from nmt.train.preempt import PreemptionWatch
from nmt.train.prefetch import Prefetcher
from nmt.train.sampling import EpochBatches
from nmt.train.schedule import build_optimizer, build_schedule
from nmt.train.state import (
    LAST,
    DataState,
    build_payload,
    capture_rng,
    restore_training,
    write_checkpoint,
    write_resume_point,
)
from nmt.train.step import LossOptions, apply_update, train_step
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
    stopped_early: bool = False  # --patience ran out
    valid: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Batching:
    """Micro-batches per process per update, and padded tokens per micro-batch."""

    update_freq: int
    micro_tokens: int


def derive_batching(cfg: TrainConfig, world_size: int) -> Batching:
    """--batch-tokens B: update_freq = ceil(B / (world_size x max_tokens)) micro-batches per
    process, each of ceil(B / (world_size x update_freq)) tokens (at most --max-tokens, at
    least --max-len), so one update holds about B tokens on any number of processes: with
    B = 25000 and max-tokens 12000, one GPU runs 3 x 8334 and eight GPUs 1 x 3125 each (not
    8 x 12000). --max-tokens is the memory cap; B is the paper's batch. Without B:
    --update-freq and --max-tokens as given."""
    if not cfg.batch_tokens:
        return Batching(cfg.update_freq, cfg.max_tokens)
    freq = max(1, math.ceil(cfg.batch_tokens / (world_size * cfg.max_tokens)))
    micro = math.ceil(cfg.batch_tokens / (world_size * freq))
    return Batching(freq, min(cfg.max_tokens, max(micro, cfg.max_len)))


def _check_resume(payload: dict[str, Any], model_cfg: ModelConfig, path: Path) -> None:
    if payload.get("model_config") != model_cfg.to_dict():
        raise CheckpointError(f"{path}: holds a run with a different model config; "
                              "use the same flags to resume, or another -o directory")


def _read_resume_point(path: Path, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, None) when `path` holds update `step`, else (None, what is wrong)."""
    try:
        payload = load_checkpoint(path, map_location="cpu", mmap=True)
    except NmtError as err:
        return None, str(err)
    if payload.get("step") != step:
        return None, f"it holds update {payload.get('step')} there"
    return payload, None


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


@dataclass
class _Run:
    """What one `Trainer.run` keeps between updates."""

    summary: TrainSummary
    elapsed_before: float  # seconds of the run before this process (resumed runs)
    saved_step: int  # update of the newest numbered checkpoint this process knows of
    start: float = field(default_factory=time.perf_counter)
    last_save: float = field(default_factory=time.perf_counter)
    streak: int = 0  # non-finite updates in a row
    window: _Window = field(default_factory=lambda: _Window())
    watch: PreemptionWatch = field(default_factory=PreemptionWatch)
    preempted: bool = False  # some rank got SIGTERM/SIGUSR1: saved, stopping

    def elapsed(self) -> float:
        """Training seconds in all, this process's included."""
        return self.elapsed_before + time.perf_counter() - self.start


@dataclass
class _Window:
    """Running sums between two log lines."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0  # target tokens (loss normaliser)
    src_tgt_tokens: int = 0  # non-padding source + target tokens (throughput)
    update_tgt_tokens: int = 0  # non-padding target tokens of every update, skipped ones too
    updates: int = 0
    start: float = field(default_factory=time.perf_counter)


class Trainer:
    """Holds the model, optimiser and data of one run; `run()` trains to the limits."""

    def __init__(self, data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                 train_cfg: TrainConfig, device: str = "auto",
                 meta: dict[str, Any] | None = None,
                 progress: bool | TrainReporter = True,
                 init_from: Path | None = None, reset_optimizer: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.run_dir = Path(run_dir)
        self.cfg = train_cfg
        self.env, self.device = self._join(device)
        try:  # a rank that fails here leaves the process group, or gloo aborts at exit
            self._set_up(data_dir, run_dir, model_cfg, train_cfg, meta, progress, init_from,
                         reset_optimizer)
        except BaseException:
            shutdown(self.env)
            raise

    def _set_up(self, data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                train_cfg: TrainConfig, meta: dict[str, Any] | None,
                progress: bool | TrainReporter, init_from: Path | None,
                reset_optimizer: bool) -> None:
        """Data, model, optimiser, resume point and logs of the run (after joining)."""
        self.vocab = load_vocab(self.data_dir)
        self.model_cfg = self._checked_model_config(model_cfg)
        self.train_data = ParallelData.open(self.data_dir, "train")
        self.valid_data = self._open_valid()
        self.batching = derive_batching(train_cfg, self.env.world_size)
        self.update_freq = self.batching.update_freq
        self._build_model()
        self._check_ranks_agree()
        self.ema = WeightAverage(self.model, train_cfg.ema_decay) if train_cfg.ema_decay \
            else None
        self.best = BestTracker(train_cfg.best_metric, train_cfg.patience)
        self.notes: list[str] = []  # said once training starts (after the progress bar)
        self._flag_buffer: torch.Tensor | None = None
        # Prepare the next update's batches on a thread while the GPU computes (CUDA only).
        self.prefetch = self.device.type == "cuda"
        # Output projection + loss chunked over rows, never the whole (rows, vocab) logits
        # (CUDA only: on a CPU the recomputed logits cost 1.3x at base shapes; see loss.py).
        self.fused_loss = self.device.type == "cuda"
        self.loss_options = LossOptions(train_cfg.label_smoothing, self.model_cfg.pad_id,
                                        fused=self.fused_loss)
        self.step = 0
        self.data_state = DataState()
        self.elapsed_before = 0.0
        self.resumed_from = 0
        src_lang, tgt_lang = language_pair(self.data_dir)  # from nmt prep's manifest
        self.meta = {"src_lang": src_lang, "tgt_lang": tgt_lang,
                     "data_dir": str(self.data_dir.resolve()), **(meta or {})}
        self._resume()
        self.initialised_from: Path | None = None
        if init_from is not None and self.resumed_from == 0:
            self._init_from(Path(init_from), reset_optimizer)
        self.net: torch.nn.Module = self.model
        if self.env.active:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # The only buffers are the fixed sinusoid tables (and cached masks): nothing to
            # broadcast every forward. Gradients live in DDP's buckets (no second copy).
            self.net = DistributedDataParallel(self.model, device_ids=ids,
                                               broadcast_buffers=False,
                                               gradient_as_bucket_view=True)
        self.corpora = corpus_ranges(self.data_dir)
        self.epoch_batches = self._build_batches()
        self.feed = TrainFeed(self.train_data, self.epoch_batches, self.env, self.update_freq,
                              train_cfg.seed, train_cfg.max_epochs, self.device)
        self.log: JsonlLog | None = None
        self.progress: TrainReporter | None = None
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # A resumed run drops the records of updates it will redo (logged once each).
            self.log = JsonlLog(self.run_dir / "train_log.jsonl", resume_step=self.step,
                                warn=self._warn)
            if progress is True:
                self.progress = PlainReporter()
            elif progress is not False:
                self.progress = progress

    def _join(self, device: str) -> tuple[DistEnv, torch.device]:
        """Join the process group (under torchrun) and pick this process's device."""
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if cuda:
            set_cuda_allocator_default()  # before the first CUDA allocation
        env = init_distributed("cuda" if cuda else "cpu")
        dev = resolve_device(device, env.local_rank)
        if dev.type == "cpu":
            limit_onednn_cache()  # one primitive per batch shape: bounded, not 1024 of them
            keep_freed_memory()  # big per-step tensors reuse pages instead of re-faulting
        return env, dev

    def _checked_model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        """The model config with the data's vocabulary size; limits checked against it."""
        if model_cfg.vocab_size != len(self.vocab):
            model_cfg = dataclasses.replace(model_cfg, vocab_size=len(self.vocab))
        cfg = self.cfg
        if cfg.max_len > model_cfg.max_positions:
            raise UsageError(f"--max-len {cfg.max_len} exceeds --max-positions "
                             f"{model_cfg.max_positions}; lower one or raise the other")
        if cfg.max_tokens < cfg.max_len:
            raise UsageError(f"--max-tokens {cfg.max_tokens} is below --max-len "
                             f"{cfg.max_len}: long pairs would never fit a batch")
        return model_cfg

    def _build_model(self) -> None:
        """Model (same initial weights on every rank), Adam, schedule, precision, scaler."""
        cfg = self.cfg
        _seed_everything(cfg.seed)  # same initial weights on every rank
        self.model = Transformer(self.model_cfg).to(self.device)
        _seed_everything(cfg.seed + self.env.rank)  # own dropout stream per rank
        self.optimizer = build_optimizer(self.model.parameters(), cfg, self.device)
        self.schedule = build_schedule(self.optimizer, self.model_cfg.d_model, cfg)
        # `auto` becomes bf16/fp16/fp32 for this device (logged at start).
        self.precision = resolve_precision(cfg.precision, self.device)
        # An explicit bf16/fp16 on a CPU that emulates it: named with its measured cost.
        self.precision_note = emulation_note(self.precision, self.device, training=True) \
            if self.env.is_main else None
        if self.precision == "fp32":
            allow_tf32(self.device)
        self.scaler = grad_scaler(self.device, enabled=self.precision == "fp16")

    def _fingerprint(self) -> dict[str, Any]:
        """What every rank must see alike: resolved settings and precision, data sizes,
        vocabulary. Another DATA, recipe, flag or GPU type on one node would otherwise take
        a different sequence of collectives (a hang until the timeout) or mix fp16 and
        bf16 gradients silently."""

        def sizes(data: ParallelData | None) -> list[int] | None:
            if data is None:
                return None
            return [len(data), int(data.src.lengths.sum()), int(data.tgt.lengths.sum())]

        return {
            "model config": self.model_cfg.to_dict(), "settings": self.cfg.to_dict(),
            "precision": self.precision, "device type": self.device.type,
            "train split (pairs, source tokens, target tokens)": sizes(self.train_data),
            "valid split (pairs, source tokens, target tokens)": sizes(self.valid_data),
            "vocabulary sha256": hashlib.sha256(self.vocab.proto).hexdigest(),
        }

    def _check_ranks_agree(self) -> None:
        """Compare every rank's fingerprint with rank 0's; the first difference stops every
        rank at once with one line naming the rank and what differs (exit 8)."""
        prints = gather_objects(self.env, self._fingerprint())
        for rank, other in enumerate(prints[1:], start=1):
            for key, value in other.items():
                mine = prints[0][key]
                if value == mine:
                    continue
                if isinstance(value, dict) and isinstance(mine, dict):
                    field_ = next(k for k in sorted(set(value) | set(mine))
                                  if value.get(k) != mine.get(k))
                    key, value, mine = f"{key}: {field_}", value.get(field_), mine.get(field_)
                raise DistributedError(
                    f"rank {rank} differs from rank 0 in its {key} ({value!r} vs {mine!r}); "
                    "every rank must see the same DATA, recipe, flags and GPU type")

    def _resume(self) -> None:
        """Continue from RUN/checkpoint_last.pt if rank 0 has one; every rank follows.

        Rank 0 alone decides from its disk and broadcasts the update it resumes from and the
        file that holds it: the immutable RUN/checkpoint_N.pt where there is one (another
        node re-opening checkpoint_last.pt could be shown the previous file by NFS's
        attribute cache), else checkpoint_last.pt (a resume point alone). Each rank then
        loads that file onto the CPU (memory-mapped) and restores its own RNG stream. A rank
        that cannot read it, or finds another update there (a run directory that is not
        shared between nodes), stops every rank with one line (exit 8) instead of training
        from a different state.
        """
        last = self.run_dir / LAST
        payload: dict[str, Any] | None = None
        point = None
        if self.env.is_main and last.is_file():
            payload = load_checkpoint(last, map_location="cpu", mmap=True)
            _check_resume(payload, self.model_cfg, last)
            numbered = self.run_dir / f"checkpoint_{int(payload['step'])}.pt"
            name = LAST if (payload.get("meta") or {}).get("resume_only") \
                or not numbered.is_file() else numbered.name
            point = (int(payload["step"]), name)
        point = broadcast_object(self.env, point)
        if point is None:
            return
        step, name = point
        last = self.run_dir / name
        if not self.env.is_main:
            payload, problem = _read_resume_point(last, step)
        else:
            problem = None
        problems = gather_objects(self.env, problem)
        bad = [rank for rank, text in enumerate(problems) if text]
        if bad:
            raise DistributedError(
                f"rank {bad[0]} cannot resume from {last}, which rank 0 resumes from "
                f"(update {step}): {problems[bad[0]]}; the run directory must be on a file "
                "system every node shares")
        assert payload is not None
        self.data_state = restore_training(
            payload, model=self.model, optimizer=self.optimizer, scheduler=self.schedule,
            scaler=self.scaler, rank=self.env.rank, world_size=self.env.world_size,
            device=self.device)
        self.step = self.resumed_from = step
        saved_by = len(payload["rng"])  # one RNG state per process that saved it
        if saved_by != self.env.world_size:
            self.notes.append(self._world_change_note(saved_by))
        self.elapsed_before = float(payload.get("elapsed_seconds", 0.0))
        if self.ema is not None:
            if payload.get("ema"):
                self.ema.load_state_dict(payload["ema"])
            else:  # EMA switched on for a resumed run: it starts from the current weights
                self.ema = WeightAverage(self.model, self.cfg.ema_decay)
                self.notes.append("--ema-decay: the checkpoint has no EMA; the average "
                                  "starts from its weights")
        if payload.get("best") and not self.best.load_state_dict(payload["best"]):
            self.notes.append(f"--best-metric {self.best.metric}: the checkpoint tracked "
                              f"{payload['best'].get('metric')}; the best score starts anew")

    def _build_batches(self) -> EpochBatches:
        """Each epoch's batch list (shuffled per epoch by `epoch_order`): one fixed list,
        or a per-epoch draw when the data's corpora carry sampling weights."""
        data, cfg = self.train_data, self.cfg
        batches = EpochBatches(data.src.lengths, data.tgt.lengths, self.corpora,
                               self.batching.micro_tokens, cfg.max_len, cfg.seed)
        count = len(batches.get(self.data_state.epoch).batches)
        if count < self.env.world_size:
            raise UsageError(f"{self.data_dir}: only {count} training batches "
                             f"for {self.env.world_size} processes; lower --max-tokens")
        return batches

    def _world_change_note(self, saved_by: int) -> str:
        """What a resume on another number of processes does to the batch."""
        now, cfg = self.env.world_size, self.cfg
        head = f"resumed a run saved by {saved_by} process(es) on {now}: "
        if cfg.batch_tokens:
            return (head + f"--batch-tokens {cfg.batch_tokens} gives update-freq "
                    f"{self.update_freq} x {self.batching.micro_tokens} tokens per process, "
                    "the same batch per update; this epoch's order is reshuffled")
        return (head + f"each update now holds {now} x update-freq {self.update_freq} x "
                f"--max-tokens {self.batching.micro_tokens} tokens, {now}/{saved_by} of "
                "what it held (use --batch-tokens to keep the batch); this epoch's order is "
                "reshuffled")

    def _init_from(self, path: Path, reset_optimizer: bool) -> None:
        """Start this new run from another run's model (`--init-from`): its weights (EMA
        ones where it has them), and, unless reset, its optimizer and schedule state."""
        payload = load_checkpoint(path, map_location="cpu", mmap=True)
        check_init_from(payload, path, self.model_cfg, self.vocab.proto)
        self.model.load_state_dict(model_state(payload, "auto", path))
        continued = not reset_optimizer and all(k in payload for k in ("optimizer",
                                                                        "scheduler"))
        if continued:
            self.optimizer.load_state_dict(payload["optimizer"])
            self.schedule.load_state_dict(payload["scheduler"])
            if payload.get("scaler"):
                self.scaler.load_state_dict(payload["scaler"])
        if self.ema is not None:
            self.ema = WeightAverage(self.model, self.cfg.ema_decay)
        self.initialised_from = path
        how = ("optimizer and schedule continued" if continued else
               "fresh optimizer and schedule" + ("" if reset_optimizer else
                                                 " (the file has none)"))
        self.notes.append(f"initialised from {path} (update {payload['step']}; {how})")

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

    # ----- one update -----

    def _train_update(self, micro: list[Callable[[], Micro]], all_batches: list[np.ndarray],
                      flags: list[float]) -> tuple[float, float, float, list[float], int, int]:
        """`train_step` over the micro-batches, then the update's one host sync.

        Returns (loss sum, nll sum, grad norm, flags summed over ranks, target tokens,
        src+tgt tokens), all global over ranks.
        """
        all_ids = np.concatenate(all_batches)
        tgt_tokens = int(self.feed.tgt_cost[all_ids].sum())
        src_tgt_tokens = tgt_tokens + int(self.feed.src_cost[all_ids].sum())
        step = train_step(self.net, self.model, micro, tgt_tokens=tgt_tokens,
                          optimizer=self.optimizer, scaler=self.scaler,
                          precision=self.precision, loss=self.loss_options,
                          world_size=self.env.world_size, clip_norm=self.cfg.clip_norm)
        stats = torch.stack([step.loss_sum, step.nll_sum])
        if self.env.active:  # summed over ranks: a flag any rank raised is raised for all
            stats = torch.cat([stats, self._flags_on_device(flags)])
            torch.distributed.all_reduce(stats)
        gnorm = step.grad_norm.float().reshape(1).to(stats.device)
        values = torch.cat([stats, gnorm]).tolist()  # the one host sync of the update
        got_flags = values[2:-1] if self.env.active else flags
        return (values[0], values[1], values[-1], got_flags, tgt_tokens, src_tgt_tokens)

    def _flags_on_device(self, flags: list[float]) -> torch.Tensor:
        """Rank 0's save/stop flags as a device tensor for the all-reduce, copied from one
        reused (pinned, on CUDA) host buffer: `torch.tensor(x, device=cuda)` from pageable
        memory would wait for the GPU's queue at every update. The previous update's copy
        is complete (each update ends with a sync), so reusing the buffer is safe."""
        if self._flag_buffer is None:
            buffer = torch.zeros(len(flags), dtype=torch.float32)
            self._flag_buffer = buffer.pin_memory() if self.device.type == "cuda" else buffer
        self._flag_buffer.copy_(torch.tensor(flags, dtype=torch.float32))
        return self._flag_buffer.to(self.device, non_blocking=True)

    def _apply_update(self, finite: bool) -> None:
        apply_update(self.optimizer, self.scaler, self.schedule, self.precision, finite,
                     self.ema)

    # ----- checkpoints -----

    def _save(self, elapsed: float, resume_only: bool = False) -> Path | None:
        """Save a training checkpoint: numbered (and checkpoint_last.pt), or with
        `resume_only` checkpoint_last.pt alone (see write_resume_point)."""
        rngs = gather_objects(self.env, capture_rng(self.device))  # collective: all ranks
        if not self.env.is_main:
            return None
        payload = build_payload(
            model=self.model, optimizer=self.optimizer, scheduler=self.schedule,
            scaler=self.scaler, step=self.step, data_state=self.data_state, rng=rngs,
            model_config=self.model_cfg.to_dict(), train_config=self.cfg.to_dict(),
            vocab=self.vocab.proto, meta=self.meta, elapsed_seconds=elapsed)
        payload["best"] = self.best.state_dict()
        if self.ema is not None:
            payload["ema"] = self.ema.state_dict()
        if resume_only:
            path = write_resume_point(payload, self.run_dir)
            self._say(f"saved {path} (update {self.step}; resume point only)")
        else:
            path = write_checkpoint(payload, self.run_dir, self.cfg.keep_last)
            self._say(f"saved {path} (update {self.step})")
        return path

    # ----- main loop -----

    def run(self) -> TrainSummary:
        """Train until max-updates / max-epochs / max-minutes (all totals); save at the end."""
        skipped = self.epoch_batches.get(self.data_state.epoch).skipped
        resumed_file = self.run_dir / LAST if self.resumed_from and self.env.is_main \
            else None
        run = _Run(TrainSummary(self.step, self.data_state.epoch, self.resumed_from,
                                resumed_file, self.update_freq, skipped, 0),
                   self.elapsed_before, saved_step=self.step)
        self._announce(run)
        feed = Prefetcher(self.feed.updates(self.data_state), lambda u: u.micro,
                          self.feed.prepare, enabled=self.prefetch)
        try:
            with run.watch:  # SIGTERM/SIGUSR1 from here on: save at the next update
                if self.best.exhausted:  # resumed from the checkpoint an early stop wrote
                    run.summary.stopped_early = True
                    self._say(f"early stop at update {self.step} reached before (--patience "
                              f"{self.cfg.patience}: best {self.best.metric} at update "
                              f"{self.best.best_step}); nothing to train")
                while self.step < self.cfg.max_updates and not run.summary.stopped_early:
                    nxt = feed.next()
                    if nxt is None:
                        if self.feed.epoch_end is not None:
                            self.data_state = self.feed.epoch_end  # past the last epoch
                        break  # --max-epochs reached
                    if self._run_update(*nxt, run):
                        break
                # Decided from what every rank knows alike, never from files: a rank that looked
                # at RUN while rank 0 was still writing would enter a collective alone.
                if (self.step != run.saved_step or self.step == 0) and not run.preempted:
                    self._save_into(run)
        finally:
            feed.close()
            if self.progress is not None:
                self.progress.close()
            if self.log is not None:
                self.log.close()
            self.net = self.model  # DDP holds the process group: let `shutdown` free it
            shutdown(self.env)
        run.summary.step, run.summary.epoch = self.step, self.data_state.epoch
        if run.preempted:
            what = run.watch.requested or "a preemption signal on another rank"
            saved = run.summary.last_checkpoint or self.run_dir / LAST
            raise Preempted(f"stopped by {what} at update {self.step}, saved in {saved}; "
                            "run the same command to resume")
        return run.summary

    def _announce(self, run: _Run) -> None:
        """The start-up lines; a fine-tuning run validates once before its first update."""
        cfg, summary = self.cfg, run.summary
        n_batches = len(self.epoch_batches.get(self.data_state.epoch).batches)
        weighted = " (corpora sampled by weight each epoch)" if self.epoch_batches.weighted \
            else ""
        self._say(f"{len(self.train_data)} training pairs{weighted} in {n_batches} "
                  f"batches ({summary.skipped_pairs} longer than --max-len {cfg.max_len} "
                  f"skipped); {self.env.world_size} process(es) x max-tokens "
                  f"{self.batching.micro_tokens} x update-freq {self.update_freq}"
                  + (f" (derived from --batch-tokens {cfg.batch_tokens})"
                     if cfg.batch_tokens else "")
                  + f"; precision {self.precision} on {self.device.type}"
                  + (f" (slow: {self.precision_note})" if self.precision_note else "")
                  + (f"; resuming from update {self.step}" if self.step else ""))
        if self.progress is not None:
            self.progress.start(cfg.max_updates, self.step, cfg.max_minutes * 60,
                                self.elapsed_before)
        for note in self.notes:
            self._say(note)
        if self.valid_data is None:
            self._say("no binarized valid split: validation is skipped")
        elif self.initialised_from is not None:  # where fine-tuning starts from
            summary.valid = self._validate(run.elapsed())

    def _run_update(self, update: Update, micro: list[Callable[[], Micro]], run: _Run) -> bool:
        """One update and what follows it (log, validation, save); True: stop training."""
        cfg, summary = self.cfg, run.summary
        want_save = (cfg.save_interval_minutes > 0
                     and time.perf_counter() - run.last_save >= cfg.save_interval_minutes * 60)
        want_stop = cfg.max_minutes > 0 and run.elapsed() >= cfg.max_minutes * 60
        # Time-based flags come from rank 0 alone (ranks' clocks differ); a preemption
        # signal may reach any rank: the all-reduce makes every rank act on it.
        signalled = float(run.watch.requested is not None)
        flags = ([float(want_save), float(want_stop), signalled] if self.env.is_main
                 else [0., 0., signalled])
        loss, nll, gnorm, (save_flag, stop_flag, preempt_flag), tokens, st_tokens = \
            self._train_update(micro, update.all_batches, flags)
        if preempt_flag:
            run.preempted = True
            save_flag = stop_flag = 1.0
        self.data_state = update.after
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        lr = self.schedule.lr
        self._apply_update(finite)
        self._count(run, finite, loss, nll, tokens, st_tokens)
        if self.progress is not None:
            self.progress.advance(self.step, run.elapsed())
        if finite and self.step % cfg.log_interval == 0:
            self._log_train(run.window, lr, gnorm, run.elapsed(), summary)
            run.window = _Window()
        if finite and self.step % cfg.valid_interval == 0:
            summary.valid = self._validate(run.elapsed())
            if self.best.exhausted:
                summary.stopped_early = stop_flag = True
                self._say(f"early stop at update {self.step}: {self.best.stale} "
                          f"validations without a better {self.best.metric} "
                          f"(best {self.best.best:.4f} at update "
                          f"{self.best.best_step}; --patience {cfg.patience})")
        if cfg.save_interval_updates and finite and self.step % cfg.save_interval_updates == 0:
            self._save_into(run)  # the evenly spaced checkpoints averaging uses
        elif save_flag:  # by time: with update-spaced saves, only insurance against a crash
            self._save_into(run, resume_only=bool(cfg.save_interval_updates))
        return bool(stop_flag)

    def _count(self, run: _Run, finite: bool, loss: float, nll: float, tokens: int,
               st_tokens: int) -> None:
        """Step counter, log window and the non-finite streak (aborts when too long)."""
        summary, window = run.summary, run.window
        if finite:
            self.step += 1
            run.streak = 0
            summary.losses.append(loss / tokens)
            window.loss += loss
            window.nll += nll
            window.tokens += tokens
        else:
            run.streak += 1
            summary.skipped_updates += 1
            self._say(f"update {self.step + 1}: non-finite loss or gradient; "
                      f"step skipped ({summary.skipped_updates} so far)")
            if run.streak >= self.cfg.max_nonfinite_in_a_row:
                raise TrainingAborted(
                    f"{run.streak} updates in a row had a non-finite loss or gradient; "
                    f"stopped at update {self.step} (last checkpoint intact); lower "
                    "--lr-scale, use --clip-norm or --precision bf16/fp32")
        window.src_tgt_tokens += st_tokens
        window.update_tgt_tokens += tokens
        window.updates += 1

    def _save_into(self, run: _Run, resume_only: bool = False) -> None:
        """Save now; remember it in `run`."""
        run.summary.last_checkpoint = (self._save(run.elapsed(), resume_only)
                                       or run.summary.last_checkpoint)
        if not resume_only:  # the end of training still writes a numbered checkpoint
            run.saved_step = self.step
        run.last_save = time.perf_counter()

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
            # What an update really held (EOS included, no padding): --batch-tokens counts
            # padded slots of the longer side, so these come out below it.
            "source_tokens_per_update": round(
                (window.src_tgt_tokens - window.update_tgt_tokens) / window.updates),
            "target_tokens_per_update": round(window.update_tgt_tokens / window.updates),
            "update_freq": self.update_freq, "world_size": self.env.world_size,
            "skipped_updates": summary.skipped_updates, "skipped_pairs": summary.skipped_pairs,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
            "wall_time": time.time(), "elapsed_minutes": elapsed / 60,
        }
        assert self.log is not None
        self.log.write(record)
        if self.progress is not None:
            self.progress.update(record)

    def _validate(self, elapsed: float) -> dict[str, float]:
        """Validate (the EMA weights when on); track the best score, write
        checkpoint_best.pt when it improves. Every rank gets rank 0's metrics (BLEU/chrF
        are decoded there alone), so all take the same early-stopping decision."""
        if self.valid_data is None:
            return {}
        weights = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        with weights:
            metrics = validate(self.model, self.valid_data, self.vocab, self.cfg,
                               self.device, self.env, bleu=self.cfg.decode_valid,
                               data_dir=self.data_dir)
            metrics = broadcast_object(self.env, metrics)
            improved = self.best.observe(metrics, self.step)
            if improved and self.env.is_main:
                self._save_best(metrics)
        if self.env.is_main:
            assert self.log is not None
            self.log.write({"kind": "valid", "step": self.step, "epoch": self.data_state.epoch,
                            **{f"valid_{k}": v for k, v in metrics.items()},
                            "best": self.best.best, "best_step": self.best.best_step,
                            "wall_time": time.time(), "elapsed_minutes": elapsed / 60})
            text = " | ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            mark = " (best so far)" if improved else f" (best {self.best.best:.3f} at " \
                f"update {self.best.best_step})"
            self._say(f"valid at update {self.step}: {text}{mark}")
        return metrics

    def _save_best(self, metrics: dict[str, float]) -> None:
        """RUN/checkpoint_best.pt, atomically: the weights just validated (a model file
        for translate, average or --init-from; training resumes from checkpoint_last)."""
        payload = model_payload(
            step=self.step, model_config=self.model_cfg.to_dict(), vocab=self.vocab.proto,
            model=self.model.state_dict(),
            meta={**self.meta, "best": {"metric": self.best.metric,
                                        "score": metrics[self.best.metric],
                                        "ema": self.ema is not None}})
        save_checkpoint(payload, self.run_dir / BEST)


def train(data_dir: Path, run_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig,
          device: str = "auto", meta: dict[str, Any] | None = None,
          progress: bool | TrainReporter = True, init_from: Path | None = None,
          reset_optimizer: bool = False) -> TrainSummary:
    """Train (or resume, if RUN/checkpoint_last.pt exists) and return where it stopped.
    A new run starts from `init_from`'s model when given (fine-tuning)."""
    return Trainer(data_dir, run_dir, model_cfg, train_cfg, device, meta, progress,
                   init_from, reset_optimizer).run()
