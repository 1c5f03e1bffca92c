"""One training update as functions: what `nmt train` runs and what the benches time.

`train_step` runs the forward and backward passes of an update's micro-batches and
measures the gradient, with no host synchronisation: its `StepStats` are device tensors.
The update is then applied, or skipped where its loss sum or gradient norm is not finite,
decided where the numbers are: on the host once it has read them (`apply_update`: on a
CPU, where the Trainer reads them at once), or on the device before the host has read
anything (`DeviceSkip`: on CUDA, where the Trainer reads them one update late so that the
GPU never waits). `advance` then moves the schedule and weight average, from the host's
reading. The Trainer keeps everything around it: data feed, ranks, logging, validation
and checkpoints (nmt/train/loop.py).

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
from nmt.train.half import HalfWeights
from nmt.train.linears import Linear
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
    chunks). `project` (not fused; a CPU whose table picks another training linear,
    nmt/train/linears.py): the net returns decoder states and they are projected here with
    that function. Else the net returns logits."""

    label_smoothing: float
    pad_id: int
    fused: bool = False
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    compiled: bool = False
    project: Linear | None = None


# Graphs one compiled model may keep: one per length bucket (nmt/train/buckets.py).
COMPILE_CACHE_SIZE = 32


def compiled(net: nn.Module, cuda_graphs: bool = False) -> nn.Module:
    """`net` (the model or its DDP wrapper) under torch.compile, specialised on each
    length bucket its batches are padded to (the feed's `Shapes`): one graph per bucket,
    rows dynamic; with `cuda_graphs` every shape is static and each bucket's step is
    recorded once as a CUDA graph and replayed (torch.compile's reduce-overhead mode).
    Lengths are never made dynamic behind our back: a new bucket is a new graph.
    Parameters, state dict and DDP's `no_sync` stay those of `net`."""
    import torch._dynamo

    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, COMPILE_CACHE_SIZE)
    dynamo.automatic_dynamic_shapes = False
    return torch.compile(net, mode="reduce-overhead" if cuda_graphs else None,
                         dynamic=False if cuda_graphs else None)


def micro_loss(net: nn.Module, model: Transformer, mb: Micro, opts: LossOptions
               ) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss sum, NLL sum) of one micro-batch, under the caller's autocast.
    `net` is the model or its DDP wrapper; `model` the bare one (its output weight)."""
    own = opts.project is not None and not opts.fused
    out = net(mb.batch.src, mb.batch.tgt_in, has_pad=mb.has_pad, select=mb.select,
              project=not (opts.fused or own))
    vocab = model.config.vocab_size  # the output matrix may have padded rows past it
    if opts.fused:  # out: decoder states (rows, d_model)
        return projected_smoothed_loss(out, model.output_weight, mb.target.reshape(-1),
                                       opts.label_smoothing, pad_id=opts.pad_id,
                                       chunk_rows=opts.chunk_rows, compiled=opts.compiled,
                                       vocab=vocab)
    if own:  # decoder states (rows, d_model) -> logits (rows, vocab)
        out = opts.project(out, model.output_weight, None)
    if out.size(-1) != vocab:
        out = out[..., :vocab]  # (..., vocab): the padded rows' logits left out
    return label_smoothed_nll(out, mb.target, opts.label_smoothing, opts.pad_id)  # logits


def train_step(net: nn.Module, model: Transformer,
               micro: Iterable[Micro | Callable[[], Micro]], *, tgt_tokens: int,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               precision: str, loss: LossOptions, world_size: int = 1,
               clip_norm: float = 0.0, half: HalfWeights | None = None) -> StepStats:
    """Forward and backward over the update's micro-batches (each a Micro, or a callable
    returning one: the feed collates lazily), gradients unscaled and measured (clipped to
    `clip_norm` when > 0). The optimizer is not stepped: see `apply_update` and
    `DeviceSkip`.

    `tgt_tokens`: target tokens of the whole update on this rank's share of the scale
    (world_size / all ranks' tokens is applied per token). With DDP (`net` a
    DistributedDataParallel and world_size > 1), gradients are all-reduced only with the
    last micro-batch's backward.

    `half`: `model` is the bf16 copy of `half.master` (nmt/train/half.py): no autocast, and
    the gradients are gathered into the master's, which are measured and clipped.
    """
    device = model.output_weight.device
    scale = world_size / tgt_tokens
    loss_sum = torch.zeros((), device=device)
    nll_sum = torch.zeros((), device=device)
    net.train()
    items = list(micro)
    wrapped = hasattr(net, "no_sync")  # DDP (its hooks need the copy's `.grad`)
    ddp = world_size > 1 and wrapped
    for i, item in enumerate(items):
        mb = item() if callable(item) else item
        last = i == len(items) - 1
        sync = net.no_sync() if ddp and not last else contextlib.nullcontext()
        with sync:
            with autocast(device, precision) if half is None else contextlib.nullcontext():
                smoothed, nll = micro_loss(net, model, mb, loss)
            scaled = scaler.scale(smoothed * scale)
            if half is not None and not wrapped:
                half.backward(scaled)  # straight into fp32 buffers (nmt/train/half.py)
            else:
                scaled.backward()
        loss_sum += smoothed.detach()
        nll_sum += nll
    if half is not None:
        half.gather()
    scaler.unscale_(optimizer)
    master = model if half is None else half.master
    params = [p for p in master.parameters() if p.grad is not None]
    if clip_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:
        grad_norm = total_norm([p.grad for p in params])
    return StepStats(loss_sum, nll_sum, grad_norm)


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 finite: bool) -> None:
    """Apply the update `train_step` prepared, or skip it where not `finite` (decided on the
    host, which has read its numbers), and clear its gradients. The scaler steps the
    optimizer (disabled, fp32/bf16: a plain step) and adjusts its fp16 loss scale from the
    overflow check of `train_step`'s unscale."""
    if finite:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def nonfinite(loss_sum: Tensor, grad_norm: Tensor) -> Tensor:
    """True where the update's loss sum or gradient norm is not finite, the rule by which
    the Trainer counts an update as skipped: a 0-dim bool device tensor, no host sync."""
    return ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))


class DeviceSkip:
    """Apply an update or skip it on the device, before the host has read its numbers,
    through the public way torch hands a device-side verdict to an optimizer: `GradScaler.
    step` checks the gradients and passes what it found to a fused optimizer, whose kernel
    then does nothing (its step counters rolled back) where something was not finite; no
    host sync. (An optimizer without that kernel is skipped from the host: correct, but a
    sync.)

    The check must skip exactly the updates the host counts as skipped (`nonfinite`). It
    looks at the gradients alone: a gradient that is not finite makes the norm so, and
    where the loss or the norm is not finite with every gradient finite, `apply_update`
    first writes NaN into one gradient (the smallest; they are cleared right after), so
    the check finds what the rule says. This gate's scale stays 1, by which the kernel
    divides the gradients (exactly nothing); fp16's loss scaling stays with the Trainer's
    scaler, which `train_step` unscaled with and which adjusts its scale here.
    """

    def __init__(self, device: torch.device) -> None:
        self._gate = torch.amp.GradScaler(device.type, init_scale=1.0)
        self._gate.scale(torch.ones((), device=device))  # creates its scale on `device`

    def apply_update(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     skip: Tensor) -> None:
        """Step `optimizer` unless `skip` (`nonfinite`'s verdict, on the device), clear its
        gradients, and adjust `scaler`'s fp16 loss scale."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if grads:
            min(grads, key=Tensor.numel).masked_fill_(skip, float("nan"))
        self._gate.step(optimizer)
        self._gate.update(1.0)  # not halved after a skip: it divides the gradients
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def advance(schedule: Schedule | None, ema: WeightAverage | None, finite: bool,
            progress: float = 0.0) -> None:
    """After an applied (`finite`) update: the learning-rate schedule (told the budget's
    `progress`, see nmt/train/schedule.py) and the weight average take their step; a
    skipped update moves neither."""
    if finite:
        if schedule is not None:
            schedule.step(progress)
        if ema is not None:
            ema.update()
