"""CUDA-only checks of the training and translation path (marker `gpu`; skipped with a
reason on a machine without a GPU). The CPU-side tests of the same bugs (RNG state from
another device, end-of-run save under DDP, resume decided by rank 0) run everywhere; these
exercise the real device. Run on a GPU machine: `.venv/bin/python -m pytest -m gpu`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.data import make_copy_data

from nmt.checkpoint import load_checkpoint
from nmt.config import DecodeConfig, TrainConfig, model_preset
from nmt.data.batching import Batch
from nmt.train.feed import to_device
from nmt.train.log import read_jsonl
from nmt.train.loop import Trainer, train
from nmt.train.state import restore_rng

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible on this machine)")]

MODEL = model_preset("tiny", dropout=0.1)


def _cfg(**overrides) -> TrainConfig:
    base = dict(max_updates=8, max_tokens=256, warmup=4, max_len=32, log_interval=1,
                valid_interval=4, save_interval_minutes=0, save_interval_updates=4, seed=3)
    return TrainConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_copy_data(tmp_path_factory.mktemp("cuda") / "data", n_train=300, n_valid=20)


def test_default_precision_on_cuda_is_bf16(data, tmp_path):
    trainer = Trainer(data, tmp_path / "run", MODEL, _cfg(), "cuda", progress=False)
    want = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert trainer.precision == want and trainer.device.type == "cuda"


def test_a_fresh_process_choosing_cuda_gets_expandable_segments():
    """In a new process (as `nmt train` starts; in this one earlier tests have initialised
    CUDA, after which the allocator no longer reads the variable)."""
    code = ("import os, torch; from nmt.device import resolve_device; "
            "d = resolve_device('cuda'); torch.zeros(1, device=d); "
            "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, timeout=120).stdout
    assert out.strip() == "expandable_segments:True"


def test_to_device_takes_host_and_device_batches(data):
    """The feed's pinned host batches, and one already on the GPU (nothing to pin)."""
    host = Batch(torch.tensor([[5, 6, 2]]), torch.tensor([[1, 5, 6]]),
                 torch.tensor([[5, 6, 2]]), 3, 3)
    on_gpu = Batch(*(t.cuda() for t in (host.src, host.tgt_in, host.tgt_out)), 3, 3)
    for batch in (host, on_gpu):
        micro = to_device(batch, has_pad=False, select=torch.tensor([0, 2]),
                          device=torch.device("cuda"))
        assert micro.batch.src.is_cuda and micro.target.tolist() == [5, 2]


def test_resume_on_cuda_continues_the_run(data, tmp_path):
    """Kill-free resume on the GPU: 4 + 4 updates end where 8 in one go end."""
    whole = train(data, tmp_path / "whole", MODEL, _cfg(precision="fp32"), "cuda",
                  progress=False)
    train(data, tmp_path / "split", MODEL, _cfg(precision="fp32", max_updates=4), "cuda",
          progress=False)
    split = train(data, tmp_path / "split", MODEL, _cfg(precision="fp32"), "cuda",
                  progress=False)
    assert split.resumed_from == 4 and split.step == whole.step == 8
    a = read_jsonl(tmp_path / "whole" / "train_log.jsonl")
    b = read_jsonl(tmp_path / "split" / "train_log.jsonl")
    for x, y in zip(a, b, strict=True):
        key = "loss" if x["kind"] == "train" else "valid_loss"
        assert x[key] == pytest.approx(y[key], rel=1e-3, abs=1e-3)


def test_checkpoint_mapped_onto_the_gpu_restores_every_rng(data, tmp_path):
    train(data, tmp_path / "run", MODEL, _cfg(max_updates=2), "cuda", progress=False)
    payload = load_checkpoint(tmp_path / "run" / "checkpoint_last.pt", map_location="cuda")
    restore_rng(payload["rng"][0])  # tensors on the GPU: the bug this guards against


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_tracks_cpu_fp32(data, tmp_path, precision):
    cfg = _cfg(max_updates=30, save_interval_updates=0, valid_interval=30)
    train(data, tmp_path / "cpu", MODEL, TrainConfig(**{**cfg.__dict__, "precision": "fp32"}),
          "cpu", progress=False)
    summary = train(data, tmp_path / precision, MODEL, TrainConfig(
        **{**cfg.__dict__, "precision": precision}), "cuda", progress=False)
    assert summary.step == 30
    gpu = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / precision / "train_log.jsonl")
           if r["kind"] == "train"}
    ref = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "cpu" / "train_log.jsonl")
           if r["kind"] == "train"}
    tail = sorted(gpu)[15:]
    assert sum(abs(gpu[s] - ref[s]) for s in tail) / len(tail) < 0.15


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_translate_on_cuda_keeps_lines_and_agrees_with_cpu(data, tmp_path, precision):
    from nmt.inference.translate import Engine

    train(data, tmp_path / "run", MODEL, _cfg(max_updates=40, save_interval_updates=0),
          "cpu", progress=False)
    model = tmp_path / "run" / "checkpoint_last.pt"
    cfg = DecodeConfig()
    sources = [[5 + (i * 7 + j) % 40 for j in range(3 + i % 9)] for i in range(50)]
    cpu = Engine.load([model], cfg, "cpu", "fp32").translate_ids(sources)
    gpu = Engine.load([model], cfg, "cuda", precision).translate_ids(sources)
    assert len(gpu) == len(sources)
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(cpu, gpu, strict=True))
    assert same >= (50 if precision == "fp32" else 40), same
