"""Resuming where the number of processes or of visible GPUs changed.

- The CUDA RNG state saved is the rank's own device's, restored onto the resuming rank's
  device: a run saved with 8 visible GPUs resumes where 4 are visible (before: every
  visible GPU's state was saved and `set_rng_state_all` raised IndexError). No GPU is
  needed: torch.cuda's RNG calls are replaced by fakes that behave like them.
- gloo, 1 -> 2 and 2 -> 1 processes: the run resumes, --batch-tokens keeps the batch per
  update (update-freq and micro-batch size re-derived from the data's measured fill), and
  the start-up output says so; DDP wraps the model
  without a buffer broadcast per forward and with gradients as bucket views (item 8).
- A rank that reads other data or resolves other settings stops every rank at once with
  one line naming it and the difference (item 4).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.data import make_copy_data

from nmt.config import TrainConfig, model_preset
from nmt.data.batch_tokens import derive_batching
from nmt.data.dataset import ParallelData
from nmt.train.log import PlainReporter, read_jsonl
from nmt.train.loop import train
from nmt.train.state import capture_rng, restore_rng

REPO = Path(__file__).resolve().parents[2]
MODEL = model_preset("tiny", dropout=0.0)


class FakeCudaRng:
    """torch.cuda's RNG functions over `visible` fake devices whose states are one byte
    each; set_rng_state_all sets devices 0..n-1 as torch's does (IndexError past them)."""

    def __init__(self, visible: int) -> None:
        self.visible = visible
        self.states = {i: torch.tensor([10 + i], dtype=torch.uint8) for i in range(visible)}

    def _index(self, device: object) -> int:
        index = torch.device(device).index if device is not None else 0
        if index is None or index >= self.visible:
            raise IndexError(f"no CUDA device {index}")
        return index

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "get_rng_state",
                            lambda device="cuda": self.states[self._index(device)].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all",
                            lambda: [self.states[i].clone() for i in range(self.visible)])

        def set_state(state: torch.Tensor, device: object = "cuda") -> None:
            self.states[self._index(device)] = state.clone()

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: [
            set_state(s, torch.device("cuda", i)) for i, s in enumerate(states)])


def test_cuda_rng_is_the_ranks_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    saving = FakeCudaRng(visible=8)
    saving.install(monkeypatch)
    saved = capture_rng(torch.device("cuda", 5))  # rank 5 of 8, one GPU each
    assert [int(t[0]) for t in saved["cuda"]] == [15]  # its own stream only

    resuming = FakeCudaRng(visible=4)  # 8 -> 4 visible GPUs (or one per process)
    resuming.install(monkeypatch)
    restore_rng(saved, torch.device("cuda", 1))
    assert int(resuming.states[1][0]) == 15  # rank 5's stream, on this rank's device
    assert [int(resuming.states[i][0]) for i in (0, 2, 3)] == [10, 12, 13]  # untouched

    old_format = dict(saved, cuda=[torch.tensor([20 + i], dtype=torch.uint8)
                                   for i in range(8)])  # every visible GPU's, as before
    restore_rng(old_format, torch.device("cuda", 3))
    assert int(resuming.states[3][0]) == 23  # the entry of this device's index
    restore_rng(saved, torch.device("cpu"))  # a CPU run touches no CUDA generator


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cfg(max_updates: int) -> TrainConfig:
    return TrainConfig(max_updates=max_updates, max_tokens=256, batch_tokens=512, warmup=2,
                       max_len=32, log_interval=1, valid_interval=100,
                       save_interval_minutes=0, seed=5, precision="fp32")


def world_worker(rank: int, world: int, port: int, data: str, run: str, updates: int
                 ) -> None:
    """One process of a run of `world` processes to `updates` updates; its start-up
    messages go to stderr (rank 0 prints them)."""
    import nmt.train.distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    real_ddp = nmt.train.distributed.DistributedDataParallel

    def ddp(*args: object, **kwargs: object) -> object:  # how the trainer wraps the model
        print("DDP", sorted(kwargs.items()), file=sys.stderr)
        return real_ddp(*args, **kwargs)

    nmt.train.distributed.DistributedDataParallel = ddp  # type: ignore[misc]
    train(data, run, MODEL, _cfg(updates), "cpu", progress=PlainReporter(sys.stderr))


def _run(world: int, data: Path, run: Path, updates: int) -> str:
    """Run `world` processes (plain processes, as torchrun starts them); rank 0's stderr."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", "from test_train_resume_world import world_worker; "
         f"world_worker({rank}, {world}, {port}, {str(data)!r}, {str(run)!r}, {updates})"],
        cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO / "tests"), str(REPO)])},
        stderr=subprocess.PIPE, text=True) for rank in range(world)]
    errs = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank}: exit {proc.returncode}\n{err[-3000:]}"
        errs.append(err)
    return errs[0]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)])
def test_resume_on_another_number_of_processes_keeps_the_batch(tmp_path: Path, before: int,
                                                               after: int) -> None:
    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    run = tmp_path / "run"
    if before == 1:
        torch.set_num_threads(1)
        train(data, run, MODEL, _cfg(3), "cpu", progress=PlainReporter(io.StringIO()))
    else:
        _run(before, data, run, 3)
    if after == 1:
        torch.set_num_threads(1)
        out = io.StringIO()
        train(data, run, MODEL, _cfg(6), "cpu", progress=PlainReporter(out))
        said = out.getvalue()
    else:
        said = _run(after, data, run, 6)
    if after == 2:  # no buffer broadcast each forward, gradients in DDP's own buckets
        assert "DDP [('device_ids', None), ('forward_sync_buffers', False), " \
               "('gradient_as_bucket_view', True)]" in said, said
        assert "FutureWarning" not in said, said
    # 512 real tokens per side per update, the shape re-derived for each number of
    # processes from the data's measured fill (1 process: more micro-batches than 2 x 256).
    lengths = ParallelData.open(data, "train")
    shape = {world: derive_batching(_cfg(6), world, lengths.src.lengths, lengths.tgt.lengths)
             for world in (1, 2)}
    now = shape[after]
    assert (f"resumed a run saved by {before} process(es) on {after}: --batch-tokens 512 "
            f"real tokens per side gives update-freq {now.update_freq} x {now.micro_tokens} "
            f"tokens per process (micro-batches measured {100 * now.fill:.1f} % full, about "
            f"{after * now.update_freq * now.micro_tokens * now.fill:,.0f} real tokens per "
            "side per update), the same batch per update") in said, said
    records = [r for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [(r["world_size"], r["update_freq"]) for r in records] == \
        [(before, shape[before].update_freq)] * 3 + [(after, now.update_freq)] * 3
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


def mismatch_worker(rank: int, world: int, port: int, data: str, run: str, out: str,
                    smoothing: float) -> None:
    """One rank; rank 1 may see another DATA (`data` is per rank: 'a|b') or setting."""
    from nmt.errors import DistributedError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = TrainConfig(**{**_cfg(3).__dict__,
                         "label_smoothing": smoothing if rank == 1 else 0.1})
    try:
        train(data.split("|")[rank], run, MODEL, cfg, "cpu", progress=False)
        text, code = "trained", 0
    except DistributedError as err:
        text, code = str(err), err.exit_code
    Path(out, f"rank{rank}.txt").write_text(text)
    sys.exit(code)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "expected"), [
    ("settings", "rank 1 differs from rank 0 in its settings: label_smoothing (0.2 vs 0.1)"),
    ("data", "rank 1 differs from rank 0 in its train split (pairs, source tokens, target "
             "tokens) ([199, "),
])
def test_a_rank_that_sees_other_data_or_settings_stops_every_rank(tmp_path: Path, case: str,
                                                                  expected: str) -> None:
    """Rank 0 and rank 1 compare what they read and resolved before training: one line,
    exit 8 on both, at once (before: a hang in a collective, or silently mixed runs)."""
    import time

    data = make_copy_data(tmp_path / "data", n_train=200, n_valid=20)
    other = data if case == "settings" else make_copy_data(tmp_path / "other", n_train=199,
                                                           n_valid=20)
    port, run = _free_port(), tmp_path / "run"
    start = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, "-c", "from test_train_resume_world import mismatch_worker; "
         f"mismatch_worker({rank}, 2, {port}, {str(data) + '|' + str(other)!r}, "
         f"{str(run)!r}, {str(tmp_path)!r}, {0.2 if case == 'settings' else 0.1})"],
        cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO / "tests"), str(REPO)])},
        stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 8, err[-3000:]
    assert time.monotonic() - start < 60
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith(expected) and "\n" not in text, text
    assert not list(run.glob("checkpoint_*.pt"))
