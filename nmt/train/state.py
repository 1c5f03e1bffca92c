"""Training checkpoints: build, write and restore them; capture and restore RNG state.

Everything is stored as tensors, ints, floats, strings, lists and dicts so that
`torch.load(weights_only=True)` reads it back: the python `random` state becomes a list,
numpy's MT19937 key becomes an int64 tensor. RNG states of every rank are kept (gathered
to rank 0 before saving), so a resumed multi-process run draws the same dropout masks.
A resumed run loads its checkpoint onto the CPU (memory-mapped) whatever device it trains
on: `load_state_dict` copies each tensor to its parameter's device, the RNG states must be
CPU tensors anyway, and a GPU never holds the whole payload next to the model.

Checkpoint files are RUN/checkpoint_{step}.pt plus RUN/checkpoint_last.pt, a second name
(hard link) for the newest numbered file, so saving writes each checkpoint once; where the
file system has no hard links, checkpoint_last.pt is an atomic copy. Pruning reads the step
stored inside each file (memory-mapped: the pickled header only, no tensor data), never the
file name. A write killed midway (kill -9, power cut) leaves only a
`.checkpoint_*.pt.*.tmp` temp file and never a torn checkpoint; the next save removes such
leftovers (rank 0 is the run's only checkpoint writer).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt.checkpoint import BEST, LAST, model_payload, save_checkpoint, stored_step
from nmt.errors import CheckpointError
from nmt.fileio import atomic_output, atomic_write_bytes, remove_stale_temps
from nmt.train.best import BestTracker
from nmt.train.distributed import DistEnv, gather_objects
from nmt.train.ema import WeightAverage
from nmt.train.schedule import load_optimizer_state


@dataclass
class Training:
    """What the model, optimizer and friends of one run are: restored in place, saved."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    scaler: torch.amp.GradScaler
    device: torch.device
    ema: WeightAverage | None
    best: BestTracker


@dataclass
class DataState:
    """Where training stands in the data: epoch (1-based) and batches of the epoch's
    shuffled global batch list already consumed (a multiple of the world size)."""

    epoch: int = 1
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        """Plain ints for the checkpoint."""
        return {"epoch": self.epoch, "index": self.index}


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states: torch CPU, python, numpy, and the CUDA generator of its
    own `device` only (one rank, one GPU). Saving every visible GPU's state made a resume
    with fewer visible GPUs fail (IndexError) and gave each rank its neighbours' streams."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if cuda else [],
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                  int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Inverse of `capture_rng`, onto this rank's `device`. A checkpoint from before
    per-device states holds every visible GPU's: the entry of this device's index is used
    when there is one, else the first."""
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and device is not None and device.type == "cuda":
        index = device.index or 0
        torch.cuda.set_rng_state(cuda[index if index < len(cuda) else 0].cpu(), device)
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    # .cpu(): a checkpoint loaded with map_location=<a GPU> has the key on that GPU
    np.random.set_state((name, key.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))


def build_payload(*, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: Any, scaler: torch.amp.GradScaler, step: int,
                  data_state: DataState, rng: list[dict[str, Any]], model_config: dict,
                  train_config: dict, vocab: bytes, meta: dict[str, Any],
                  elapsed_seconds: float) -> dict[str, Any]:
    """The full training checkpoint (see nmt/checkpoint.py for the required keys)."""
    return model_payload(
        step=step, model_config=model_config, vocab=vocab, model=model.state_dict(),
        meta=meta, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
        scaler=scaler.state_dict(), rng=rng, data_state=data_state.to_dict(),
        train_config=train_config, elapsed_seconds=float(elapsed_seconds))


def save_training(env: DistEnv, run_dir: Path, training: Training, *, step: int,
                  data_state: DataState, rng: dict[str, Any] | None, model_config: dict,
                  train_config: dict, vocab: bytes, meta: dict[str, Any],
                  elapsed_seconds: float, keep_last: int, resume_only: bool = False
                  ) -> Path | None:
    """Save a training checkpoint, every rank's RNG gathered to rank 0 (a collective: all
    ranks call it); rank 0 writes it and returns its path, numbered (and
    checkpoint_last.pt) or, `resume_only`, checkpoint_last.pt alone. `rng`: this rank's
    state to record (one captured before a dropout that already ran), None: the current."""
    rngs = gather_objects(env, rng if rng is not None else capture_rng(training.device))
    if not env.is_main:
        return None
    payload = build_payload(
        model=training.model, optimizer=training.optimizer, scheduler=training.schedule,
        scaler=training.scaler, step=step, data_state=data_state, rng=rngs,
        model_config=model_config, train_config=train_config, vocab=vocab, meta=meta,
        elapsed_seconds=elapsed_seconds)
    payload["best"] = training.best.state_dict()
    if training.ema is not None:
        payload["ema"] = training.ema.state_dict()
    if resume_only:
        return write_resume_point(payload, run_dir)
    return write_checkpoint(payload, run_dir, keep_last)


def write_best(run_dir: Path, training: Training, *, step: int, score: float,
               model_config: dict, vocab: bytes, meta: dict[str, Any]) -> None:
    """RUN/checkpoint_best.pt, atomically: the weights in the model now (the averaged ones
    while validating with EMA), a model file for translate, average or --init-from
    (training resumes from checkpoint_last)."""
    best = {"metric": training.best.metric, "score": score, "ema": training.ema is not None}
    payload = model_payload(step=step, model_config=model_config, vocab=vocab,
                            model=training.model.state_dict(), meta={**meta, "best": best})
    save_checkpoint(payload, Path(run_dir) / BEST)


def write_checkpoint(payload: dict[str, Any], run_dir: Path, keep_last: int) -> Path:
    """Save RUN/checkpoint_{step}.pt, make checkpoint_last.pt name it too (atomically),
    prune. Temp files of earlier, killed writes are removed first."""
    run_dir = Path(run_dir)
    path = run_dir / f"checkpoint_{payload['step']}.pt"
    remove_stale_temps(run_dir, "checkpoint_*.pt")  # leftovers of killed writes
    save_checkpoint(payload, path)
    try:
        point_last_at(path)
    except OSError as err:
        raise CheckpointError(f"{run_dir / LAST}: cannot write ({err.strerror or err}); "
                              f"{path} is intact") from err
    prune_checkpoints(run_dir, keep_last)
    return path


def write_resume_point(payload: dict[str, Any], run_dir: Path) -> Path:
    """Save RUN/checkpoint_last.pt alone (atomically), marked `resume_only` in its meta: a
    crash-insurance save between the update-spaced checkpoints, which resumes a run but is
    never one of the checkpoints `nmt average --last N` averages (nmt.average skips it)."""
    path = Path(run_dir) / LAST
    save_checkpoint({**payload, "meta": {**payload.get("meta", {}), "resume_only": True}},
                    path)
    return path


def point_last_at(path: Path) -> None:
    """Make RUN/checkpoint_last.pt the same file as `path`, atomically: a hard link renamed
    over the old name (no bytes copied), or a copy where the file system refuses links."""
    last = path.parent / LAST
    try:
        with atomic_output(last) as tmp:
            tmp.unlink()
            os.link(path, tmp)
        return
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise

    def copy(handle: Any) -> None:
        with path.open("rb") as src:
            shutil.copyfileobj(src, handle, 1 << 22)

    atomic_write_bytes(last, copy)


# What link(2) answers on file systems without hard links (FAT, some FUSE/object stores).
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS,
                  errno.EMLINK, errno.EACCES}


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` numbered checkpoints with the highest stored step."""
    found: list[tuple[int, Path]] = []
    for path in Path(run_dir).glob("checkpoint_*.pt"):
        if path.name in (LAST, BEST):
            continue
        try:
            found.append((stored_step(path), path))
        except Exception:  # a foreign or broken file: leave it alone
            continue
    found.sort()
    removed = [p for _, p in found[:-keep_last]] if keep_last > 0 else []
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def restore_training(payload: dict[str, Any], *, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, scheduler: Any,
                     scaler: torch.amp.GradScaler, rank: int, world_size: int,
                     device: torch.device | None = None) -> DataState:
    """Load weights, optimizer, scheduler, scaler and this rank's RNG (its CUDA stream onto
    `device`); return data position. A run saved by another number of processes resumes
    too: each rank takes rank 0's RNG, reseeded by its rank."""
    missing = [k for k in ("optimizer", "scheduler", "scaler", "rng", "data_state")
               if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint lacks {', '.join(missing)}: not a training "
                              "checkpoint; start a new run directory (-o)")
    model.load_state_dict(payload["model"])
    load_optimizer_state(optimizer, payload["optimizer"])  # this process's Adam kernel
    scheduler.load_state_dict(payload["scheduler"])
    if payload["scaler"]:
        scaler.load_state_dict(payload["scaler"])
    rngs = payload["rng"]
    if len(rngs) == world_size:
        restore_rng(rngs[rank], device)
    else:  # world size changed: batches differ anyway; reseed distinctly per rank
        restore_rng(rngs[0], device)
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,))) + rank)
    data = payload["data_state"]
    return DataState(int(data["epoch"]), int(data["index"]))
