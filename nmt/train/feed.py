"""The training data as a stream of updates, and each micro-batch ready on the device.

An update is `update_freq` micro-batches per process: every rank takes its shard of the
epoch's shuffled batch list (`epoch_order` + `shard`), the same on every rank and for a
resumed run. `updates(start)` yields each update with the data position after it and
changes nothing else, so the prefetcher may read one update ahead (the trainer adopts the
position when it runs the update). `prepare` collates one micro-batch and puts it on the
device: pinned and copied asynchronously on CUDA, with the flat indices of its real
(non-PAD) target positions, so the model projects only those rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from nmt.data.batching import Batch, collate, epoch_order, shard
from nmt.data.dataset import ParallelData
from nmt.train.buckets import pad_to_bucket
from nmt.train.distributed import DistEnv
from nmt.train.loss import target_positions
from nmt.train.sampling import EpochBatches
from nmt.train.state import DataState


@dataclass
class Update:
    """One update's micro-batches: this rank's, all ranks' (for the token counts), and the
    data position after it."""

    micro: list[np.ndarray]
    all_batches: list[np.ndarray]
    after: DataState


@dataclass(frozen=True)
class Shapes:
    """How a compiled model gets its batches (nmt/train/buckets.py): padded to their length
    bucket, and with `static_rows` also to the bucket's most rows, every position then
    projected (no `select`: its length varies) with PAD targets ignored by the loss."""

    micro_tokens: int
    static_rows: bool

    def prepare(self, batch: Batch, src_lens: np.ndarray, tgt_lens: np.ndarray,
                device: torch.device) -> Micro:
        """`batch` padded to its bucket and on `device`; always `has_pad` (one graph)."""
        batch = pad_to_bucket(batch, self.micro_tokens if self.static_rows else None)
        select = None
        if not self.static_rows:
            _, select = host_selection(src_lens, tgt_lens, batch.tgt_out.size(1))
        micro = to_device(batch, True, select, device)
        if not self.static_rows:  # one graph per bucket, whatever the rows (or 0/1 rows)
            for t in (micro.batch.src, micro.batch.tgt_in, micro.select):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return micro


@dataclass
class Micro:
    """A micro-batch on the device, ready for the forward pass."""

    batch: Batch
    has_pad: bool
    select: torch.Tensor | None  # (n_real,) flat indices of real target positions
    target: torch.Tensor  # gold ids of those positions (or all of tgt_out)


class TrainFeed:
    """Updates of one process, from any data position on."""

    def __init__(self, data: ParallelData, batches: EpochBatches, env: DistEnv,
                 update_freq: int, seed: int, max_epochs: int, device: torch.device,
                 shapes: Shapes | None = None) -> None:
        self.data, self.batches, self.env = data, batches, env
        self.update_freq, self.seed, self.max_epochs = update_freq, seed, max_epochs
        self.device = device
        self.shapes = shapes  # None: each batch as collated
        self.src_cost = data.src.lengths + 1  # non-padding tokens incl. EOS, per pair
        self.tgt_cost = data.tgt.lengths + 1
        # The position after the last epoch, once `updates` has run through it.
        self.epoch_end: DataState | None = None

    def updates(self, start: DataState) -> Iterator[Update]:
        """Each update from `start` on, until --max-epochs (forever without it)."""
        world, rank, k = self.env.world_size, self.env.rank, self.update_freq
        epoch, index = start.epoch, start.index
        while not self.max_epochs or epoch <= self.max_epochs:
            batches = self.batches.get(epoch).batches
            order = epoch_order(len(batches), self.seed, epoch, world)
            mine = shard(order, rank, world)
            pos = index // world
            while pos < len(mine):
                group = mine[pos:pos + k]
                global_ids = order[pos * world:(pos + len(group)) * world]
                pos += len(group)
                yield Update([batches[i] for i in group], [batches[i] for i in global_ids],
                             DataState(epoch, pos * world))
            epoch, index = epoch + 1, 0
            # An epoch's end is a position too: a save there resumes at the next epoch.
            self.epoch_end = DataState(epoch, 0)

    def prepare(self, indices: np.ndarray) -> Micro:
        """One micro-batch on the device (runs on the prefetch thread on CUDA). The real
        target positions come from host-side lengths: no device sync."""
        batch = collate([self.data.src[i] for i in indices],
                        [self.data.tgt[i] for i in indices])
        if self.shapes is not None:
            return self.shapes.prepare(batch, self.src_cost[indices], self.tgt_cost[indices],
                                       self.device)
        has_pad, select = host_selection(self.src_cost[indices], self.tgt_cost[indices],
                                         batch.tgt_out.size(1))
        return to_device(batch, has_pad, select, self.device)


def host_selection(src_lens: np.ndarray, tgt_lens: np.ndarray, tgt_width: int
                   ) -> tuple[bool, torch.Tensor | None]:
    """From host-side lengths (non-PAD tokens per row, EOS included): whether the sources
    are padded, and the flat indices (n_real,) of the real target positions in a
    (rows, tgt_width) batch (None: no target padding). No device sync."""
    rows = target_positions(tgt_lens, tgt_width)
    return bool(src_lens.min() != src_lens.max()), None if rows is None else \
        torch.from_numpy(rows)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in page-locked host memory for an asynchronous copy; a device tensor as is."""
    return t.pin_memory() if t.device.type == "cpu" else t


def to_device(batch: Batch, has_pad: bool, select: torch.Tensor | None,
              device: torch.device) -> Micro:
    """A collated micro-batch as the model takes it: on `device` (pinned and copied
    asynchronously on CUDA), with the gold ids of the `select`ed target positions."""
    if device.type == "cuda":  # host tensors only: one already on the GPU stays as is
        batch.src, batch.tgt_in, batch.tgt_out = (_pinned(t) for t in (
            batch.src, batch.tgt_in, batch.tgt_out))  # already pinned: returned as is
        select = None if select is None else _pinned(select)
    batch = batch.to(device)
    if select is None:
        return Micro(batch, has_pad, None, batch.tgt_out)
    select = select.to(device, non_blocking=True)
    target = batch.tgt_out.reshape(-1).index_select(0, select)  # (n_real,)
    return Micro(batch, has_pad, select, target)
