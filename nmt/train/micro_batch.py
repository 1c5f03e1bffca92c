"""The micro-batch a GPU can hold, from its memory (`--max-tokens 0`, the WMT recipes').

A fixed cap sized for the smallest GPU wastes the large ones: base peaked at 6.09 GiB for
8,805 tokens on an H200 of 141 GB, so the recipe's 25,000-token update ran as three
micro-batches, each paying the host's fixed cost per micro-batch. Here the cap comes from
the device: one worst-case micro-batch (rows of --max-len tokens) of `PROBE_TOKENS` is run
forward and backward, its peak above the memory already held gives the bytes per token;
the cap is what fits in `USABLE` of the device's memory beside the weights, gradients and
Adam's state, at most the whole update (`derive_batching` then makes the update one
micro-batch where it fits). One more worst-case batch at the planned size checks it; an
out-of-memory error there shrinks the plan by `SHRINK` and tries again.

On a CPU (host memory is not the limit, the cache is: nmt/train/linears.py) and without
--batch-tokens (the micro-batch is then the update) the cap is `DEFAULT_TOKENS`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nmt.data.batching import Batch
from nmt.model.transformer import Transformer
from nmt.precision import autocast
from nmt.train.feed import to_device
from nmt.train.step import LossOptions, micro_loss

DEFAULT_TOKENS = 4096  # --max-tokens 0 on a CPU or without --batch-tokens
PROBE_TOKENS = 4096  # padded tokens of the probe batch
USABLE = 0.85  # of the device's memory: the rest for the allocator's fragmentation
SHRINK = 0.8  # the plan's factor after an out-of-memory check
STEP = 256  # plans are multiples of this many tokens
ADAM_BYTES = 8  # fp32 first and second moments per parameter, allocated at the first step


@dataclass(frozen=True)
class Plan:
    """A planned micro-batch cap and what it was derived from."""

    micro_tokens: int
    bytes_per_token: float
    static_bytes: int  # held before any batch, Adam's state included
    device_bytes: int

    def describe(self) -> str:
        """For the start-up notes."""
        return (f"micro-batch cap {self.micro_tokens:,} tokens from the device's memory "
                f"({self.bytes_per_token / 2 ** 20:.2f} MiB per token measured, "
                f"{self.static_bytes / 2 ** 30:.1f} GiB of weights and optimizer state, "
                f"{USABLE:.0%} of {self.device_bytes / 2 ** 30:.0f} GiB)")


def plan_cap(device_bytes: int, static_bytes: int, bytes_per_token: float, ceiling: int,
             floor: int) -> int:
    """The most tokens per micro-batch that fit in USABLE of `device_bytes` beside
    `static_bytes`, a multiple of STEP, between `floor` (--max-len: one pair must fit)
    and `ceiling` (the whole update)."""
    room = USABLE * device_bytes - static_bytes
    fits = int(room // bytes_per_token) // STEP * STEP if bytes_per_token > 0 else ceiling
    return max(floor, min(ceiling, fits))


def update_tokens(batch_tokens: int, world_size: int, fill: float = 0.9) -> int:
    """Padded tokens one process needs to hold its share of a `batch_tokens` update in one
    micro-batch, at a fill below what WMT-like batches reach (94.5 %), rounded to STEP."""
    return math.ceil(batch_tokens / (world_size * fill) / STEP) * STEP


def plan_micro_tokens(peak_of: Callable[[int], int], *, device_bytes: int,
                      static_bytes: int, ceiling: int, floor: int,
                      is_oom: Callable[[BaseException], bool], tries: int = 4) -> Plan:
    """Measure and check the cap: `peak_of(tokens)` runs one worst-case micro-batch of
    `tokens` forward and backward and returns its peak memory above what was held
    before (raising out of memory where it does not fit, as told by `is_oom`)."""
    probe = min(PROBE_TOKENS, ceiling)
    per_token = peak_of(probe) / probe
    cap = plan_cap(device_bytes, static_bytes, per_token, ceiling, floor)
    for _ in range(tries):
        try:
            peak_of(cap)
            return Plan(cap, per_token, static_bytes, device_bytes)
        except BaseException as err:
            if not is_oom(err) or cap <= floor:
                raise
            cap = max(floor, int(cap * SHRINK) // STEP * STEP)
    return Plan(cap, per_token, static_bytes, device_bytes)


def plan_on_cuda(model: torch.nn.Module, compute: Transformer, loss: LossOptions,
                 precision: str, half: bool, max_len: int, batch_tokens: int,
                 world_size: int, device: torch.device) -> Plan:
    """`plan_micro_tokens` on a CUDA device for training `compute` (a bf16 copy of `model`
    where `half`, else `model` itself) with `loss`: one process's share of a `batch_tokens`
    update at most, one pair of `max_len` at least."""
    return plan_micro_tokens(
        cuda_peak_of(model, compute, loss, precision, half, max_len, device),
        device_bytes=torch.cuda.get_device_properties(device).total_memory,
        static_bytes=static_bytes(model, compute if half else None, device),
        ceiling=update_tokens(batch_tokens, world_size), floor=max_len, is_oom=is_cuda_oom)


def cuda_peak_of(model: torch.nn.Module, compute: Transformer, loss: LossOptions,
                 precision: str, half: bool, max_len: int, device: torch.device
                 ) -> Callable[[int], int]:
    """`peak_of` for `plan_micro_tokens` on CUDA: a micro-batch of `tokens` padded slots
    in rows of `max_len` random ids (the worst case: the longest pairs, every slot a
    token) through the training step's loss and backward on `compute` (uncompiled: no
    graph for a shape training never sees); gradients are dropped after."""
    vocab = compute.config.vocab_size

    def peak_of(tokens: int) -> int:
        rows = max(1, tokens // max_len)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(4, vocab, (rows, max_len), generator=gen)
        micro = to_device(Batch(ids, ids.clone(), ids.clone(), ids.numel(), ids.numel()),
                          False, None, device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        try:
            compute.train()
            with autocast(device, precision) if not half else contextlib.nullcontext():
                smoothed, _ = micro_loss(compute, compute, micro, loss)
            smoothed.backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
        finally:
            for p in list(compute.parameters()) + list(model.parameters()):
                p.grad = None
            del micro
            torch.cuda.empty_cache()

    return peak_of


def static_bytes(model: torch.nn.Module, compute: torch.nn.Module | None,
                 device: torch.device) -> int:
    """Memory a run holds before its first batch on CUDA: what is allocated now (the
    weights, and a bf16 copy), plus fp32 gradients and Adam's two moments, which the
    first update allocates."""
    params = sum(p.numel() for p in model.parameters())
    grads = 4 * params + (0 if compute is None else
                          sum(p.numel() * p.element_size() for p in compute.parameters()))
    return torch.cuda.memory_allocated(device) + grads + ADAM_BYTES * params


def is_cuda_oom(err: BaseException) -> bool:
    """Whether `err` is CUDA running out of memory."""
    return isinstance(err, torch.OutOfMemoryError)
