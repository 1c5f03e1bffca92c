"""The training loop behind `nmt train`: batches -> Transformer -> checkpoints.

One update: `update_freq` micro-batches per process, each rank on its own shard of the
epoch's batches, the loss normalised by the update's target tokens over all ranks (counted
on the host from the length arrays). One loop (`Trainer._train`) launches each update,
applies or skips it and settles it; the host reads one small tensor per update (loss, NLL,
gradient norm, the save/stop/preemption flags) through a `Readback` that is immediate on a
CPU and deferred on CUDA: there the next update is launched before this one is settled and
the skip of a non-finite update is decided on the device, so the GPU never waits. `_settle`
then acts on the numbers, in order: count, log, validate, save. A non-finite update never
reaches the weights. How and why: docs/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt.config import ModelConfig, TrainConfig
from nmt.data.batch_tokens import derive_batching
from nmt.data.dataset import ParallelData, language_pair, load_vocab
from nmt.errors import Preempted, TrainingAborted
from nmt.host_memory import HUGE_PAGE_SETTING, heap_in_huge_pages
from nmt.precision import precision_note
from nmt.train import micro_batch
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
from nmt.train.feed import Micro, Shapes, TrainFeed, Update
from nmt.train.log import LogWindow, RunLog, TrainReporter, start_line
from nmt.train.loss import fused_loss_enabled
from nmt.train.preempt import PreemptionWatch
from nmt.train.prefetch import Prefetcher
from nmt.train.readback import Pending, Readback
from nmt.train.resume import initialise_from, resume
from nmt.train.schedule import (
    budget_progress,
    describe_dropout,
    describe_schedule,
    dropout_factor,
    epochs_seen,
)
from nmt.train.setup import (
    build_model,
    checked_model_config,
    epoch_batches,
    join,
    open_logs,
    open_valid,
)
from nmt.train.state import LAST, DataState, Training, capture_rng, save_training, write_best
from nmt.train.step import (
    DeviceSkip,
    LossOptions,
    advance,
    apply_update,
    compiled,
    nonfinite,
    train_step,
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
    out_of_data: bool = False  # --max-epochs reached

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
    skip: torch.Tensor | None  # deferred: True on the device where not finite (`nonfinite`)
    rng_before: dict[str, Any] | None  # deferred: RNG state before its dropout

    def finite(self) -> bool:
        """Whether its loss sum and gradient norm are finite (reads its statistics)."""
        values = self.stats.values()
        return math.isfinite(values[0]) and math.isfinite(values[-1])


class Trainer:
    """Holds the model, optimiser and data of one run; `run()` trains to the limits.
    `deferred`: read each update's statistics one update late (see the module doc); None:
    on CUDA alone. Both orders train exactly alike, so a CPU test may run CUDA's."""

    def __init__(self, data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                 train_cfg: TrainConfig, device: str = "auto",
                 meta: dict[str, Any] | None = None,
                 progress: bool | TrainReporter = True,
                 init_from: Path | None = None, reset_optimizer: bool = False,
                 tensorboard: Path | None = None, deferred: bool | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.run_dir = Path(run_dir)
        self.train_cfg = train_cfg
        self.tensorboard = tensorboard  # also write TensorBoard events there
        self.env, self.device = join(device, train_cfg.precision)
        try:  # a rank that fails here leaves the process group, or gloo aborts at exit
            self._set_up(model_cfg, train_cfg, meta, progress, init_from, reset_optimizer,
                         deferred)
        except BaseException:
            shutdown(self.env)
            raise

    def _set_up(self, model_cfg: ModelConfig, train_cfg: TrainConfig,
                meta: dict[str, Any] | None, progress: bool | TrainReporter,
                init_from: Path | None, reset_optimizer: bool, deferred: bool | None) -> None:
        """Data, model, optimiser, resume point and logs of the run (after joining)."""
        self.vocab = load_vocab(self.data_dir)
        self.model_cfg = checked_model_config(model_cfg, train_cfg, len(self.vocab))
        self.train_data = ParallelData.open(self.data_dir, "train")
        self.valid_data = open_valid(self.data_dir)
        built = build_model(self.model_cfg, train_cfg, self.device, self.env.rank)
        self.model, self.optimizer, self.schedule = built.model, built.optimizer, built.schedule
        self.scaler, self.precision = built.scaler, built.precision
        self.notes: list[str] = []  # said once training starts (after the progress bar)
        # bf16: the micro-batches compute on a bf16 copy, the fp32 model is the master.
        self.half, self.compute = built.half, built.compute
        # Output projection + loss chunked over rows, never the whole (rows, vocab) logits
        # (auto: CUDA only, see fused_loss_enabled).
        self.fused_loss = fused_loss_enabled(train_cfg.fused_loss, self.device)
        self.loss_options = LossOptions(train_cfg.label_smoothing, self.model_cfg.pad_id,
                                        fused=self.fused_loss, project=built.linear)
        if train_cfg.max_tokens == 0:  # from the device's memory (nmt/train/micro_batch.py)
            train_cfg = self.train_cfg = self._plan_max_tokens(train_cfg)
        # --batch-tokens: the shape for B real tokens per side per update, from the fill
        # this data's batches are measured to have (alike on every rank and every resume).
        self.batching = derive_batching(train_cfg, self.env.world_size,
                                        self.train_data.src.lengths,
                                        self.train_data.tgt.lengths)
        self.update_freq = self.batching.update_freq
        # Statistics to the host (flags to the device), at once or one update late; late,
        # the skip of a non-finite update is decided on the device.
        self.readback = Readback(self.device, deferred)
        self.device_skip = DeviceSkip(self.device) if self.readback.deferred else None
        # bf16/fp16 that is slow on this CPU, or `auto` passing over native bf16: why.
        self.precision_note = precision_note(self.precision, self.device, training=True,
                                             setting=train_cfg.precision) \
            if self.env.is_main else None
        check_ranks_agree(self.env, fingerprint(
            self.model_cfg, train_cfg, self.precision, self.device, self.readback.deferred,
            self.train_data, self.valid_data, self.vocab.proto))
        self.ema = WeightAverage(self.model, train_cfg.ema_decay) if train_cfg.ema_decay \
            else None
        self.best = BestTracker(train_cfg.best_metric, train_cfg.patience)
        # Prepare the next update's batches on a thread while the GPU computes (CUDA only).
        self.prefetch = self.device.type == "cuda"
        self.step = self.resumed_from = 0
        self.data_state = DataState()
        self.elapsed_before = 0.0
        src_lang, tgt_lang = language_pair(self.data_dir)  # from nmt prep's manifest
        self.meta = {"src_lang": src_lang, "tgt_lang": tgt_lang,
                     "data_dir": str(self.data_dir.resolve()), **(meta or {})}
        resumed = resume(self.env, self.run_dir, self.model_cfg, train_cfg, self.batching,
                         self._training())
        if resumed is not None:
            self.step = self.resumed_from = resumed.step
            self.data_state, self.elapsed_before = resumed.data_state, resumed.elapsed_seconds
            self.ema = resumed.ema
            self.notes += resumed.notes
        if self.device.type == "cpu" and heap_in_huge_pages():
            self.notes.append("heap in transparent huge pages (GLIBC_TUNABLES="
                              f"{HUGE_PAGE_SETTING}; NMT_HUGE_PAGE_HEAP=0 keeps 4 KiB pages)")
        self.initialised_from: Path | None = None
        if init_from is not None and self.resumed_from == 0:
            self.ema, note = initialise_from(Path(init_from), self.model_cfg, self.vocab.proto,
                                             self._training(), train_cfg.ema_decay,
                                             reset_optimizer)
            self.initialised_from = Path(init_from)
            self.notes.append(note)
        if self.half is not None:  # the master as resumed or initialised
            self.half.refresh()
        self.net = data_parallel(self.compute, self.env, self.device)
        if train_cfg.compile:
            self.net = compiled(self.net, cuda_graphs=train_cfg.cuda_graphs)
            if train_cfg.cuda_graphs and self.device.type != "cuda":
                self.notes.append("--cuda-graphs on a CPU: static shapes, no graphs")
        self.epoch_batches = epoch_batches(self.data_dir, self.train_data,
                                           self.batching.micro_tokens, train_cfg,
                                           self.env.world_size, self.data_state.epoch)
        self.dropout_factor = 1.0
        self._schedule_dropout()  # from the resumed progress (0 for a fresh run)
        shapes = Shapes(self.batching.micro_tokens, train_cfg.cuda_graphs) \
            if train_cfg.compile else None
        self.feed = TrainFeed(self.train_data, self.epoch_batches, self.env, self.update_freq,
                              train_cfg.seed, train_cfg.max_epochs, self.device, shapes)
        self.log = RunLog()  # rank 0 alone writes and reports
        if self.env.is_main:
            settings = {**{f"model.{k}": v for k, v in model_cfg.to_dict().items()},
                        **train_cfg.to_dict(), "data": str(self.data_dir),
                        "world_size": self.env.world_size}
            self.log = open_logs(self.run_dir, self.step, progress, self.tensorboard,
                                 settings)

    def _plan_max_tokens(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with --max-tokens 0 resolved: on CUDA with --batch-tokens, the cap the
        device's memory holds (measured, the smallest over the ranks); else DEFAULT_TOKENS."""
        tokens = micro_batch.DEFAULT_TOKENS
        if self.device.type == "cuda" and cfg.batch_tokens:
            plan = micro_batch.plan_on_cuda(self.model, self.compute, self.loss_options,
                                            self.precision, self.half is not None,
                                            cfg.max_len, cfg.batch_tokens,
                                            self.env.world_size, self.device)
            tokens = min(gather_objects(self.env, plan.micro_tokens))
            self.notes.append(plan.describe())
        return dataclasses.replace(cfg, max_tokens=tokens)

    def _schedule_dropout(self) -> None:
        """Set the model's dropout rates for the next update from --dropout-schedule and
        the progress the schedule last saw (nothing to do for `constant`)."""
        if self.train_cfg.dropout_schedule == "constant":
            return
        self.dropout_factor = dropout_factor(self.train_cfg.dropout_schedule,
                                             self.schedule.progress, self._epochs_seen(),
                                             self.train_cfg.dropout_epochs)
        self.model.scale_dropout(self.dropout_factor)
        if self.half is not None:
            self.half.scale_dropout(self.dropout_factor)

    def _epochs_seen(self) -> float:
        """Epochs of training data this run's updates have taken so far."""
        return epochs_seen(self.data_state.epoch, self.data_state.index,
                           self.epoch_batches.size)

    def _dropout_fields(self, factor: float) -> dict[str, float]:
        """The train record's `dropout` (the residual rate an update used) under a
        dropout schedule, and with --dropout-epochs the `epochs` seen after it; nothing
        under `constant`."""
        if self.train_cfg.dropout_schedule == "constant":
            return {}
        fields = {"dropout": self.model_cfg.dropout * factor}
        if self.train_cfg.dropout_epochs > 0:
            fields["epochs"] = self._epochs_seen()
        return fields

    def _training(self) -> Training:
        """The model, optimizer and friends as resuming and saving take them."""
        return Training(self.model, self.optimizer, self.schedule, self.scaler, self.device,
                        self.ema, self.best)

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
                    self.log.say(self.best.stop_note(self.step, before=True))
                if self._time_spent():
                    rng = None
                    self.log.say(f"the budget of {self.train_cfg.max_minutes:g} minutes is "
                                 f"spent ({self.elapsed_before / 60:.2f} minutes trained): "
                                 "no update to make")
                else:
                    rng = self._train(feed, run)
                # Decided from what every rank knows alike, never from files: a rank that looked
                # at RUN while rank 0 was still writing would enter a collective alone.
                if (self.step != run.saved_step or self.step == 0) and not run.preempted:
                    self._save(run, rng=rng)
        finally:
            feed.close()
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
        cfg = self.train_cfg
        self.log.say(start_line(cfg, self.batching, self.env.world_size, len(self.train_data),
                                self.epoch_batches.get(self.data_state.epoch),
                                self.epoch_batches.weighted, self.precision,
                                self.device.type, self.precision_note, self.step))
        self.log.say(describe_schedule(cfg, self.model_cfg.d_model))
        mc = self.model_cfg
        dropout_line = describe_dropout(cfg, {"dropout": mc.dropout,
                                              "attention dropout": mc.attention_dropout,
                                              "activation dropout": mc.activation_dropout})
        if dropout_line is not None:
            self.log.say(dropout_line)
        self.log.start(cfg.max_updates, self.step, cfg.max_minutes * 60, self.elapsed_before)
        for note in self.notes:
            self.log.say(note)
        if self.valid_data is None:
            self.log.say("no binarized valid split: validation is skipped")
        elif self.initialised_from is not None:  # where fine-tuning starts from
            run.summary.valid = self._validate(run.elapsed())

    def _time_spent(self) -> bool:
        """Whether a resumed run's --max-minutes was already used up by the runs before it
        (the training time its checkpoint saved: the same on every rank). Then it makes no
        update: one more, at the schedule's final rate, would only add a checkpoint that
        `nmt average --last N` would take in place of an older one, so running the same
        command again would change what a finished run averages."""
        budget = self.train_cfg.max_minutes * 60
        return budget > 0 and self.elapsed_before >= budget

    def _train(self, feed: Prefetcher, run: _Run) -> dict[str, Any] | None:
        """Updates until a limit, a stop flag or the end of the data; returns the RNG state
        a save after them must record (None: the current one).

        Each update is launched (`_launch`), applied or skipped (`_apply`) and settled
        (`_settle`). With an immediate read-back that is all, update after update. Deferred,
        the next update is launched before this one is settled, and its optimizer step
        queued right after, so the GPU never waits for the host: everything the host
        decides from the numbers happens one update late but on the same state, so both
        orders train exactly alike. An update launched after the one that stopped
        training is dropped unapplied.
        """
        current = self._next(feed, run, in_flight=0)
        while current is not None:
            self._apply(current)
            after = self._next(feed, run, in_flight=1) if self.readback.deferred else None
            rng = after.rng_before if after is not None else None
            if self._settle(current, run, rng):
                if after is not None:  # its gradients go; the weights never saw it
                    self.optimizer.zero_grad(set_to_none=True)
                return rng
            # Deferred, `after` is None where the update just settled was to be the last:
            # one more is needed if it was skipped.
            current = after if after is not None else self._next(feed, run, in_flight=0)
        if run.out_of_data and self.feed.epoch_end is not None:
            self.data_state = self.feed.epoch_end
        return None

    def _next(self, feed: Prefetcher, run: _Run, in_flight: int) -> _Launched | None:
        """The next update launched; None where training stopped early, where
        --max-updates is reached counting the `in_flight` updates not yet settled, or at
        the end of the data (--max-epochs)."""
        if run.summary.stopped_early or self.step + in_flight >= self.train_cfg.max_updates:
            return None
        nxt = feed.next()
        if nxt is None:
            run.out_of_data = True
            return None
        return self._launch(*nxt, run)

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
        rng_before = capture_rng(self.device) if self.readback.deferred else None
        all_ids = np.concatenate(update.all_batches)
        tgt_tokens = int(self.feed.tgt_cost[all_ids].sum())
        src_tgt_tokens = tgt_tokens + int(self.feed.src_cost[all_ids].sum())
        step = train_step(self.net, self.compute, micro, tgt_tokens=tgt_tokens,
                          optimizer=self.optimizer, scaler=self.scaler,
                          precision=self.precision, loss=self.loss_options,
                          world_size=self.env.world_size, clip_norm=cfg.clip_norm,
                          half=self.half)
        stats = torch.stack([step.loss_sum, step.nll_sum])
        if self.env.active:
            stats = torch.cat([stats, self.readback.flags_on_device(flags)])
            torch.distributed.all_reduce(stats)
        gnorm = step.grad_norm.float().reshape(1).to(stats.device)
        values = torch.cat([stats, gnorm])  # (2 [+ 3 flags] + 1,)
        skip = nonfinite(values[0], values[-1]) if self.device_skip is not None else None
        return _Launched(update, self.readback.start(values), flags, tgt_tokens,
                         src_tgt_tokens, skip, rng_before)

    def _apply(self, launched: _Launched) -> None:
        """Step the optimizer for `launched`, or skip it where its loss or gradient norm is
        not finite, and clear its gradients: decided by the host from its numbers where
        they are read at once, else on the device, before the host has them."""
        if self.device_skip is None:
            apply_update(self.optimizer, self.scaler, launched.finite())
        else:
            assert launched.skip is not None
            self.device_skip.apply_update(self.optimizer, self.scaler, launched.skip)
        if self.half is not None:  # the new weights into the bf16 copy
            self.half.refresh()

    def _settle(self, launched: _Launched, run: _Run, rng: dict[str, Any] | None) -> bool:
        """The host's part of an update, in order: read its statistics; advance the
        schedule and weight average if it was applied; count it; log, validate and save
        when due (`rng`: see `_save`). True: stop training."""
        cfg, summary = self.train_cfg, run.summary
        values = launched.stats.values()  # the update's one host sync (or `_apply`'s)
        loss, nll, gnorm = values[0], values[1], values[-1]
        save_flag, stop_flag, preempt_flag, elapsed = (values[2:-1] if self.env.active
                                                       else launched.flags)
        if preempt_flag:
            run.preempted = True
            save_flag = stop_flag = 1.0
        finite = launched.finite()

        self.data_state = launched.update.after
        lr = self.schedule.lr  # what this update used; the next one's is set below
        progress = budget_progress(cfg, self.step + 1, elapsed, self.data_state.epoch,
                                   self.data_state.index, self.epoch_batches.size)
        used_dropout = self.dropout_factor  # what this update used
        advance(self.schedule, self.ema, finite, progress)
        self._schedule_dropout()

        run.window.add(finite, loss, nll, launched.tgt_tokens, launched.src_tgt_tokens)
        if finite:
            self.step += 1
            run.streak = 0
            summary.losses.append(loss / launched.tgt_tokens)
        else:
            run.streak += 1
            summary.skipped_updates += 1
            self.log.say(f"update {self.step + 1}: non-finite loss or gradient; "
                         f"step skipped ({summary.skipped_updates} so far)")
            if run.streak >= cfg.max_nonfinite_in_a_row:
                raise TrainingAborted(
                    f"{run.streak} updates in a row had a non-finite loss or gradient; "
                    f"stopped at update {self.step} (last checkpoint intact); lower "
                    "--lr-scale, use --clip-norm or --precision bf16/fp32")
        self.log.advance(self.step, run.elapsed())

        if finite and self.step % cfg.log_interval == 0:
            self.log.train(run.window, self.scaler, run.elapsed(), step=self.step,
                           epoch=self.data_state.epoch, lr=lr, progress=progress,
                           grad_norm=gnorm, update_freq=self.update_freq,
                           world_size=self.env.world_size,
                           skipped_updates=summary.skipped_updates,
                           skipped_pairs=summary.skipped_pairs,
                           **self._dropout_fields(used_dropout))
            run.window = LogWindow()
        if finite and self.step % cfg.valid_interval == 0:
            summary.valid = self._validate(run.elapsed())
            if self.best.exhausted:
                summary.stopped_early = stop_flag = True
                self.log.say(self.best.stop_note(self.step))
        if cfg.save_interval_updates and finite and self.step % cfg.save_interval_updates == 0:
            self._save(run, rng=rng)  # the evenly spaced checkpoints averaging uses
        elif save_flag:  # by time: with update-spaced saves, only insurance against a crash
            self._save(run, resume_only=bool(cfg.save_interval_updates), rng=rng)
        return bool(stop_flag)

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
                write_best(self.run_dir, self._training(), step=self.step,
                           score=metrics[self.best.metric],
                           model_config=self.model_cfg.to_dict(), vocab=self.vocab.proto,
                           meta=self.meta)
        self.log.valid(self.step, self.data_state.epoch, metrics, self.best, improved, elapsed)
        return metrics

    def _save(self, run: _Run, resume_only: bool = False,
              rng: dict[str, Any] | None = None) -> None:
        """Save a checkpoint now (`resume_only`: checkpoint_last.pt alone, see
        write_resume_point) and remember it in `run`. `rng`: the RNG state to record, on
        the deferred read-back as it was before the dropout of an update launched after
        this one (see `_launch`); None: as it is now."""
        path = save_training(self.env, self.run_dir, self._training(), step=self.step,
                             data_state=self.data_state, rng=rng,
                             model_config=self.model_cfg.to_dict(),
                             train_config=self.train_cfg.to_dict(), vocab=self.vocab.proto,
                             meta=self.meta, elapsed_seconds=run.elapsed(),
                             keep_last=self.train_cfg.keep_last, resume_only=resume_only)
        if path is not None:
            what = "; resume point only" if resume_only else ""
            self.log.say(f"saved {path} (update {self.step}{what})")
            run.summary.last_checkpoint = path
        if not resume_only:  # the end of training still writes a numbered checkpoint
            run.saved_step = self.step
        run.last_save = time.perf_counter()


def train(data_dir: Path, run_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig,
          device: str = "auto", meta: dict[str, Any] | None = None,
          progress: bool | TrainReporter = True, init_from: Path | None = None,
          reset_optimizer: bool = False, tensorboard: Path | None = None) -> TrainSummary:
    """Train (or resume, if RUN/checkpoint_last.pt exists) and return where it stopped.
    A new run starts from `init_from`'s model when given (fine-tuning); with `tensorboard`
    the log records also go there as TensorBoard events."""
    return Trainer(data_dir, run_dir, model_cfg, train_cfg, device, meta, progress,
                   init_from, reset_optimizer, tensorboard).run()
