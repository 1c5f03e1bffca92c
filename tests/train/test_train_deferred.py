"""The deferred statistics path of `nmt train`, run on the CPU.

On CUDA the Trainer queues each update's optimizer step behind its backward, with the
skip of a non-finite update decided on the device (fused Adam's `found_inf`), and reads
the update's statistics only once the next update is queued. NMT_DEFER_STATS=1 forces
that path on a CPU; these tests hold it to the in-line path's results exactly (same
losses, weights, optimizer state, checkpoints and RNG), through validation, EMA, saves,
skipped updates, preemption and resume.
"""

from __future__ import annotations

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
from nmt.train.readback import Pending
from nmt.train.schedule import build_optimizer, load_optimizer_state
from nmt.train.step import launch_update, supports_device_skip

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


def _trainer(data, run, cfg, deferred: bool, monkeypatch) -> loop.Trainer:
    """A Trainer with the fused Adam of the deferred path either way (so both paths run
    the same kernel), reading its statistics deferred or in-line."""
    monkeypatch.setenv("NMT_DEFER_STATS", "1")
    trainer = loop.Trainer(data, run, MODEL, cfg, "cpu", progress=False)
    assert trainer.deferred and supports_device_skip(trainer.optimizer)
    trainer.deferred = deferred
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


def test_deferred_path_trains_exactly_like_the_in_line_path(copy_data, tmp_path, monkeypatch):
    runs = {}
    for deferred in (False, True):
        run = tmp_path / str(deferred)
        runs[deferred] = (_trainer(copy_data, run, _cfg(), deferred, monkeypatch).run(), run)
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
    real_step, real_launch, real_values = loop.train_step, loop.launch_update, Pending.values

    def train_step(*args, **kwargs):
        counts["fb"] += 1
        events.append(f"fb{counts['fb']}")
        return real_step(*args, **kwargs)

    def launch(*args, **kwargs):
        counts["opt"] += 1
        events.append(f"opt{counts['opt']}")
        return real_launch(*args, **kwargs)

    def values(self):
        if self._values is None:
            events.append("read")
        return real_values(self)

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(loop, "launch_update", launch)
    monkeypatch.setattr(Pending, "values", values)
    _trainer(copy_data, tmp_path / "r", _cfg(max_updates=4, valid_interval=100,
                                             save_interval_updates=0), True, monkeypatch).run()
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == 4
    for k, at in enumerate(reads, start=1):
        assert events.index(f"opt{k}") < at
        if k < 4:
            assert events.index(f"fb{k + 1}") < at
    assert events[:5] == ["fb1", "opt1", "fb2", "read", "opt2"]


def _poison(monkeypatch, calls: set[int]) -> None:
    """NaN losses at the given (1-based) calls of the reference loss."""
    real = step.label_smoothed_nll
    seen = {"n": 0}

    def poisoned(logits, target, eps, pad):
        seen["n"] += 1
        loss, nll = real(logits, target, eps, pad)
        return (loss * float("nan"), nll) if seen["n"] in calls else (loss, nll)

    monkeypatch.setattr(step, "label_smoothed_nll", poisoned)


def test_a_nonfinite_update_is_skipped_on_the_device(copy_data, tmp_path, monkeypatch):
    """Updates 3 and 4 (micro-batch calls 5-8) have NaN losses: the deferred path's
    fused Adam skips them by itself, its step counters roll back, the schedule and EMA do
    not move, and two more updates run: all exactly as the in-line path decides it."""
    cfg = _cfg(max_updates=6, valid_interval=100, save_interval_updates=0)
    results = {}
    for deferred in (False, True):
        _poison(monkeypatch, {5, 6, 7, 8})
        run = tmp_path / str(deferred)
        summary = _trainer(copy_data, run, cfg, deferred, monkeypatch).run()
        results[deferred] = (summary, load_checkpoint(run / "checkpoint_last.pt"))
    (a, ca), (b, cb) = results[False], results[True]
    assert a.skipped_updates == b.skipped_updates == 2
    assert a.step == b.step == 6 and a.losses == b.losses
    _same_checkpoint(ca, cb)
    steps = {float(s["step"]) for s in cb["optimizer"]["state"].values()}
    assert steps == {6.0}  # Adam counted only the applied updates


def test_launch_update_leaves_the_weights_alone_when_not_finite() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model.parameters(), TrainConfig(), torch.device("cpu"),
                                fused=True)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    launch_update(optimizer, scaler, "fp32", torch.tensor(1.0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert not hasattr(optimizer, "found_inf")  # nothing left behind for the next step
    model(torch.ones(2, 4)).sum().backward()
    launch_update(optimizer, scaler, "fp32", torch.tensor(0.0))
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(float(s["step"]) == 1.0 for s in optimizer.state.values())
    with pytest.raises(AssertionError):  # foreach Adam cannot skip on the device
        foreach = build_optimizer(model.parameters(), TrainConfig(), torch.device("cpu"),
                                  fused=False)
        model(torch.ones(2, 4)).sum().backward()
        launch_update(foreach, scaler, "fp32", torch.tensor(0.0))


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
    assert supports_device_skip(fused) and fused.param_groups[0]["fused"] is True
    assert all(s["step"].dtype == torch.float32 for s in fused.state.values())
    fused.step()
    assert all(float(s["step"]) == 2.0 for s in fused.state.values())
    back = build_optimizer(model.parameters(), TrainConfig(), cpu, fused=False)
    load_optimizer_state(back, fused.state_dict())
    assert not supports_device_skip(back) and back.param_groups[0]["foreach"] is True
    moments = [s["exp_avg"] for s in back.state.values()]
    assert all(torch.equal(m, fused.state[p]["exp_avg"])
               for m, p in zip(moments, model.parameters(), strict=True))


def test_preempted_deferred_run_resumes_exactly(copy_data, tmp_path, monkeypatch):
    """SIGTERM while update 6 is being settled (update 7 already launched): the flag
    rides with update 8's statistics, so update 8 is saved while update 9, already
    launched, is dropped; the checkpoint holds the RNG as it was before update 9's
    dropout, and the resumed run ends with the weights of a run never interrupted."""
    cfg = _cfg(max_updates=10, valid_interval=100, save_interval_updates=0)
    whole = _trainer(copy_data, tmp_path / "whole", cfg, True, monkeypatch).run()

    real_settle = loop.Trainer._settle

    def settle(self, launched, run, rng):
        if self.step == 5:  # settling update 6
            os.kill(os.getpid(), signal.SIGTERM)
        return real_settle(self, launched, run, rng)

    monkeypatch.setattr(loop.Trainer, "_settle", settle)
    run = tmp_path / "cut"
    with pytest.raises(Preempted, match="at update 8"):
        _trainer(copy_data, run, cfg, True, monkeypatch).run()
    monkeypatch.setattr(loop.Trainer, "_settle", real_settle)
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 8
    rest = _trainer(copy_data, run, cfg, True, monkeypatch).run()
    assert rest.resumed_from == 8 and rest.step == 10
    assert rest.losses == whole.losses[8:]
    _same_checkpoint(load_checkpoint(run / "checkpoint_last.pt"),
                     load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt"))


def test_defer_statistics_is_on_for_cuda_and_forced_by_the_environment(monkeypatch):
    monkeypatch.delenv("NMT_DEFER_STATS", raising=False)
    assert step.defer_statistics(torch.device("cuda", 0))
    assert not step.defer_statistics(torch.device("cpu"))
    monkeypatch.setenv("NMT_DEFER_STATS", "0")
    assert not step.defer_statistics(torch.device("cuda", 0))
    monkeypatch.setenv("NMT_DEFER_STATS", "1")
    assert step.defer_statistics(torch.device("cpu"))
