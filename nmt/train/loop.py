"""The training loop behind `nmt train`: batches -> Transformer -> checkpoints.

One update: `update_freq` micro-batches per process, each rank on its own shard of the
epoch's batches, the loss normalised by the update's target tokens over all ranks (counted
on the host from the length arrays). The host reads one small tensor per update (loss,
NLL, gradient norm, the save/stop/preemption flags): at once on a CPU; on CUDA one update
late, so the GPU never waits (`_train`). A non-finite update never reaches the weights.
How and why, with the measurements: docs/training.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt.checkpoint import BEST, model_payload, save_checkpoint
from nmt.config import ModelConfig, TrainConfig
from nmt.data.batch_tokens import derive_batching, fill_note
from nmt.data.dataset import ParallelData, corpus_ranges, language_pair, load_vocab, read_meta
from nmt.errors import Preempted, TrainingAborted, UsageError
from nmt.precision import emulation_note
from nmt.train.best import BestTracker
from nmt.train.distributed import (
    broadcast_object,
    check_ranks_agree,
    data_parallel,
    fingerprint,
    gather_objects,
    shutdown,
)
from nmt.train.ema import WeightAverage
from nmt.train.feed import Micro, TrainFeed, Update
from nmt.train.log import LogWindow, RecordLog, TrainReporter
from nmt.train.loss import fused_loss_enabled
from nmt.train.preempt import PreemptionWatch
from nmt.train.prefetch import Prefetcher
from nmt.train.readback import Pending, Readback
from nmt.train.resume import Training, initialise_from, resume
from nmt.train.sampling import EpochBatches
from nmt.train.schedule import describe_schedule
from nmt.train.setup import build_model, checked_model_config, join, open_logs
from nmt.train.state import (
    LAST,
    DataState,
    build_payload,
    capture_rng,
    write_checkpoint,
    write_resume_point,
)
from nmt.train.step import LossOptions, advance, apply_update, launch_update, nonfinite, train_step
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


@dataclass
class _Run:
    """What one `Trainer.run` keeps between updates."""

    summary: TrainSummary
    elapsed_before: float  # seconds of the run before this process (resumed runs)
    saved_step: int  # update of the newest numbered checkpoint this process knows of
    start: float = field(default_factory=time.perf_counter)
    last_save: float = field(default_factory=time.perf_counter)
    streak: int = 0  # non-finite updates in a row
    window: LogWindow = field(default_factory=LogWindow)
    watch: PreemptionWatch = field(default_factory=PreemptionWatch)
    preempted: bool = False  # some rank got SIGTERM/SIGUSR1: saved, stopping

    def elapsed(self) -> float:
        """Training seconds in all, this process's included."""
        return self.elapsed_before + time.perf_counter() - self.start


@dataclass
class _Launched:
    """An update whose forward and backward are queued, its statistics on the way to the
    host (nmt/train/readback.py)."""

    update: Update
    stats: Pending  # loss sum, NLL sum, [flags summed over ranks,] gradient norm
    flags: list[float]  # this rank's save/stop/preempt flags and elapsed seconds (rank 0)
    tgt_tokens: int  # target tokens of the update, all ranks
    src_tgt_tokens: int  # source + target tokens, all ranks
    found_inf: torch.Tensor | None  # deferred path: 1.0 on the device where not finite
    rng_before: dict[str, Any] | None  # deferred path: RNG state before its dropout


class Trainer:
    """Holds the model, optimiser and data of one run; `run()` trains to the limits."""

    def __init__(self, data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                 train_cfg: TrainConfig, device: str = "auto",
                 meta: dict[str, Any] | None = None,
                 progress: bool | TrainReporter = True,
                 init_from: Path | None = None, reset_optimizer: bool = False,
                 tensorboard: Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.run_dir = Path(run_dir)
        self.train_cfg = train_cfg
        self.tensorboard = tensorboard  # also write TensorBoard events there
        self.env, self.device = join(device)
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
        self.model_cfg = checked_model_config(model_cfg, train_cfg, len(self.vocab))
        self.train_data = ParallelData.open(self.data_dir, "train")
        self.valid_data = self._open_valid()
        # --batch-tokens: the shape for B real tokens per side per update, from the fill
        # this data's batches are measured to have (alike on every rank and every resume).
        self.batching = derive_batching(train_cfg, self.env.world_size,
                                        self.train_data.src.lengths,
                                        self.train_data.tgt.lengths)
        self.update_freq = self.batching.update_freq
        built = build_model(self.model_cfg, train_cfg, self.device, self.env.rank)
        self.model, self.optimizer, self.schedule = built.model, built.optimizer, built.schedule
        self.scaler, self.precision, self.deferred = built.scaler, built.precision, built.deferred
        # An explicit bf16/fp16 on a CPU that emulates it: named with its measured cost.
        self.precision_note = emulation_note(self.precision, self.device, training=True) \
            if self.env.is_main else None
        check_ranks_agree(self.env, fingerprint(
            self.model_cfg, train_cfg, self.precision, self.device, self.deferred,
            self.train_data, self.valid_data, self.vocab.proto))
        self.ema = WeightAverage(self.model, train_cfg.ema_decay) if train_cfg.ema_decay \
            else None
        self.best = BestTracker(train_cfg.best_metric, train_cfg.patience)
        self.notes: list[str] = []  # said once training starts (after the progress bar)
        self.readback = Readback(self.device)  # statistics to the host, flags to the device
        # Prepare the next update's batches on a thread while the GPU computes (CUDA only).
        self.prefetch = self.device.type == "cuda"
        # Output projection + loss chunked over rows, never the whole (rows, vocab) logits
        # (auto: CUDA only; on a CPU the recomputed logits cost 1.3x at base shapes).
        self.fused_loss = fused_loss_enabled(train_cfg.fused_loss, self.device)
        self.loss_options = LossOptions(train_cfg.label_smoothing, self.model_cfg.pad_id,
                                        fused=self.fused_loss)
        self.step = 0
        self.data_state = DataState()
        self.elapsed_before = 0.0
        self.resumed_from = 0
        src_lang, tgt_lang = language_pair(self.data_dir)  # from nmt prep's manifest
        self.meta = {"src_lang": src_lang, "tgt_lang": tgt_lang,
                     "data_dir": str(self.data_dir.resolve()), **(meta or {})}
        training = Training(self.model, self.optimizer, self.schedule, self.scaler,
                            self.device, self.ema, self.best)
        resumed = resume(self.env, self.run_dir, self.model_cfg, train_cfg, self.batching,
                         training)
        if resumed is not None:
            self.step = self.resumed_from = resumed.step
            self.data_state, self.elapsed_before = resumed.data_state, resumed.elapsed_seconds
            self.ema = resumed.ema
            self.notes += resumed.notes
        self.initialised_from: Path | None = None
        if init_from is not None and self.resumed_from == 0:
            self.ema, note = initialise_from(Path(init_from), self.model_cfg, self.vocab.proto,
                                             training, train_cfg.ema_decay, reset_optimizer)
            self.initialised_from = Path(init_from)
            self.notes.append(note)
        self.net = data_parallel(self.model, self.env, self.device)
        self.corpora = corpus_ranges(self.data_dir)
        self.epoch_batches = self._build_batches()
        self._epoch_sizes: dict[int, int] = {}  # epoch -> its number of batches
        self.feed = TrainFeed(self.train_data, self.epoch_batches, self.env, self.update_freq,
                              train_cfg.seed, train_cfg.max_epochs, self.device)
        self.log: RecordLog | None = None
        self.progress: TrainReporter | None = None
        if self.env.is_main:
            settings = {**{f"model.{k}": v for k, v in model_cfg.to_dict().items()},
                        **train_cfg.to_dict(), "data": str(self.data_dir),
                        "world_size": self.env.world_size}
            self.log, self.progress = open_logs(self.run_dir, self.step, progress,
                                                self.tensorboard, settings)

    def _build_batches(self) -> EpochBatches:
        """Each epoch's batch list (shuffled per epoch by `epoch_order`): one fixed list,
        or a per-epoch draw when the data's corpora carry sampling weights."""
        data, cfg = self.train_data, self.train_cfg
        batches = EpochBatches(data.src.lengths, data.tgt.lengths, self.corpora,
                               self.batching.micro_tokens, cfg.max_len, cfg.seed)
        count = len(batches.get(self.data_state.epoch).batches)
        if count < self.env.world_size:
            raise UsageError(f"{self.data_dir}: only {count} training batches "
                             f"for {self.env.world_size} processes; lower --max-tokens")
        return batches

    def _open_valid(self) -> ParallelData | None:
        """The valid split; None when none was binarized (validation is then skipped, as
        the start says). One that is there but unreadable is a DataError, not skipped."""
        if "valid" not in read_meta(self.data_dir)["splits"]:
            return None
        return ParallelData.open(self.data_dir, "valid")

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)

    # ----- one update -----

    def _launch(self, update: Update, micro: list[Callable[[], Micro]], run: _Run
                ) -> _Launched:
        """Queue one update's forward and backward (`train_step`) and the copy of its
        statistics to the host; nothing here waits for the device.

        The statistics (loss sum, NLL sum, rank 0's save/stop flags and any rank's
        preemption flag, rank 0's elapsed seconds, gradient norm) travel in one small
        tensor, all-reduced when distributed: a flag any rank raised is raised for all.
        Time-based flags and the time the schedule follows come from rank 0 alone (ranks'
        clocks differ; every rank must set the same learning rate).
        """
        cfg = self.train_cfg
        elapsed = run.elapsed()
        want_save = (cfg.save_interval_minutes > 0
                     and time.perf_counter() - run.last_save >= cfg.save_interval_minutes * 60)
        want_stop = cfg.max_minutes > 0 and elapsed >= cfg.max_minutes * 60
        signalled = float(run.watch.requested is not None)
        flags = ([float(want_save), float(want_stop), signalled, elapsed] if self.env.is_main
                 else [0., 0., signalled, 0.])
        # Deferred: a save after the previous update must restore the RNG as it was
        # before this update's dropout, which runs before that save.
        rng_before = capture_rng(self.device) if self.deferred else None
        all_ids = np.concatenate(update.all_batches)
        tgt_tokens = int(self.feed.tgt_cost[all_ids].sum())
        src_tgt_tokens = tgt_tokens + int(self.feed.src_cost[all_ids].sum())
        step = train_step(self.net, self.model, micro, tgt_tokens=tgt_tokens,
                          optimizer=self.optimizer, scaler=self.scaler,
                          precision=self.precision, loss=self.loss_options,
                          world_size=self.env.world_size, clip_norm=self.train_cfg.clip_norm)
        stats = torch.stack([step.loss_sum, step.nll_sum])
        if self.env.active:
            stats = torch.cat([stats, self.readback.flags_on_device(flags)])
            torch.distributed.all_reduce(stats)
        gnorm = step.grad_norm.float().reshape(1).to(stats.device)
        values = torch.cat([stats, gnorm])  # (2 [+ 3 flags] + 1,)
        found_inf = nonfinite(values[0], values[-1]) if self.deferred else None
        return _Launched(update, self.readback.start(values), flags, tgt_tokens,
                         src_tgt_tokens, found_inf, rng_before)

    def _drop_in_flight(self) -> None:
        """Drop the update launched after the one that stopped training: its gradients go
        (memory for the final save); its statistics are never read, its data position
        never recorded, and the weights never saw it."""
        self.optimizer.zero_grad(set_to_none=True)

    # ----- checkpoints -----

    def _save(self, elapsed: float, resume_only: bool = False,
              rng: dict[str, Any] | None = None) -> Path | None:
        """Save a training checkpoint: numbered (and checkpoint_last.pt), or with
        `resume_only` checkpoint_last.pt alone (see write_resume_point). `rng`: the RNG
        state to record (deferred path: as it was before the next update's dropout, which
        may already have run; see _launch), None: as it is now."""
        rng = rng if rng is not None else capture_rng(self.device)
        rngs = gather_objects(self.env, rng)  # collective: all ranks
        if not self.env.is_main:
            return None
        payload = build_payload(
            model=self.model, optimizer=self.optimizer, scheduler=self.schedule,
            scaler=self.scaler, step=self.step, data_state=self.data_state, rng=rngs,
            model_config=self.model_cfg.to_dict(), train_config=self.train_cfg.to_dict(),
            vocab=self.vocab.proto, meta=self.meta, elapsed_seconds=elapsed)
        payload["best"] = self.best.state_dict()
        if self.ema is not None:
            payload["ema"] = self.ema.state_dict()
        if resume_only:
            path = write_resume_point(payload, self.run_dir)
            self._say(f"saved {path} (update {self.step}; resume point only)")
        else:
            path = write_checkpoint(payload, self.run_dir, self.train_cfg.keep_last)
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
                              f"{self.train_cfg.patience}: best {self.best.metric} at update "
                              f"{self.best.best_step}); nothing to train")
                rng = self._train(feed, run)
                # Decided from what every rank knows alike, never from files: a rank that looked
                # at RUN while rank 0 was still writing would enter a collective alone.
                if (self.step != run.saved_step or self.step == 0) and not run.preempted:
                    self._save_into(run, rng=rng)
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
        cfg, summary = self.train_cfg, run.summary
        n_batches = len(self.epoch_batches.get(self.data_state.epoch).batches)
        weighted = " (corpora sampled by weight each epoch)" if self.epoch_batches.weighted \
            else ""
        self._say(f"{len(self.train_data)} training pairs{weighted} in {n_batches} "
                  f"batches ({summary.skipped_pairs} longer than --max-len {cfg.max_len} "
                  f"skipped); {self.env.world_size} process(es) x max-tokens "
                  f"{self.batching.micro_tokens} x update-freq {self.update_freq}"
                  + (f" (derived from --batch-tokens {cfg.batch_tokens} real tokens per side: "
                     f"{fill_note(self.batching, self.env.world_size)})"
                     if cfg.batch_tokens else "")
                  + f"; precision {self.precision} on {self.device.type}"
                  + (f" (slow: {self.precision_note})" if self.precision_note else "")
                  + (f"; resuming from update {self.step}" if self.step else ""))
        self._say(describe_schedule(cfg, self.model_cfg.d_model))
        if self.progress is not None:
            self.progress.start(cfg.max_updates, self.step, cfg.max_minutes * 60,
                                self.elapsed_before)
        for note in self.notes:
            self._say(note)
        if self.valid_data is None:
            self._say("no binarized valid split: validation is skipped")
        elif self.initialised_from is not None:  # where fine-tuning starts from
            summary.valid = self._validate(run.elapsed())

    def _train(self, feed: Prefetcher, run: _Run) -> dict[str, Any] | None:
        """Updates until a limit, a stop flag or the end of the data; returns the RNG state
        a save after them must record (None: the current one).

        In-line path (CPU): each update is launched, its statistics read, then applied or
        skipped from the host. Deferred path (CUDA, `defer_statistics`): update k + 1 is
        launched before update k's statistics are read, and each update's optimizer step
        is queued right behind its backward with the skip decided on the device
        (`launch_update`); the host reads update k's numbers only once update k + 1 is
        queued, so the GPU never waits for it. Everything the host decides from them
        (step count, schedule, weight average, log, validation, saves, stopping) happens
        one update late but on the same state, so both paths train identically; an
        update launched after the one that stopped training is dropped unapplied.
        """
        in_flight: _Launched | None = None  # deferred: stepped on the device, not yet read
        rng: dict[str, Any] | None = None  # deferred: before the dropout of the update after
        while not run.summary.stopped_early:
            launched, ended = None, False
            if self.step + (in_flight is not None) < self.train_cfg.max_updates:
                nxt = feed.next()
                if nxt is None:
                    ended = True
                else:
                    launched = self._launch(*nxt, run)
            if in_flight is not None:
                rng = launched.rng_before if launched is not None else None
                stop = self._settle(in_flight, run, rng)
                in_flight = None
                if stop:
                    if launched is not None:
                        self._drop_in_flight()
                    return rng
            if launched is None:
                if ended and self.feed.epoch_end is not None:
                    self.data_state = self.feed.epoch_end  # past the last epoch
                if ended or self.step >= self.train_cfg.max_updates:
                    return rng  # --max-epochs or --max-updates reached
                continue  # the last update in flight was skipped: one more is needed
            if self.deferred:
                assert launched.found_inf is not None
                launch_update(self.optimizer, self.scaler, self.precision, launched.found_inf)
                in_flight = launched
            elif self._settle(launched, run, None):
                return None
        return rng

    def _settle(self, launched: _Launched, run: _Run, rng: dict[str, Any] | None) -> bool:
        """Read an update's statistics and act on them: apply or skip it (in-line path;
        the deferred path only advances the schedule and weight average, the optimizer
        having stepped on the device), count, log, validate, save. True: stop training."""
        cfg, summary = self.train_cfg, run.summary
        values = launched.stats.values()  # the update's one host sync
        loss, nll, gnorm = values[0], values[1], values[-1]
        save_flag, stop_flag, preempt_flag, elapsed = (values[2:-1] if self.env.active
                                                       else launched.flags)
        if preempt_flag:
            run.preempted = True
            save_flag = stop_flag = 1.0
        self.data_state = launched.update.after
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        lr = self.schedule.lr
        progress = self._progress(self.step + 1, elapsed)
        if self.deferred:
            advance(self.schedule, self.ema, finite, progress)
        else:
            apply_update(self.optimizer, self.scaler, self.schedule, self.precision, finite,
                         self.ema, progress)
        self._count(run, finite, loss, nll, launched.tgt_tokens, launched.src_tgt_tokens)
        if self.progress is not None:
            self.progress.advance(self.step, run.elapsed())
        if finite and self.step % cfg.log_interval == 0:
            self._log_train(run.window, lr, gnorm, run.elapsed(), progress, summary)
            run.window = LogWindow()
        if finite and self.step % cfg.valid_interval == 0:
            summary.valid = self._validate(run.elapsed())
            if self.best.exhausted:
                summary.stopped_early = stop_flag = True
                self._say(f"early stop at update {self.step}: {self.best.stale} "
                          f"validations without a better {self.best.metric} "
                          f"(best {self.best.best:.4f} at update "
                          f"{self.best.best_step}; --patience {cfg.patience})")
        if cfg.save_interval_updates and finite and self.step % cfg.save_interval_updates == 0:
            self._save_into(run, rng=rng)  # the evenly spaced checkpoints averaging uses
        elif save_flag:  # by time: with update-spaced saves, only insurance against a crash
            self._save_into(run, resume_only=bool(cfg.save_interval_updates), rng=rng)
        return bool(stop_flag)

    def _progress(self, updates: int, elapsed: float) -> float:
        """How much of the budget has passed after `updates` updates, `elapsed` seconds in
        and at `self.data_state`: the largest share of --max-updates, --max-minutes and
        --max-epochs (those set), at most 1. The budgeted schedules follow it."""
        cfg = self.train_cfg
        shares = [updates / cfg.max_updates]
        if cfg.max_minutes > 0:
            shares.append(elapsed / (cfg.max_minutes * 60))
        if cfg.max_epochs > 0:
            epoch, index = self.data_state.epoch, self.data_state.index
            if index and epoch not in self._epoch_sizes:  # batched once per epoch
                self._epoch_sizes[epoch] = max(len(self.epoch_batches.get(epoch).batches), 1)
            within = index / self._epoch_sizes[epoch] if index else 0.0
            shares.append((epoch - 1 + within) / cfg.max_epochs)
        return min(max(shares), 1.0)

    def _count(self, run: _Run, finite: bool, loss: float, nll: float, tokens: int,
               st_tokens: int) -> None:
        """Step counter, log window and the non-finite streak (aborts when too long)."""
        summary = run.summary
        run.window.add(finite, loss, nll, tokens, st_tokens)
        if finite:
            self.step += 1
            run.streak = 0
            summary.losses.append(loss / tokens)
            return
        run.streak += 1
        summary.skipped_updates += 1
        self._say(f"update {self.step + 1}: non-finite loss or gradient; "
                  f"step skipped ({summary.skipped_updates} so far)")
        if run.streak >= self.train_cfg.max_nonfinite_in_a_row:
            raise TrainingAborted(
                f"{run.streak} updates in a row had a non-finite loss or gradient; "
                f"stopped at update {self.step} (last checkpoint intact); lower "
                "--lr-scale, use --clip-norm or --precision bf16/fp32")

    def _save_into(self, run: _Run, resume_only: bool = False,
                   rng: dict[str, Any] | None = None) -> None:
        """Save now (`rng`: see _save); remember it in `run`."""
        run.summary.last_checkpoint = (self._save(run.elapsed(), resume_only, rng)
                                       or run.summary.last_checkpoint)
        if not resume_only:  # the end of training still writes a numbered checkpoint
            run.saved_step = self.step
        run.last_save = time.perf_counter()

    def _log_train(self, window: LogWindow, lr: float, gnorm: float, elapsed: float,
                   progress: float, summary: TrainSummary) -> None:
        """One train record: the window's statistics, the lr the update used and the
        budget's `progress` after it (what sets the next update's lr)."""
        if not self.env.is_main or window.tokens == 0:
            return
        record = window.record(
            step=self.step, epoch=self.data_state.epoch, lr=lr, progress=progress,
            grad_norm=gnorm, update_freq=self.update_freq, world_size=self.env.world_size,
            skipped_updates=summary.skipped_updates, skipped_pairs=summary.skipped_pairs,
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
            wall_time=time.time(), elapsed_minutes=elapsed / 60)
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
            metrics = validate(self.model, self.valid_data, self.vocab, self.train_cfg,
                               self.device, self.env, bleu=self.train_cfg.decode_valid,
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
          reset_optimizer: bool = False, tensorboard: Path | None = None) -> TrainSummary:
    """Train (or resume, if RUN/checkpoint_last.pt exists) and return where it stopped.
    A new run starts from `init_from`'s model when given (fine-tuning); with `tensorboard`
    the log records also go there as TensorBoard events."""
    return Trainer(data_dir, run_dir, model_cfg, train_cfg, device, meta, progress,
                   init_from, reset_optimizer, tensorboard).run()
