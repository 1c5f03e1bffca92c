"""Training loop: exact resume, checkpoint contents and pruning, precision, NaN safety."""

from __future__ import annotations

import gc
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data import copy_task_pairs, make_copy_data, write_text_data

import nmt.train.loop as loop
import nmt.train.step as step
from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.data.batch_tokens import FillMeter, derive_batching
from nmt.data.batching import batch_by_tokens
from nmt.errors import CheckpointError, TrainingAborted
from nmt.train.log import read_jsonl
from nmt.train.loop import train


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    return make_copy_data(tmp_path_factory.mktemp("data") / "copy", n_train=90, n_valid=20)


def _cfg(**overrides):
    base = dict(max_updates=6, max_tokens=256, update_freq=2, warmup=4, max_len=32,
                log_interval=1, valid_interval=1000, save_interval_minutes=0, seed=3)
    base.update(overrides)
    return TrainConfig(**base)


MODEL = model_preset("tiny", dropout=0.1)  # dropout ON: resume must restore the RNG


def _weights(run):
    return load_checkpoint(run / "checkpoint_last.pt")["model"]


def test_exact_resume(copy_data, tmp_path):
    torch.set_num_threads(1)
    whole = train(copy_data, tmp_path / "a", MODEL, _cfg(max_updates=8), "cpu", progress=False)
    first = train(copy_data, tmp_path / "b", MODEL, _cfg(max_updates=4), "cpu", progress=False)
    second = train(copy_data, tmp_path / "b", MODEL, _cfg(max_updates=8), "cpu", progress=False)
    assert second.resumed_from == 4 and second.step == 8
    assert whole.epoch > 1, "the test should cross an epoch boundary"
    assert first.losses + second.losses == whole.losses  # bit-identical losses
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [r for r in read_jsonl(tmp_path / "b" / "train_log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in log] == list(range(1, 9))
    # Re-running a finished command does nothing more.
    again = train(copy_data, tmp_path / "b", MODEL, _cfg(max_updates=8), "cpu", progress=False)
    assert again.step == 8 and again.losses == []


def test_a_finished_run_holds_no_open_files(copy_data, tmp_path):
    """train() returning releases the memory-mapped data and the logs at once, without
    waiting for the garbage collector: a process that trains many times (a test suite, a
    sweep, a notebook) must not run out of file descriptors."""
    def open_under(folder):
        fds = Path("/proc/self/fd")
        names = (os.readlink(fds / fd) for fd in os.listdir(fds) if (fds / fd).exists())
        return sorted(n for n in names if n.startswith(str(folder)))

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd (Linux) to list open files")
    # The first optimizer of a process imports torch._dynamo, where torch.fx.wrap keeps its
    # caller's frames, and with them that first run, for good: a constant, not a leak.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    gc.disable()  # a reference cycle must not be rescued by a collection mid-test
    try:
        for tensorboard in (None, tmp_path / "tb"):
            if tensorboard is not None:
                pytest.importorskip("tensorboard")
            run = tmp_path / f"run-{tensorboard is not None}"
            train(copy_data, run, MODEL, _cfg(max_updates=2), device="cpu", progress=False,
                  tensorboard=tensorboard)
            assert open_under(copy_data) == [] and open_under(tmp_path) == []
    finally:
        gc.enable()


def test_checkpoint_contents_and_pruning(copy_data, tmp_path):
    train(copy_data, tmp_path / "r", MODEL,
          _cfg(max_updates=5, save_interval_updates=1, keep_last=2), "cpu", progress=False)
    names = sorted(p.name for p in (tmp_path / "r").glob("checkpoint_*.pt"))
    assert names == ["checkpoint_4.pt", "checkpoint_5.pt", "checkpoint_last.pt"]
    payload = load_checkpoint(tmp_path / "r" / "checkpoint_last.pt")
    for key in ("optimizer", "scheduler", "scaler", "rng", "data_state", "train_config",
                "meta", "elapsed_seconds"):
        assert key in payload
    assert payload["step"] == 5 and payload["vocab"] == (copy_data / "spm.model").read_bytes()
    assert set(payload["rng"][0]) == {"torch", "cuda", "python", "numpy"}
    assert payload["scheduler"]["step_count"] == 5


def test_saves_by_updates_keep_the_averaging_spacing(copy_data, tmp_path):
    """With --save-interval-updates, time-based saves only refresh checkpoint_last.pt (a
    resume point), so the numbered checkpoints keep their even spacing for averaging (the
    WMT recipes save every 1,400 / 600 updates, the paper's 10 minutes on P100s); nmt
    average skips a resume-only checkpoint_last.pt and a run resumes from it."""
    from nmt.average import last_checkpoints
    from nmt.train.state import write_resume_point

    torch.set_num_threads(1)
    run = tmp_path / "r"
    cfg = _cfg(max_updates=8, save_interval_updates=3, save_interval_minutes=1e-9)
    train(copy_data, run, MODEL, cfg, "cpu", progress=False)  # a time save at every update
    numbered = sorted(int(p.stem.split("_")[1]) for p in run.glob("checkpoint_[0-9]*.pt"))
    assert numbered == [3, 6, 8]  # by updates, and the end of training
    assert [p.name for p in last_checkpoints(run, 3)] == [
        "checkpoint_3.pt", "checkpoint_6.pt", "checkpoint_8.pt"]
    payload = load_checkpoint(run / "checkpoint_8.pt")
    write_resume_point({**payload, "step": 9}, run)  # as a time save after update 9 would
    assert [p.name for p in last_checkpoints(run, 2)] == ["checkpoint_6.pt",
                                                          "checkpoint_8.pt"]
    assert load_checkpoint(run / "checkpoint_last.pt")["meta"]["resume_only"] is True
    resumed = train(copy_data, run, MODEL, _cfg(**{**cfg.__dict__, "max_updates": 10}),
                    "cpu", progress=False)
    assert resumed.resumed_from == 9 and resumed.step == 10


def test_log_says_what_an_update_really_held(copy_data, tmp_path):
    """--batch-tokens counts padded slots of the longer side; the log gives the real
    (non-padding, EOS included) source and target tokens per update beside it."""
    import io

    from nmt.data.dataset import ParallelData
    from nmt.train.log import PlainReporter

    torch.set_num_threads(1)
    out = io.StringIO()
    train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=3, log_interval=3), "cpu",
          progress=PlainReporter(out))
    record = [r for r in read_jsonl(tmp_path / "r" / "train_log.jsonl")
              if r["kind"] == "train"][0]
    assert record["target_tokens_per_update"] == round(record["target_tokens"] / 3)
    data = ParallelData.open(copy_data, "train")
    mean_ratio = (data.src.lengths + 1).sum() / (data.tgt.lengths + 1).sum()
    assert 0.5 * mean_ratio < record["source_tokens_per_update"] / \
        record["target_tokens_per_update"] < 2 * mean_ratio
    assert (f"| tok/update {record['source_tokens_per_update']}+"
            f"{record['target_tokens_per_update']} |") in out.getvalue()


def test_resume_refuses_other_model(copy_data, tmp_path):
    train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=1), "cpu", progress=False)
    with pytest.raises(CheckpointError, match="different model config"):
        train(copy_data, tmp_path / "r", model_preset("tiny", d_ff=64), _cfg(max_updates=2),
              "cpu", progress=False)


@pytest.mark.isa
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_step_on_cpu(copy_data, tmp_path, precision):
    summary = train(copy_data, tmp_path / precision, MODEL,
                    _cfg(max_updates=2, precision=precision), "cpu", progress=False)
    assert all(math.isfinite(x) for x in summary.losses)
    payload = load_checkpoint(tmp_path / precision / "checkpoint_last.pt")
    assert payload["step"] == 2 - summary.skipped_updates or precision == "fp16"
    if precision == "fp16":
        assert payload["scaler"]["scale"] > 0


def test_nonfinite_loss_never_reaches_weights(copy_data, tmp_path, monkeypatch):
    train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=2), "cpu", progress=False)
    before = _weights(tmp_path / "r")
    real = step.label_smoothed_nll  # the training update calls the loss from there

    def poisoned(logits, target, eps, pad):
        loss, nll = real(logits, target, eps, pad)
        return loss * float("nan"), nll

    monkeypatch.setattr(step, "label_smoothed_nll", poisoned)
    with pytest.raises(TrainingAborted, match="in a row"):
        train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=4, max_nonfinite_in_a_row=3),
              "cpu", progress=False)
    monkeypatch.setattr(step, "label_smoothed_nll", real)
    after = _weights(tmp_path / "r")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert load_checkpoint(tmp_path / "r" / "checkpoint_last.pt")["step"] == 2


def test_batch_tokens_derives_update_freq_and_micro_batch_size():
    """--batch-tokens is the update's size on any number of processes; --max-tokens caps
    a micro-batch: the paper's 25,000 on 1 and on 8 GPUs. Without the training lengths
    (the benches' shapes) nothing is measured: the fill is taken as 1, so B counts padded
    slots (with lengths: `test_batch_tokens_counts_real_tokens_per_side`)."""
    one = derive_batching(TrainConfig(batch_tokens=25000, max_tokens=4096), 1)
    assert one.fill is None
    assert (one.update_freq, one.micro_tokens) == (7, 3572)  # 7 x 3572 = 25,004
    eight = derive_batching(TrainConfig(batch_tokens=25000, max_tokens=12000), 8)
    assert (eight.update_freq, eight.micro_tokens) == (1, 3125)  # not 8 x 12000
    big_cap = derive_batching(TrainConfig(batch_tokens=25000, max_tokens=12000), 1)
    assert (big_cap.update_freq, big_cap.micro_tokens) == (3, 8334)
    for world in range(1, 17):
        for cap in (1024, 3000, 4096, 12000, 30000):
            got = derive_batching(TrainConfig(batch_tokens=25000, max_tokens=cap), world)
            assert got.micro_tokens <= cap
            per_update = world * got.update_freq * got.micro_tokens
            assert 25000 <= per_update < 25000 + world * got.update_freq
    tiny = derive_batching(TrainConfig(batch_tokens=300, max_tokens=256, max_len=128), 4)
    assert tiny.micro_tokens == 128  # never below --max-len: long pairs still fit
    plain = derive_batching(TrainConfig(update_freq=3, max_tokens=999), 4)
    assert (plain.update_freq, plain.micro_tokens) == (3, 999)


def _uneven_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """Copy-task pairs of 3-20 words whose target keeps only the first half to all of the
    source's words: the sides differ in length, as real ones do, so the padded slots of
    the longer side overstate the real tokens per side."""
    rng = random.Random(seed)
    pairs = []
    for src, _ in copy_task_pairs(n, seed, max_len=20):
        words = src.split()
        pairs.append((src, " ".join(words[:rng.randint((len(words) + 1) // 2, len(words))])))
    return pairs


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory):
    return write_text_data(tmp_path_factory.mktemp("data") / "uneven",
                           {"train": _uneven_pairs(600, 1), "valid": _uneven_pairs(20, 2)},
                           vocab_size=360)


def _real_per_side(src: np.ndarray, tgt: np.ndarray, batches: list[np.ndarray]) -> float:
    """Mean real tokens per side, (source + target) / 2 with EOS, of one micro-batch."""
    return float(np.mean([(src[b] + tgt[b] + 2).sum() / 2 for b in batches]))


def test_fill_meter_counts_the_batches_batch_by_tokens_builds():
    """The fill is measured on the very batches training builds (pairs over --max-len
    skipped), from sorted costs alone."""
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, 3000)
    tgt = np.clip(src + rng.integers(-8, 9, 3000), 1, None)
    meter = FillMeter(src, tgt, max_len=48)
    for micro in (48, 50, 97, 256, 1000, 4096):
        built = batch_by_tokens(src, tgt, micro, 48).batches
        real = sum(int((src[b] + tgt[b] + 2).sum()) for b in built)
        assert meter.batch_count(micro) == (len(built), real)
        assert meter.fill(micro) == pytest.approx(real / 2 / (len(built) * micro))


def test_batch_tokens_counts_real_tokens_per_side(uneven_data, tmp_path):
    """--batch-tokens B: an update holds about B real tokens per side, (source + target
    tokens) / 2 without padding, on 1, 2 or 8 processes from the same lengths. Counted in
    padded slots of the longer side (before), these updates held 14-17 % fewer."""
    import io

    from nmt.data.dataset import ParallelData
    from nmt.train.log import PlainReporter

    batch, cap, max_len = 1024, 256, 32
    data = ParallelData.open(uneven_data, "train")
    src, tgt = data.src.lengths, data.tgt.lengths
    cfg = _cfg(max_updates=100, max_epochs=1, max_tokens=cap, max_len=max_len,
               batch_tokens=batch, update_freq=1)
    for world in (1, 2, 8):
        shape = derive_batching(cfg, world, src, tgt)
        assert shape == derive_batching(cfg, world, src, tgt)  # resume re-derives it
        assert max_len <= shape.micro_tokens <= cap
        built = batch_by_tokens(src, tgt, shape.micro_tokens, max_len).batches
        assert shape.fill == pytest.approx(_real_per_side(src, tgt, built)
                                           / shape.micro_tokens)
        per_update = world * shape.update_freq * _real_per_side(src, tgt, built)
        assert per_update == pytest.approx(batch, rel=0.03), (world, shape)

    # What training logs: one epoch on one process, every full update.
    torch.set_num_threads(1)
    out = io.StringIO()
    train(uneven_data, tmp_path / "r", MODEL, cfg, "cpu", progress=PlainReporter(out))
    shape = derive_batching(cfg, 1, src, tgt)
    full = len(batch_by_tokens(src, tgt, shape.micro_tokens, max_len).batches) \
        // shape.update_freq  # the epoch's last update may hold fewer micro-batches
    records = [r for r in read_jsonl(tmp_path / "r" / "train_log.jsonl")
               if r["kind"] == "train"][:full]
    assert full >= 5 and len(records) == full
    assert all(r["update_freq"] == shape.update_freq for r in records)
    per_side = [(r["source_tokens_per_update"] + r["target_tokens_per_update"]) / 2
                for r in records]
    assert float(np.mean(per_side)) == pytest.approx(batch, rel=0.03), per_side
    assert (f"1 process(es) x max-tokens {shape.micro_tokens} x update-freq "
            f"{shape.update_freq} (derived from --batch-tokens {batch} real tokens per "
            f"side: micro-batches measured {100 * shape.fill:.1f} % full, about ") \
        in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("update_freq, max_epochs", [(2, 0), (1, 3)])
def test_prefetching_the_next_update_changes_nothing(copy_data, tmp_path, update_freq,
                                                     max_epochs):
    """The CUDA path prepares the next update's batches on a thread while the current one
    computes; forced on here, it gives the weights, log and data position of the in-line
    CPU path, across epoch ends and an epoch limit."""
    torch.set_num_threads(1)
    cfg = _cfg(max_updates=40, update_freq=update_freq, max_epochs=max_epochs,
               save_interval_updates=5)
    runs = {}
    for prefetch in (False, True):
        trainer = loop.Trainer(copy_data, tmp_path / str(prefetch), MODEL, cfg, "cpu",
                               progress=False)
        trainer.prefetch = prefetch
        summary = trainer.run()
        runs[prefetch] = (summary, load_checkpoint(tmp_path / str(prefetch) /
                                                   "checkpoint_last.pt"))
    (a, ca), (b, cb) = runs[False], runs[True]
    assert (a.step, a.epoch) == (b.step, b.epoch) and ca["data_state"] == cb["data_state"]
    if max_epochs:
        assert a.step < 40 and ca["data_state"]["epoch"] == max_epochs + 1
    assert a.losses == b.losses
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])


def test_fused_projected_loss_trains_like_the_reference(copy_data, tmp_path):
    """The CUDA path projects and scores the target rows chunk by chunk (never the whole
    logits); forced on over CPU in fp32 it trains to the same losses as the reference loss,
    to float rounding. (Weights are not compared: parameters whose true gradient is zero,
    like the key biases, get rounding noise that Adam scales up to full-size steps either
    way; tests/train/test_projected_loss.py compares the gradients themselves.)"""
    torch.set_num_threads(1)
    cfg = _cfg(max_updates=12, precision="fp32", save_interval_updates=0)
    results = {}
    for fused in (False, True):
        trainer = loop.Trainer(copy_data, tmp_path / str(fused), MODEL, cfg, "cpu",
                               progress=False)
        trainer.fused_loss = fused
        results[fused] = trainer.run()
    assert len(results[True].losses) == 12
    assert results[False].losses == pytest.approx(results[True].losses, rel=1e-4)


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(copy_data, tmp_path):
    """`--compile` (torch.compile, dynamic shapes): the same losses as eager to float
    rounding (dropout off: compiled code draws its own random numbers), no recompilation
    per batch shape, and checkpoints keyed like the bare model's."""
    torch.set_num_threads(1)
    model = model_preset("tiny", dropout=0.0)
    results = {}
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for compile_ in (False, True):
        cfg = _cfg(max_updates=6, precision="fp32", compile=compile_)
        trainer = loop.Trainer(copy_data, tmp_path / str(compile_), model, cfg, "cpu",
                               progress=False)
        assert isinstance(trainer.net, torch._dynamo.eval_frame.OptimizedModule) == compile_
        results[compile_] = trainer.run()
    assert results[False].losses == pytest.approx(results[True].losses, rel=1e-4)
    # One graph per forward flag combination, not one per batch shape.
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    eager, compiled = _weights(tmp_path / "False"), _weights(tmp_path / "True")
    assert eager.keys() == compiled.keys()
