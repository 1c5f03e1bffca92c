"""One training update as a function: what `nmt train` runs and what the benches time.

`train_step` runs the forward and backward passes of an update's micro-batches and
measures the gradient, with no host synchronisation: its `StepStats` are device tensors.
Whether the update is applied is the caller's decision, taken on those numbers (the
Trainer reads them once per update, all-reduced with its save/stop flags, and skips a
non-finite update); `apply_update` then steps the optimizer (through the GradScaler in
fp16), the schedule and the weight average. The Trainer keeps everything around it: data
feed, ranks, logging, validation and checkpoints (nmt/train/loop.py).

The loss of an update is the sum of token losses over all its micro-batches (and ranks)
divided by the target tokens in all of them, counted on the host by the caller; DDP
averages gradients over ranks, so each rank scales by world_size / tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt.model.transformer import Transformer
from nmt.precision import autocast
from nmt.train.ema import WeightAverage
from nmt.train.feed import Micro
from nmt.train.loss import DEFAULT_CHUNK_ROWS, label_smoothed_nll, projected_smoothed_loss
from nmt.train.schedule import Schedule, total_norm


@dataclass
class StepStats:
    """One update's figures, as 0-dim device tensors (reading them syncs the host)."""

    loss_sum: Tensor  # label-smoothed loss summed over the update's target tokens
    nll_sum: Tensor  # negative log-likelihood summed likewise
    grad_norm: Tensor  # L2 norm of all gradients, before clipping


@dataclass(frozen=True)
class LossOptions:
    """How the loss is computed from the decoder. `fused`: the net returns decoder states
    and the output projection runs chunk by chunk inside the loss (never the whole
    (rows, vocab) logits; `chunk_rows` rows per chunk, `compiled`: its torch.compile'd
    chunks); else the net returns logits."""

    label_smoothing: float
    pad_id: int
    fused: bool = False
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    compiled: bool = False


def micro_loss(net: nn.Module, model: Transformer, mb: Micro, opts: LossOptions
               ) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss sum, NLL sum) of one micro-batch, under the caller's autocast.
    `net` is the model or its DDP wrapper; `model` the bare one (its output weight)."""
    out = net(mb.batch.src, mb.batch.tgt_in, has_pad=mb.has_pad, select=mb.select,
              project=not opts.fused)
    if opts.fused:  # out: decoder states (rows, d_model)
        return projected_smoothed_loss(out, model.output_weight, mb.target.reshape(-1),
                                       opts.label_smoothing, pad_id=opts.pad_id,
                                       chunk_rows=opts.chunk_rows, compiled=opts.compiled)
    return label_smoothed_nll(out, mb.target, opts.label_smoothing, opts.pad_id)  # logits


def train_step(net: nn.Module, model: Transformer,
               micro: Iterable[Micro | Callable[[], Micro]], *, tgt_tokens: int,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               precision: str, loss: LossOptions, world_size: int = 1,
               clip_norm: float = 0.0) -> StepStats:
    """Forward and backward over the update's micro-batches (each a Micro, or a callable
    returning one: the feed collates lazily), gradients unscaled and measured (clipped to
    `clip_norm` when > 0). The optimizer is not stepped: see `apply_update`.

    `tgt_tokens`: target tokens of the whole update on this rank's share of the scale
    (world_size / all ranks' tokens is applied per token). With DDP (`net` a
    DistributedDataParallel and world_size > 1), gradients are all-reduced only with the
    last micro-batch's backward.
    """
    device = model.output_weight.device
    scale = world_size / tgt_tokens
    loss_sum = torch.zeros((), device=device)
    nll_sum = torch.zeros((), device=device)
    net.train()
    items = list(micro)
    ddp = world_size > 1 and hasattr(net, "no_sync")
    for i, item in enumerate(items):
        mb = item() if callable(item) else item
        last = i == len(items) - 1
        sync = net.no_sync() if ddp and not last else contextlib.nullcontext()
        with sync:
            with autocast(device, precision):
                smoothed, nll = micro_loss(net, model, mb, loss)
            scaler.scale(smoothed * scale).backward()
        loss_sum += smoothed.detach()
        nll_sum += nll
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:
        grad_norm = total_norm([p.grad for p in params])
    return StepStats(loss_sum, nll_sum, grad_norm)


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 schedule: Schedule | None, precision: str, finite: bool,
                 ema: WeightAverage | None = None) -> None:
    """Apply (or, not `finite`, skip) the update `train_step` prepared: the optimizer
    step (fp16: through the GradScaler, which skips overflowed steps and adjusts its
    scale), gradients cleared, then on success the schedule and the weight average
    advance."""
    if precision == "fp16":
        scaler.step(optimizer)
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if finite:
        if schedule is not None:
            schedule.step()
        if ema is not None:
            ema.update()
