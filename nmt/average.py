"""Checkpoint averaging (section 6: base averages the last 5 checkpoints, big the last 20).

`average_state_dicts` is a pure function over state dicts; `average_checkpoints` adds the
file side: safe loading, agreement checks, "last N by the step stored inside each
checkpoint", and an atomic, self-contained output that `nmt translate` loads. Files are read
memory-mapped, one at a time and weights only (`_average_files`): averaging big's last 20
training checkpoints (tens of GB with Adam's moments) needs about one model's memory.
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
    averaging k identical checkpoints gives that checkpoint bit for bit. Keys and shapes
    must agree (CheckpointError names the first differing file and key); non-floating
    tensors (integer buffers) must be equal and are copied.
    """
    if not states:
        raise UsageError("nothing to average: no checkpoints given")
    names = list(names) if names is not None else [f"#{i}" for i in range(len(states))]
    for name, state in zip(names[1:], states[1:], strict=True):
        _check_like(state, states[0], name, names[0])
    out: dict[str, torch.Tensor] = {}
    for key, ref in states[0].items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        total = ref.to(device="cpu", dtype=torch.float64, copy=True)
        for state in states[1:]:
            total.add_(state[key].to("cpu"))  # float64 += the tensor's dtype, no copy
        out[key] = total.div_(len(states)).to(ref.dtype)
    return out


def _check_like(state: Mapping[str, torch.Tensor], first: Mapping[str, torch.Tensor],
                name: str, first_name: str) -> None:
    """Same keys, shapes and integer buffers as `first`, else CheckpointError naming the
    file and the key."""
    if set(state) != set(first):
        diff = sorted(set(state) ^ set(first))
        raise CheckpointError(f"{name}: parameter names differ from {first_name} "
                              f"(first: {diff[0]}); average checkpoints of one model only")
    for key, tensor in state.items():
        ref = first[key]
        if tensor.shape != ref.shape:
            raise CheckpointError(f"{name}: {key} has shape {tuple(tensor.shape)} but "
                                  f"{tuple(ref.shape)} in {first_name}")
        if not torch.is_floating_point(ref) and not torch.equal(tensor, ref):
            raise CheckpointError(f"{name}: non-float tensor {key} differs from "
                                  f"{first_name}; cannot average it")


# Files are averaged in passes over PASS_BYTES of the weights each (row blocks of large
# tensors included), at most MAX_PASSES: peak memory is the output (one model) plus, per
# pass, its float64 sums and one file's pages of it, 3 x PASS_BYTES, or (1 + 3 / MAX_PASSES)
# models' weights for a model above MAX_PASSES x PASS_BYTES. Each pass unpickles every
# file's header again (a fraction of a second), so a small model takes one or two passes;
# the weights are read once in all.
PASS_BYTES = 16 * 2**20
MAX_PASSES = 16
Piece = tuple[str, int, int]  # key, first row, end row


def _passes(state: Mapping[str, torch.Tensor]) -> list[list[Piece]]:
    """The floating tensors of `state` cut into row blocks and grouped into passes of at
    most PASS_BYTES each, or 1 / MAX_PASSES of its bytes if that is more (one row may exceed
    either)."""
    floats = {k: v for k, v in state.items() if torch.is_floating_point(v)}
    total = sum(v.numel() * v.element_size() for v in floats.values())
    budget = max(PASS_BYTES, total / MAX_PASSES)
    passes: list[list[Piece]] = [[]]
    size = 0.0
    for key in sorted(floats):
        tensor = floats[key]
        rows = tensor.size(0) if tensor.dim() else 1
        row_bytes = tensor.numel() * tensor.element_size() / max(rows, 1)
        start = 0
        while start < rows:
            room = max(1, int((budget - size) // row_bytes)) if size < budget else 0
            if room == 0:
                passes.append([])
                size = 0.0
                continue
            end = min(rows, start + room)
            passes[-1].append((key, start, end))
            size += (end - start) * row_bytes
            start = end
    return [p for p in passes if p]


def _average_files(paths: Sequence[Path], weights: str) -> dict[str, torch.Tensor]:
    """The mean model state of `paths`, each file memory-mapped and one at a time, pass by
    pass (see PASS_BYTES); only the weights are touched, never the optimizer state."""
    first = model_state(load_checkpoint(paths[0], mmap=True), weights, paths[0])
    out = {key: (torch.empty_like(t, device="cpu") if torch.is_floating_point(t)
                 else t.clone()) for key, t in first.items()}
    plan = _passes(first)
    del first

    def numel(piece: Piece) -> int:
        key, start, end = piece
        return out[key].numel() // max(out[key].size(0), 1) * (end - start) \
            if out[key].dim() else 1

    # One float64 buffer for every pass's sums: allocated once, so passes do not leave
    # freed blocks of different sizes behind in the heap.
    buffer = torch.empty(max(sum(numel(p) for p in pieces) for pieces in plan),
                         dtype=torch.float64)
    for number, pieces in enumerate(plan):
        sums: dict[Piece, torch.Tensor] = {}
        offset = 0
        for piece in pieces:
            key, start, end = piece
            shape = out[key].shape if out[key].dim() == 0 else (end - start,
                                                                  *out[key].shape[1:])
            sums[piece] = buffer[offset:offset + numel(piece)].view(shape)
            offset += numel(piece)
        for index, path in enumerate(paths):
            state = model_state(load_checkpoint(path, mmap=True), weights, path)
            if number == 0:  # every file is checked once, against the output's layout
                _check_like(state, out, str(path), str(paths[0]))
            for piece, total in sums.items():
                key, start, end = piece
                block = state[key] if state[key].dim() == 0 else state[key][start:end]
                if index == 0:
                    total.copy_(block)
                else:
                    total.add_(block)  # float64 += the file's dtype, no copy
            del state  # unmaps the file: its pages leave this process
        for piece, total in sums.items():
            key, start, end = piece
            target = out[key] if out[key].dim() == 0 else out[key][start:end]
            target.copy_(total.div_(len(paths)))
    return out


def checkpoint_steps(paths: Sequence[Path]) -> list[tuple[int, Path]]:
    """(stored step, path) of each checkpoint, read cheaply with mmap."""
    return [(stored_step(path), Path(path)) for path in paths]


def last_checkpoints(run_dir: Path, count: int) -> list[Path]:
    """The `count` checkpoints of `run_dir` with the highest stored steps, oldest first.

    The step is read from inside each file, never from its name; `checkpoint_last.pt`
    counts only when no numbered file holds the same step and it is not a resume point
    alone (a time-based save between update-spaced checkpoints, which would break the
    averaging's spacing); `checkpoint_best.pt` (a copy of the weights of one validation)
    never does.
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
        if path.name == LAST and _resume_only(path):
            continue  # a crash-insurance save between the evenly spaced checkpoints
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
    it, else raw); the output holds the averaged weights as its plain model. Peak memory
    stays near one model's weights however many files are averaged (see PASS_BYTES).
    """
    if not paths:
        raise UsageError("nothing to average: no checkpoints given")
    paths = [Path(p) for p in paths]
    headers = [_header(p) for p in paths]  # step, configs, vocab, whether EMA is there
    first = headers[0]
    for path, header in zip(paths[1:], headers[1:], strict=True):
        if header["model_config"] != first["model_config"]:
            diff = sorted(k for k in set(first["model_config"]) | set(header["model_config"])
                          if first["model_config"].get(k) != header["model_config"].get(k))
            raise CheckpointError(f"{path}: model_config differs from {paths[0]} "
                                  f"({', '.join(diff)}); average checkpoints of one model only")
        if header["vocab"] != first["vocab"]:
            raise CheckpointError(f"{path}: vocabulary differs from {paths[0]}; "
                                  "average checkpoints of one training run only")
    if weights == "auto":
        weights = "ema" if all(h["has_ema"] for h in headers) else "raw"
    model = _average_files(paths, weights)
    newest = max(headers, key=lambda h: h["step"])
    meta = dict(newest["meta"])
    meta.pop("resume_only", None)  # the average is a model file, not a resume point
    meta["averaged_from"] = [{"path": str(p), "step": h["step"]}
                             for p, h in zip(paths, headers, strict=True)]
    meta["averaged_weights"] = weights
    if newest["train_config"]:  # how the run was trained, for model cards (export)
        meta["train_config"] = newest["train_config"]
    result = model_payload(step=newest["step"], model_config=newest["model_config"],
                           vocab=newest["vocab"], model=model, meta=meta)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(result, Path(output))
    return {"output": str(output), "step": result["step"], "inputs": meta["averaged_from"],
            "weights": weights}


def _resume_only(path: Path) -> bool:
    """Whether a checkpoint is marked a resume point only (nmt.train.state)."""
    meta = load_checkpoint(path, mmap=True).get("meta") or {}
    return bool(meta.get("resume_only"))


def _header(path: Path) -> dict[str, Any]:
    """The small parts of a checkpoint, read memory-mapped (weights untouched)."""
    payload = load_checkpoint(path, mmap=True)
    return {"step": int(payload["step"]), "model_config": payload["model_config"],
            "vocab": bytes(payload["vocab"]), "meta": dict(payload.get("meta") or {}),
            "train_config": payload.get("train_config"), "has_ema": bool(payload.get("ema"))}
