"""Training loop: exact resume, checkpoint contents and pruning, precision, NaN safety."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_fixtures import make_copy_data

import nmt.train.loop as loop
from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.errors import CheckpointError, TrainingAborted
from nmt.train.log import read_jsonl
from nmt.train.loop import derive_update_freq, train


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


def test_resume_refuses_other_model(copy_data, tmp_path):
    train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=1), "cpu", progress=False)
    with pytest.raises(CheckpointError, match="different model config"):
        train(copy_data, tmp_path / "r", model_preset("tiny", d_ff=64), _cfg(max_updates=2),
              "cpu", progress=False)


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
    real = loop.label_smoothed_nll

    def poisoned(logits, target, eps, pad):
        loss, nll = real(logits, target, eps, pad)
        return loss * float("nan"), nll

    monkeypatch.setattr(loop, "label_smoothed_nll", poisoned)
    with pytest.raises(TrainingAborted, match="in a row"):
        train(copy_data, tmp_path / "r", MODEL, _cfg(max_updates=4, max_nonfinite_in_a_row=3),
              "cpu", progress=False)
    monkeypatch.setattr(loop, "label_smoothed_nll", real)
    after = _weights(tmp_path / "r")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert load_checkpoint(tmp_path / "r" / "checkpoint_last.pt")["step"] == 2


def test_batch_tokens_derives_update_freq():
    assert derive_update_freq(TrainConfig(batch_tokens=25000, max_tokens=4096), 1) == 7
    assert derive_update_freq(TrainConfig(batch_tokens=25000, max_tokens=4096), 8) == 1
    assert derive_update_freq(TrainConfig(update_freq=3), 4) == 3
