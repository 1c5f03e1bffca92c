"""One training update as a function: what `nmt train` runs and what the benches time.

`train_step` runs the forward and backward passes of an update's micro-batches and
measures the gradient, with no host synchronisation: its `StepStats` are device tensors.
Whether the update is applied is decided on those numbers, in one of two ways. On the
host: the caller reads them (the Trainer once per update, all-reduced with its save/stop
flags) and `apply_update` steps the optimizer (through the GradScaler in fp16), the
schedule and the weight average, or skips a non-finite update. On the device (the CUDA
path): `launch_update` steps a fused Adam that skips itself where `nonfinite` says so,
before the host has read anything, and `advance` moves the schedule and weight average
once the host has read the statistics, one update later. The Trainer keeps everything
around it: data feed, ranks, logging, validation and checkpoints (nmt/train/loop.py).

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
from nmt.switches import switch
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


# Graphs one compiled model may keep: one per combination of the forward's flags
# (has_pad, select or not, project), lengths and row counts being dynamic.
COMPILE_CACHE_SIZE = 16


def compiled(net: nn.Module) -> nn.Module:
    """`net` (the model or its DDP wrapper) under torch.compile with dynamic shapes: every
    batch has its own rows and lengths, and specialising on each would recompile at every
    new shape. Parameters, state dict and DDP's `no_sync` stay those of `net`."""
    import torch._dynamo

    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, COMPILE_CACHE_SIZE)
    return torch.compile(net, dynamic=True)


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
                 ema: WeightAverage | None = None, progress: float = 0.0) -> None:
    """Apply (or, not `finite`, skip) the update `train_step` prepared, decided on the
    host: the optimizer step (fp16: through the GradScaler, which skips overflowed steps
    and adjusts its scale), gradients cleared, then on success the schedule (told the
    budget's `progress`) and the weight average advance."""
    if precision == "fp16":
        _scaled_step(optimizer, scaler)
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    advance(schedule, ema, finite, progress)


def _scaled_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    """fp16: the GradScaler steps the optimizer unless the gradients overflowed, and
    adjusts its scale (decided on the device for a fused Adam, on the host otherwise)."""
    scaler.step(optimizer)
    scaler.update()


def nonfinite(loss_sum: Tensor, grad_norm: Tensor) -> Tensor:
    """1.0 where the update's loss or gradient norm is not finite, else 0.0: a 0-dim
    float32 device tensor (the `found_inf` of GradScaler's contract), no host sync."""
    ok = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
    return (~ok).to(torch.float32)


def defer_statistics(device: torch.device) -> bool:
    """Whether the Trainer reads each update's statistics one update late, with the
    optimizer's skip decided on the device (nmt/train/loop.py `Trainer._train_deferred`):
    on CUDA, where waiting for the numbers would idle the GPU between updates. On a CPU
    the work is synchronous anyway, so the in-line path reads them at once.
    NMT_DEFER_STATS=1 or 0 forces the choice (the tests run the CUDA path on CPU processes
    this way)."""
    forced = switch("NMT_DEFER_STATS")
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda"


def launch_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                  precision: str, found_inf: Tensor) -> None:
    """Step the optimizer with the skip decided on the device, so the host need not wait
    for the update's statistics first (the deferred path of nmt/train/loop.py).

    `optimizer` must be a fused Adam (`supports_device_skip`): its kernel does nothing
    and rolls back its step counters where `found_inf` is 1, the contract GradScaler
    uses. fp16 goes through the GradScaler, which passes its own overflow flag the same
    way and updates the scale on the device. The schedule and weight average advance
    later, from the host's reading of the statistics (`advance`)."""
    if precision == "fp16":
        _scaled_step(optimizer, scaler)
    else:
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # already unscaled
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    optimizer.zero_grad(set_to_none=True)


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `launch_update` can skip a step of `optimizer` on the device (fused Adam:
    foreach and per-tensor Adam refuse a `found_inf`)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)


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
