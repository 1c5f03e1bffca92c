"""DDP with gloo on the CPU: 2 processes with max-tokens T make the same updates as 1 process
with update-freq 2 on the same batches; a run whose only checkpoint falls on its last update
ends cleanly on every rank (it hung or failed before); a resume that a rank cannot follow
(run directory not shared between nodes) stops every rank with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers.data import make_copy_data

from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.errors import NmtError
from nmt.train.log import read_jsonl
from nmt.train.loop import train

MODEL = model_preset("tiny", dropout=0.0)  # ranks draw different dropout masks otherwise


def _cfg(update_freq: int, half: bool = False) -> TrainConfig:
    return TrainConfig(max_updates=3, max_tokens=256, update_freq=update_freq, warmup=2,
                       max_len=32, log_interval=1, valid_interval=2, save_interval_minutes=0,
                       seed=5, precision="bf16" if half else "fp32",
                       half_weights="on" if half else "auto")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, data: str, run: str, half: bool = False
            ) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    train(data, run, MODEL, _cfg(update_freq=1, half=half), "cpu", progress=False)


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


@pytest.mark.slow
def test_two_gloo_ranks_on_a_bf16_copy_track_one_process(tmp_path):
    """--half-weights under DDP: the bf16 copy is what DDP wraps (its gradients all-reduced
    in bf16, then gathered into the fp32 master): the updates of 1 process with update-freq
    2 (whose micro-batches add their gradients in fp32) to bf16 rounding, fp32 weights
    saved. Weights are compared tensor by tensor by the norm of the difference: the keys'
    biases get a gradient of rounding noise alone (a softmax does not see them), which Adam
    turns into steps of the learning rate's size in either direction."""
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    mp.start_processes(_worker, args=(2, _free_port(), str(data), str(tmp_path / "ddp"), True),
                       nprocs=2, join=True, start_method="spawn")
    torch.set_num_threads(1)
    train(data, tmp_path / "one", MODEL, _cfg(update_freq=2, half=True), "cpu",
          progress=False)
    ddp_log = read_jsonl(tmp_path / "ddp" / "train_log.jsonl")
    one_log = read_jsonl(tmp_path / "one" / "train_log.jsonl")
    for a, b in zip(ddp_log, one_log, strict=True):
        key = "loss" if a["kind"] == "train" else "valid_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-2)
    ddp = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")
    one = load_checkpoint(tmp_path / "one" / "checkpoint_last.pt")
    for name, tensor in one["model"].items():
        assert ddp["model"][name].dtype == torch.float32
        gap = (ddp["model"][name] - tensor).norm() / tensor.norm().clamp_min(1e-3)
        keys_bias = name.endswith(("qkv.bias", "kv.bias"))  # 0.045 at most, others 0.004
        assert gap < (0.1 if keys_bias else 0.01), (name, float(gap))


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_save_only_at_the_last_update_ends_every_rank_10_times(tmp_path, nmt_cli):
    """`--max-updates 30 --save-interval-updates 30`: the first checkpoint is written at the
    last update. The end-of-run save used to be decided per rank from RUN's files: rank 1
    looked while rank 0 was still writing, entered the save's collective alone and failed
    (gloo, exit 8) or waited for the 30-minute timeout (NCCL). Ten runs in a row."""
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    for attempt in range(10):
        run = tmp_path / f"run{attempt}"
        start = time.monotonic()
        result = nmt_cli.run(
            "train", str(data), "--arch", "tiny", "--nproc", "2", "--max-updates", "30",
            "--save-interval-updates", "30", "--max-tokens", "512", "-o", str(run), "--device",
            "cpu", "--precision", "fp32")
        took = time.monotonic() - start
        assert result.returncode == 0, f"run {attempt}: exit {result.returncode}\n" \
                                       f"{result.err[-3000:]}"
        assert "error" not in result.err.lower(), result.err[-3000:]
        assert took < 120, f"run {attempt} took {took:.0f} s"
        assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 30
        assert sorted(p.name for p in run.glob("checkpoint_*.pt")) == [
            "checkpoint_30.pt", "checkpoint_last.pt"]


def _resume_worker(rank: int, world: int, port: int, data: str, runs: list[str],
                   out: str) -> None:
    """One rank of a 2-process resume; rank r uses run directory runs[r] (two nodes that
    do or do not share the directory). Records its error line, or 'ok STEP'."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = TrainConfig(**{**_cfg(1).__dict__, "max_updates": 4})
    try:
        summary = train(data, runs[rank], MODEL, cfg, "cpu", progress=False)
        text = f"ok {summary.step} resumed {summary.resumed_from}"
    except NmtError as err:
        text = f"{type(err).__name__}: {err}"
    Path(out, f"rank{rank}.txt").write_text(text)
    Path(out, f"rank{rank}.threads").write_text("\n".join(_thread_names()))


def _thread_names() -> list[str]:
    """This process's thread names (Linux; empty elsewhere)."""
    tasks = Path("/proc/self/task")
    return sorted((t / "comm").read_text().strip() for t in tasks.iterdir()) \
        if tasks.is_dir() else []


@pytest.mark.slow
@pytest.mark.parametrize("rank1_dir", ["shared", "empty", "stale"])
def test_resume_is_decided_by_rank_0_and_refused_where_a_rank_cannot_follow(tmp_path,
                                                                            rank1_dir):
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    torch.set_num_threads(1)
    node0 = tmp_path / "node0"
    train(data, node0, MODEL, _cfg(update_freq=2), "cpu", progress=False)  # update 3
    node1 = {"shared": node0, "empty": tmp_path / "node1", "stale": tmp_path / "node1"}[
        rank1_dir]
    if rank1_dir == "stale":  # another run's checkpoint at another update
        cfg = TrainConfig(**{**_cfg(1).__dict__, "max_updates": 1})
        train(data, node1, MODEL, cfg, "cpu", progress=False)
    # Plain processes, as torchrun starts them (torch.multiprocessing's spawned children
    # end through os._exit after multiprocessing's finalizers; there rank 1 aborted in
    # C++ teardown in about 1 run in 20, never in 110 runs as plain processes).
    port, runs = _free_port(), [str(node0), str(node1)]
    procs = [subprocess.Popen(
        [sys.executable, "-c", "import sys; from test_train_ddp import _resume_worker; "
         f"_resume_worker({rank}, 2, {port}, {str(data)!r}, {runs!r}, {str(tmp_path)!r})"],
        cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO / "tests"), str(REPO)])},
        stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank}: exit {proc.returncode}\n{err[-3000:]}"
    results = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    for rank in (0, 1):  # the process group is gone once train() returns or raises: gloo
        # threads alive at interpreter exit aborted the process now and then (SIGABRT)
        threads = (tmp_path / f"rank{rank}.threads").read_text()
        assert "gloo" not in threads and "tcpstore" not in threads, threads
    if rank1_dir == "shared":
        assert results == ["ok 4 resumed 3", "ok 4 resumed 3"]
        return
    for text in results:  # every rank stops, with the same one-line reason
        assert text.startswith("DistributedError: rank 1 cannot resume from "), text
        assert "(update 3)" in text and "file system every node shares" in text, text
        assert "\n" not in text
    assert load_checkpoint(node0 / "checkpoint_last.pt")["step"] == 3  # nothing written


def test_launcher_flags_are_stripped_for_the_children_and_one_process_needs_no_group() -> None:
    """Without processes: the relaunched children get ARGV minus the launcher's own flags
    (torchrun would take `--nproc` for its --nproc-per-node), in both spellings; a single
    process (no WORLD_SIZE) runs no collective: broadcast and gather return its own."""
    from nmt.train.distributed import (
        DistEnv,
        broadcast_object,
        gather_objects,
        strip_launch_flags,
    )

    argv = ["train", "data", "--nproc", "2", "-o", "run", "--gpus=2", "--nnodes", "2",
            "--rdzv-endpoint=host:29500", "--max-updates", "3", "--arch", "tiny"]
    assert strip_launch_flags(argv) == ["train", "data", "-o", "run", "--max-updates", "3",
                                        "--arch", "tiny"]
    env = DistEnv()
    assert not env.active and env.is_main
    assert broadcast_object(env, {"resume": 6}) == {"resume": 6}
    assert gather_objects(env, "state") == ["state"]
