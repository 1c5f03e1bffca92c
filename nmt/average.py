"""Checkpoint averaging (section 6: base averages the last 5 checkpoints, big the last 20).

`average_state_dicts` is a pure function over state dicts; `average_checkpoints` adds the
file side: safe loading, agreement checks, "last N by the step stored inside each
checkpoint", and an atomic, self-contained output that `nmt translate` loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nmt.checkpoint import (
    BEST,
    LAST,
    load_checkpoint,
    model_payload,
    model_state,
    save_checkpoint,
    stored_step,
)
from nmt.errors import CheckpointError, DataError, UsageError


def average_state_dicts(states: Sequence[Mapping[str, torch.Tensor]],
                        names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating tensors, summed in float64 and cast back.

    float64 (not float32, nor the tensors' own bf16/fp16) makes the mean exact enough that
    averaging k identical checkpoints gives that checkpoint bit for bit; tensors are summed
    one key at a time, so the extra memory is one parameter tensor.

    Keys and shapes must agree (CheckpointError names the first differing file and key);
    non-floating tensors (integer buffers) must be equal and are copied.
    """
    if not states:
        raise UsageError("nothing to average: no checkpoints given")
    names = list(names) if names is not None else [f"#{i}" for i in range(len(states))]
    first = states[0]
    for name, state in zip(names[1:], states[1:], strict=True):
        if set(state) != set(first):
            diff = sorted(set(state) ^ set(first))
            raise CheckpointError(f"{name}: parameter names differ from {names[0]} "
                                  f"(first: {diff[0]}); average checkpoints of one model only")
        for key, tensor in state.items():
            if tensor.shape != first[key].shape:
                raise CheckpointError(f"{name}: {key} has shape {tuple(tensor.shape)} but "
                                      f"{tuple(first[key].shape)} in {names[0]}")
    out: dict[str, torch.Tensor] = {}
    for key, ref in first.items():
        if not torch.is_floating_point(ref):
            for name, state in zip(names[1:], states[1:], strict=True):
                if not torch.equal(state[key], ref):
                    raise CheckpointError(f"{name}: non-float tensor {key} differs from "
                                          f"{names[0]}; cannot average it")
            out[key] = ref.clone()
            continue
        total = torch.zeros(ref.shape, dtype=torch.float64)
        for state in states:
            total += state[key].to(device="cpu", dtype=torch.float64)
        out[key] = (total / len(states)).to(ref.dtype)
    return out


def checkpoint_steps(paths: Sequence[Path]) -> list[tuple[int, Path]]:
    """(stored step, path) of each checkpoint, read cheaply with mmap."""
    return [(stored_step(path), Path(path)) for path in paths]


def last_checkpoints(run_dir: Path, count: int) -> list[Path]:
    """The `count` checkpoints of `run_dir` with the highest stored steps, oldest first.

    The step is read from inside each file, never from its name; `checkpoint_last.pt`
    counts only when no numbered file holds the same step; `checkpoint_best.pt` (a copy of
    the weights of one validation) never does.
    """
    run_dir = Path(run_dir)
    if count < 1:
        raise UsageError(f"--last must be at least 1, got {count}")
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: no such run directory")
    paths = sorted((p for p in run_dir.glob("checkpoint*.pt") if p.name != BEST),
                   key=lambda p: (p.name == LAST,
                                                                  p.name))
    by_step: dict[int, Path] = {}
    for step, path in checkpoint_steps(paths):
        by_step.setdefault(step, path)  # numbered files sort first and win ties
    if len(by_step) < count:
        raise DataError(f"{run_dir}: asked for the last {count} checkpoints but only "
                        f"{len(by_step)} distinct steps are there; lower --last")
    return [by_step[s] for s in sorted(by_step)[-count:]]


def average_checkpoints(paths: Sequence[Path], output: Path,
                        weights: str = "auto") -> dict[str, Any]:
    """Average `paths` into `output` (atomic); returns the written payload's summary.

    Keeps vocab, model_config and meta of the newest input (its training settings go into
    meta as `train_config`, for the exporters' model cards); drops optimizer and other
    training state, so the result is a model file for `translate`, not a resume point.
    `weights`: raw, ema (runs trained with --ema-decay) or auto (ema when every input has
    it, else raw); the output holds the averaged weights as its plain model.
    """
    if not paths:
        raise UsageError("nothing to average: no checkpoints given")
    payloads = [load_checkpoint(p) for p in paths]
    first = payloads[0]
    for path, payload in zip(paths[1:], payloads[1:], strict=True):
        if payload["model_config"] != first["model_config"]:
            diff = sorted(k for k in set(first["model_config"]) | set(payload["model_config"])
                          if first["model_config"].get(k) != payload["model_config"].get(k))
            raise CheckpointError(f"{path}: model_config differs from {paths[0]} "
                                  f"({', '.join(diff)}); average checkpoints of one model only")
        if bytes(payload["vocab"]) != bytes(first["vocab"]):
            raise CheckpointError(f"{path}: vocabulary differs from {paths[0]}; "
                                  "average checkpoints of one training run only")
    names = [str(p) for p in paths]
    if weights == "auto":
        weights = "ema" if all(p.get("ema") for p in payloads) else "raw"
    states = [model_state(p, weights, path) for p, path in zip(payloads, paths, strict=True)]
    model = average_state_dicts(states, names)
    newest = max(payloads, key=lambda p: p["step"])
    meta = dict(newest.get("meta") or {})
    meta["averaged_from"] = [{"path": str(p), "step": int(pl["step"])}
                             for p, pl in zip(paths, payloads, strict=True)]
    meta["averaged_weights"] = weights
    if newest.get("train_config"):  # how the run was trained, for model cards (export)
        meta["train_config"] = newest["train_config"]
    result = model_payload(step=newest["step"], model_config=newest["model_config"],
                           vocab=newest["vocab"], model=model, meta=meta)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(result, Path(output))
    return {"output": str(output), "step": result["step"], "inputs": meta["averaged_from"],
            "weights": weights}
