"""Token-count batching and collation: pure functions over length arrays and id arrays.

A batch's cost is what fills memory: its longest pair, padding included, times the number
of pairs, where a pair of lengths (s, t) (pieces, without EOS) costs max(s, t) + 1 tokens
(source + EOS, BOS + target). Pairs are sorted by (cost, source length, target length) so
batches hold similar lengths and, because cost never decreases along that order, the greedy
"add pairs while the batch fits" rule can be found batch by batch with one binary search
(`batch_by_tokens`) instead of a Python loop over millions of pairs (tests/helpers holds the
obviously-correct loop it is tested equal to).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class Batches:
    """Index arrays (into the dataset) of each batch, and how many pairs were skipped."""

    batches: list[np.ndarray]
    skipped: int


def pair_costs(src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
    """Padded tokens one pair adds per sentence slot: max(src, tgt) + 1 (EOS/BOS)."""
    return np.maximum(np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)) + 1


def length_order(src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
    """Indices sorted by (cost, source length, target length, index): a stable order."""
    src = np.asarray(src_lens, np.int64)
    tgt = np.asarray(tgt_lens, np.int64)
    return np.lexsort((tgt, src, pair_costs(src, tgt)))


def batch_by_tokens(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int,
                    max_len: int, oversize_alone: bool = False) -> Batches:
    """Group pairs into batches of at most `max_tokens` padded tokens (vectorised).

    A pair's cost is its longer side plus EOS/BOS; a batch's size is its pair count times
    its largest cost (what fills memory). Pairs whose cost exceeds `max_len` are skipped
    and counted, and so are those above `max_tokens` unless `oversize_alone` (translation,
    which must output every line: such a pair gets a batch of its own). Batches come out
    in length order; training shuffles them with `epoch_order`. Translation batches source
    lines alone by passing target lengths of 0.
    """
    src = np.asarray(src_lens, np.int64)
    tgt = np.asarray(tgt_lens, np.int64)
    if src.shape != tgt.shape:
        raise ValueError(f"{src.shape[0]} source lengths but {tgt.shape[0]} target lengths")
    costs = pair_costs(src, tgt)
    order = length_order(src, tgt)
    limit = max_len if oversize_alone else min(max_len, max_tokens)
    keep = order[costs[order] <= limit]
    skipped = int(src.shape[0] - keep.shape[0])
    ends = batch_ends(costs[keep], max_tokens)
    return Batches(np.split(keep, ends[:-1]) if ends else [], skipped)


def batch_ends(sorted_costs: np.ndarray, max_tokens: int) -> list[int]:
    """Where `batch_by_tokens` closes its batches over pair costs in non-decreasing order:
    one past each batch's last pair. The greedy rule, shared with the fill measurement of
    `nmt train --batch-tokens` (nmt/train/loop.py `FillMeter`).

    A batch [start, j] fits iff (j - start + 1) * cost[j] <= max_tokens, i.e.
    g[j] = j + 1 - max_tokens // cost[j] <= start; g is non-decreasing in j, so the last j
    that fits is one binary search away. A pair over max_tokens goes alone.
    """
    g = np.arange(1, sorted_costs.shape[0] + 1, dtype=np.int64) - max_tokens // np.maximum(
        sorted_costs, 1)  # (n,)
    ends: list[int] = []
    start, n = 0, sorted_costs.shape[0]
    while start < n:
        start = max(int(np.searchsorted(g, start, side="right")), start + 1)
        ends.append(start)
    return ends


def epoch_order(num_batches: int, seed: int, epoch: int, world_size: int = 1) -> np.ndarray:
    """The epoch's shuffled batch order, the same on every rank (seeded by seed and epoch).

    Truncated to a multiple of `world_size` so every rank gets the same number of batches
    (a rank with one batch more would wait forever for its peers' gradients).
    """
    perm = np.random.default_rng([seed, epoch]).permutation(num_batches)
    return perm[: (num_batches // world_size) * world_size]


def shard(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's share of an epoch's batch order: every world_size-th batch from rank."""
    return order[rank::world_size]


@dataclass
class Batch:
    """One collated micro-batch; tensors are (batch, len) int64, PAD right-padded."""

    src: torch.Tensor  # (B, S): pieces + EOS
    tgt_in: torch.Tensor  # (B, T): BOS + pieces
    tgt_out: torch.Tensor  # (B, T): pieces + EOS
    src_tokens: int  # non-padding source tokens (incl. EOS)
    tgt_tokens: int  # non-padding target tokens (incl. EOS): the loss normaliser

    def to(self, device: torch.device) -> Batch:
        """The same batch on `device` (non-blocking copies from pinned memory on CUDA)."""
        nb = device.type == "cuda"
        return Batch(self.src.to(device, non_blocking=nb), self.tgt_in.to(device, non_blocking=nb),
                     self.tgt_out.to(device, non_blocking=nb), self.src_tokens, self.tgt_tokens)


def collate(src_seqs: Sequence[np.ndarray], tgt_seqs: Sequence[np.ndarray]) -> Batch:
    """Pad id arrays (without EOS) into src = ids+EOS, tgt_in = BOS+ids, tgt_out = ids+EOS."""
    n = len(src_seqs)
    src_lens = np.fromiter((len(s) for s in src_seqs), np.int64, n)
    tgt_lens = np.fromiter((len(t) for t in tgt_seqs), np.int64, n)
    s_width = int(src_lens.max()) + 1
    t_width = int(tgt_lens.max()) + 1
    src = np.full((n, s_width), PAD_ID, dtype=np.int64)  # (B, S)
    tgt_in = np.full((n, t_width), PAD_ID, dtype=np.int64)  # (B, T)
    tgt_out = np.full((n, t_width), PAD_ID, dtype=np.int64)  # (B, T)
    for row, (s, t) in enumerate(zip(src_seqs, tgt_seqs, strict=True)):
        ls, lt = len(s), len(t)
        src[row, :ls] = s
        src[row, ls] = EOS_ID
        tgt_in[row, 0] = BOS_ID
        tgt_in[row, 1:lt + 1] = t
        tgt_out[row, :lt] = t
        tgt_out[row, lt] = EOS_ID
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 int(src_lens.sum()) + n, int(tgt_lens.sum()) + n)
