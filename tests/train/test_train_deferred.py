"""The deferred read-back of `nmt train`, run on the CPU.

On CUDA the Trainer queues each update's optimizer step behind its backward, with the
skip of a non-finite update decided on the device (`DeviceSkip`: GradScaler's check
handed to fused Adam), and reads the update's statistics only once the next update is
queued. `Trainer(..., deferred=True)` runs that order on a CPU; these tests hold it to the
immediate order's results exactly (same losses, weights, optimizer state, checkpoints and
RNG), through validation, EMA, saves, skipped updates, preemption and resume.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from helpers.data import make_copy_data

import nmt.train.loop as loop
import nmt.train.step as step
from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.errors import Preempted
from nmt.train.log import read_jsonl
from nmt.train.readback import Pending, Readback
from nmt.train.schedule import build_optimizer, load_optimizer_state, total_norm
from nmt.train.step import DeviceSkip, apply_update, nonfinite

MODEL = model_preset("tiny", dropout=0.1)  # dropout on: the RNG must line up too


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    return make_copy_data(tmp_path_factory.mktemp("data") / "copy", n_train=90, n_valid=20)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _cfg(**overrides) -> TrainConfig:
    base = dict(max_updates=11, max_tokens=256, update_freq=2, warmup=4, max_len=32,
                log_interval=1, valid_interval=3, save_interval_minutes=0,
                save_interval_updates=4, ema_decay=0.9, seed=3, precision="fp32")
    base.update(overrides)
    return TrainConfig(**base)


def _trainer(data, run, cfg, deferred: bool) -> loop.Trainer:
    """A CPU Trainer (fused Adam, as on CUDA) reading its statistics deferred or at once."""
    trainer = loop.Trainer(data, run, MODEL, cfg, "cpu", progress=False, deferred=deferred)
    assert trainer.readback.deferred is deferred
    assert trainer.optimizer.param_groups[0]["fused"] is True
    return trainer


def _equal(a, b) -> bool:
    """Deep equality of checkpoint payloads, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _same_checkpoint(a, b) -> None:
    for key in ("step", "model", "optimizer", "scheduler", "rng", "data_state", "ema",
                "best"):
        assert _equal(a[key], b[key]), key


def _records(run):
    """The log without its clock readings."""
    drop = {"wall_time", "elapsed_minutes", "tokens_per_s", "seconds"}
    return [{k: v for k, v in r.items() if k not in drop}
            for r in read_jsonl(run / "train_log.jsonl")]


def test_deferred_path_trains_exactly_like_the_in_line_path(copy_data, tmp_path):
    runs = {}
    for deferred in (False, True):
        run = tmp_path / str(deferred)
        runs[deferred] = (_trainer(copy_data, run, _cfg(), deferred).run(), run)
    (a, run_a), (b, run_b) = runs[False], runs[True]
    assert a.step == b.step == 11 and a.losses == b.losses and a.valid == b.valid
    assert _records(run_a) == _records(run_b)
    for name in ("checkpoint_4.pt", "checkpoint_8.pt", "checkpoint_11.pt"):
        _same_checkpoint(load_checkpoint(run_a / name), load_checkpoint(run_b / name))


def test_the_optimizer_is_queued_before_the_statistics_are_read(copy_data, tmp_path,
                                                                 monkeypatch):
    """Update k's optimizer step is launched before its numbers are read, and update
    k + 1's forward and backward are queued before that read too."""
    events: list[str] = []
    counts = {"fb": 0, "opt": 0}
    real_step, real_apply, real_values = loop.train_step, DeviceSkip.apply_update, Pending.values

    def train_step(*args, **kwargs):
        counts["fb"] += 1
        events.append(f"fb{counts['fb']}")
        return real_step(*args, **kwargs)

    def apply(*args, **kwargs):
        counts["opt"] += 1
        events.append(f"opt{counts['opt']}")
        return real_apply(*args, **kwargs)

    def values(self):
        if self._values is None:
            events.append("read")
        return real_values(self)

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(DeviceSkip, "apply_update", apply)
    monkeypatch.setattr(Pending, "values", values)
    _trainer(copy_data, tmp_path / "r", _cfg(max_updates=4, valid_interval=100,
                                             save_interval_updates=0), True).run()
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == 4
    for k, at in enumerate(reads, start=1):
        assert events.index(f"opt{k}") < at
        if k < 4:
            assert events.index(f"fb{k + 1}") < at
    assert events[:5] == ["fb1", "opt1", "fb2", "read", "opt2"]


def _poison(monkeypatch, calls: set[int], bad: float) -> None:
    """At the given (1-based) calls of the reference loss, the loss times NaN (NaN
    gradients too) or plus infinity (an infinite loss, finite gradients)."""
    real = step.label_smoothed_nll
    seen = {"n": 0}

    def poisoned(logits, target, eps, pad):
        seen["n"] += 1
        loss, nll = real(logits, target, eps, pad)
        if seen["n"] not in calls:
            return loss, nll
        return (loss * bad if math.isnan(bad) else loss + bad), nll

    monkeypatch.setattr(step, "label_smoothed_nll", poisoned)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf-loss"])
def test_a_nonfinite_update_is_skipped_on_the_device(copy_data, tmp_path, monkeypatch, bad):
    """Updates 3 and 4 (micro-batch calls 5-8) have non-finite losses: the deferred
    path's fused Adam skips them by itself, its step counters roll back, the schedule and
    EMA do not move, and two more updates run: all exactly as the in-line path decides
    it, also where the gradients stay finite (`DeviceSkip` marks them)."""
    cfg = _cfg(max_updates=6, valid_interval=100, save_interval_updates=0)
    results = {}
    for deferred in (False, True):
        _poison(monkeypatch, {5, 6, 7, 8}, bad)
        run = tmp_path / str(deferred)
        summary = _trainer(copy_data, run, cfg, deferred).run()
        results[deferred] = (summary, load_checkpoint(run / "checkpoint_last.pt"))
    (a, ca), (b, cb) = results[False], results[True]
    assert a.skipped_updates == b.skipped_updates == 2
    assert a.step == b.step == 6 and a.losses == b.losses
    _same_checkpoint(ca, cb)
    steps = {float(s["step"]) for s in cb["optimizer"]["state"].values()}
    assert steps == {6.0}  # Adam counted only the applied updates


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_the_device_skips_exactly_what_the_host_skips(fp16: bool) -> None:
    """`DeviceSkip` and the host's `apply_update` make the same weights, Adam state and
    fp16 loss scale over updates that are applied, skipped for a non-finite gradient, and
    skipped for a non-finite loss whose gradients are finite (the case GradScaler's own
    check would miss); its gate's scale stays 1 after skips, and nothing is left on the
    optimizer."""
    kinds = ["finite", "nan-grad", "inf-loss", "inf-loss", "finite", "finite"]
    results = []
    for device_side in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = build_optimizer(model.parameters(), TrainConfig(), torch.device("cpu"))
        for group in optimizer.param_groups:
            group["lr"] = 0.1
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, enabled=fp16)
        gate = DeviceSkip(torch.device("cpu")) if device_side else None
        for kind in kinds:
            x = torch.ones(2, 4) * (float("nan") if kind == "nan-grad" else 1.0)
            scaler.scale(model(x).sum()).backward()
            scaler.unscale_(optimizer)
            norm = total_norm([p.grad for p in model.parameters()])
            loss = torch.tensor(float("inf") if kind == "inf-loss" else 1.0)
            skip = nonfinite(loss, norm)
            assert bool(skip) == (kind != "finite")
            if gate is None:
                apply_update(optimizer, scaler, finite=not bool(skip))
            else:
                gate.apply_update(optimizer, scaler, skip)
            assert all(p.grad is None for p in model.parameters())
            assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
        results.append((model.state_dict(), optimizer.state_dict(), scaler.state_dict()))
    (weights_a, adam_a, scaler_a), (weights_b, adam_b, scaler_b) = results
    assert _equal(weights_a, weights_b) and _equal(adam_a, adam_b) and scaler_a == scaler_b
    steps = {float(s["step"]) for s in adam_b["state"].values()}
    assert steps == {3.0}  # the three applied updates alone
    if fp16:
        assert scaler_b["scale"] == 2.0 ** 3  # halved once: the NaN gradient overflowed


def test_a_checkpoint_keeps_the_adam_kernel_of_the_process_that_loads_it() -> None:
    """A run saved with foreach Adam (CPU) and resumed where fused Adam runs (CUDA, or the
    deferred path) continues with the fused kernel and device-side step counters, and the
    other way round: torch alone would take the saved kernel choice with the state."""
    model = torch.nn.Linear(4, 3)
    cpu = torch.device("cpu")
    saved = build_optimizer(model.parameters(), TrainConfig(), cpu, fused=False)
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    fused = build_optimizer(model.parameters(), TrainConfig(), cpu, fused=True)
    load_optimizer_state(fused, saved.state_dict())
    assert fused.param_groups[0]["fused"] is True
    assert all(s["step"].dtype == torch.float32 for s in fused.state.values())
    fused.step()
    assert all(float(s["step"]) == 2.0 for s in fused.state.values())
    back = build_optimizer(model.parameters(), TrainConfig(), cpu, fused=False)
    load_optimizer_state(back, fused.state_dict())
    assert back.param_groups[0]["foreach"] is True and not back.param_groups[0]["fused"]
    moments = [s["exp_avg"] for s in back.state.values()]
    assert all(torch.equal(m, fused.state[p]["exp_avg"])
               for m, p in zip(moments, model.parameters(), strict=True))


def test_preempted_deferred_run_resumes_exactly(copy_data, tmp_path, monkeypatch):
    """SIGTERM while update 6 is being settled (update 7 already launched): the flag
    rides with update 8's statistics, so update 8 is saved while update 9, already
    launched, is dropped; the checkpoint holds the RNG as it was before update 9's
    dropout, and the resumed run ends with the weights of a run never interrupted."""
    cfg = _cfg(max_updates=10, valid_interval=100, save_interval_updates=0)
    whole = _trainer(copy_data, tmp_path / "whole", cfg, True).run()

    real_settle = loop.Trainer._settle

    def settle(self, launched, run, rng):
        if self.step == 5:  # settling update 6
            os.kill(os.getpid(), signal.SIGTERM)
        return real_settle(self, launched, run, rng)

    monkeypatch.setattr(loop.Trainer, "_settle", settle)
    run = tmp_path / "cut"
    with pytest.raises(Preempted, match="at update 8"):
        _trainer(copy_data, run, cfg, True).run()
    monkeypatch.setattr(loop.Trainer, "_settle", real_settle)
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 8
    rest = _trainer(copy_data, run, cfg, True).run()
    assert rest.resumed_from == 8 and rest.step == 10
    assert rest.losses == whole.losses[8:]
    _same_checkpoint(load_checkpoint(run / "checkpoint_last.pt"),
                     load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt"))


def test_the_read_back_is_deferred_on_cuda_unless_asked_otherwise() -> None:
    assert Readback(torch.device("cuda", 0)).deferred
    assert not Readback(torch.device("cpu")).deferred
    assert Readback(torch.device("cpu"), deferred=True).deferred
    assert not Readback(torch.device("cuda", 0), deferred=False).deferred
