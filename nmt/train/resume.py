"""Where a run starts: from RUN/checkpoint_last.pt when it has one (on any number of
processes), else, with `--init-from`, from another run's model.

Rank 0 alone decides from its disk and broadcasts the update it resumes from and the file
that holds it: the immutable RUN/checkpoint_N.pt where there is one (another node re-opening
checkpoint_last.pt could be shown the previous file by NFS's attribute cache), else
checkpoint_last.pt (a resume point alone). Each rank then loads that file onto the CPU
(memory-mapped) and restores its own RNG stream. A rank that cannot read it, or finds
another update there (a run directory that is not shared between nodes), stops every rank
with one line (exit 8) instead of training from a different state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt.checkpoint import load_checkpoint, model_state
from nmt.config import ModelConfig, TrainConfig
from nmt.data.batch_tokens import Batching, fill_note
from nmt.errors import CheckpointError, DistributedError, NmtError
from nmt.train.distributed import DistEnv, broadcast_object, gather_objects
from nmt.train.ema import WeightAverage
from nmt.train.init_from import check_init_from
from nmt.train.schedule import load_optimizer_state
from nmt.train.state import LAST, DataState, Training, restore_training


@dataclass
class ResumePoint:
    """Where a resumed run goes on from: its update, data position and training time so
    far, its weight average (None without --ema-decay), and what to tell the user."""

    step: int
    data_state: DataState
    elapsed_seconds: float
    ema: WeightAverage | None
    notes: list[str] = field(default_factory=list)


def resume(env: DistEnv, run_dir: Path, model_cfg: ModelConfig, cfg: TrainConfig,
           batching: Batching, training: Training) -> ResumePoint | None:
    """Restore `training` in place from the run's last checkpoint (every rank; see the
    module docstring); None when the run is new."""
    point = None
    payload: dict[str, Any] | None = None
    last = run_dir / LAST
    if env.is_main and last.is_file():
        payload = load_checkpoint(last, map_location="cpu", mmap=True)
        check_same_model(payload, model_cfg, last)
        numbered = run_dir / f"checkpoint_{int(payload['step'])}.pt"
        name = LAST if (payload.get("meta") or {}).get("resume_only") \
            or not numbered.is_file() else numbered.name
        point = (int(payload["step"]), name)
    point = broadcast_object(env, point)
    if point is None:
        return None
    step, name = point
    path = run_dir / name
    problem = None
    if not env.is_main:
        payload, problem = read_resume_point(path, step)
    problems = gather_objects(env, problem)
    bad = [rank for rank, text in enumerate(problems) if text]
    if bad:
        raise DistributedError(
            f"rank {bad[0]} cannot resume from {path}, which rank 0 resumes from "
            f"(update {step}): {problems[bad[0]]}; the run directory must be on a file "
            "system every node shares")
    assert payload is not None
    data_state = restore_training(
        payload, model=training.model, optimizer=training.optimizer,
        scheduler=training.schedule, scaler=training.scaler, rank=env.rank,
        world_size=env.world_size, device=training.device)
    resumed = ResumePoint(step, data_state, float(payload.get("elapsed_seconds", 0.0)),
                          training.ema)
    saved_by = len(payload["rng"])  # one RNG state per process that saved it
    if saved_by != env.world_size:
        resumed.notes.append(world_change_note(cfg, batching, saved_by, env.world_size))
    if resumed.ema is not None:
        if payload.get("ema"):
            resumed.ema.load_state_dict(payload["ema"])
        else:  # EMA switched on for a resumed run: it starts from the current weights
            resumed.ema = WeightAverage(training.model, cfg.ema_decay)
            resumed.notes.append("--ema-decay: the checkpoint has no EMA; the average "
                                 "starts from its weights")
    best = training.best
    if payload.get("best") and not best.load_state_dict(payload["best"]):
        resumed.notes.append(f"--best-metric {best.metric}: the checkpoint tracked "
                             f"{payload['best'].get('metric')}; the best score starts anew")
    return resumed


def check_same_model(payload: dict[str, Any], model_cfg: ModelConfig, path: Path) -> None:
    """Refuse to resume a run of another model shape."""
    if payload.get("model_config") != model_cfg.to_dict():
        raise CheckpointError(f"{path}: holds a run with a different model config; "
                              "use the same flags to resume, or another -o directory")


def read_resume_point(path: Path, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """(payload, None) when `path` holds update `step`, else (None, what is wrong)."""
    try:
        payload = load_checkpoint(path, map_location="cpu", mmap=True)
    except NmtError as err:
        return None, str(err)
    if payload.get("step") != step:
        return None, f"it holds update {payload.get('step')} there"
    return payload, None


def world_change_note(cfg: TrainConfig, batching: Batching, saved_by: int, now: int) -> str:
    """What a resume on another number of processes does to the batch."""
    head = f"resumed a run saved by {saved_by} process(es) on {now}: "
    if cfg.batch_tokens:
        return (head + f"--batch-tokens {cfg.batch_tokens} real tokens per side gives "
                f"update-freq {batching.update_freq} x {batching.micro_tokens} tokens "
                f"per process ({fill_note(batching, now)}), the same batch per "
                "update; this epoch's order is reshuffled")
    return (head + f"each update now holds {now} x update-freq {batching.update_freq} x "
            f"--max-tokens {batching.micro_tokens} tokens, {now}/{saved_by} of "
            "what it held (use --batch-tokens to keep the batch); this epoch's order is "
            "reshuffled")


def initialise_from(path: Path, model_cfg: ModelConfig, vocab_proto: bytes,
                    training: Training, ema_decay: float, reset_optimizer: bool
                    ) -> tuple[WeightAverage | None, str]:
    """Start a new run from another run's model (`--init-from`): its weights (EMA ones
    where it has them), and, unless reset, its optimizer and schedule state. Returns the
    run's weight average (restarted from those weights) and the note to say."""
    payload = load_checkpoint(path, map_location="cpu", mmap=True)
    check_init_from(payload, path, model_cfg, vocab_proto)
    training.model.load_state_dict(model_state(payload, "auto", path))
    continued = not reset_optimizer and all(k in payload for k in ("optimizer",
                                                                    "scheduler"))
    if continued:
        load_optimizer_state(training.optimizer, payload["optimizer"])
        training.schedule.load_state_dict(payload["scheduler"])
        if payload.get("scaler"):
            training.scaler.load_state_dict(payload["scaler"])
    ema = None if training.ema is None else WeightAverage(training.model, ema_decay)
    how = ("optimizer and schedule continued" if continued else
           "fresh optimizer and schedule" + ("" if reset_optimizer else
                                             " (the file has none)"))
    return ema, f"initialised from {path} (update {payload['step']}; {how})"
