"""DDP: 2 gloo processes with max-tokens T make the same updates as 1 process with
update-freq 2 on the same batches."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_train_fixtures import make_copy_data

from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.train.log import read_jsonl
from nmt.train.loop import train

MODEL = model_preset("tiny", dropout=0.0)  # ranks draw different dropout masks otherwise


def _cfg(update_freq: int) -> TrainConfig:
    return TrainConfig(max_updates=3, max_tokens=256, update_freq=update_freq, warmup=2,
                       max_len=32, log_interval=1, valid_interval=2, save_interval_minutes=0,
                       seed=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, data: str, run: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    train(data, run, MODEL, _cfg(update_freq=1), "cpu", progress=False)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_with_update_freq_2(tmp_path):
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    mp.start_processes(_worker, args=(2, _free_port(), str(data), str(tmp_path / "ddp")),
                       nprocs=2, join=True, start_method="spawn")
    torch.set_num_threads(1)
    single = train(data, tmp_path / "one", MODEL, _cfg(update_freq=2), "cpu", progress=False)
    assert single.step == 3
    ddp_log = read_jsonl(tmp_path / "ddp" / "train_log.jsonl")
    one_log = read_jsonl(tmp_path / "one" / "train_log.jsonl")
    assert [r["world_size"] for r in ddp_log if r["kind"] == "train"] == [2, 2, 2]
    for a, b in zip(ddp_log, one_log, strict=True):
        assert a["kind"] == b["kind"] and a["step"] == b["step"]
        key = "loss" if a["kind"] == "train" else "valid_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-5)
    ddp = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")
    one = load_checkpoint(tmp_path / "one" / "checkpoint_last.pt")
    assert ddp["step"] == one["step"] == 3
    assert len(ddp["rng"]) == 2  # every rank's RNG state is kept
    for name, tensor in one["model"].items():
        torch.testing.assert_close(ddp["model"][name], tensor, rtol=1e-4, atol=1e-6)
