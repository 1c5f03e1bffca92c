"""--batch-tokens B: the shape of an update that holds about B real tokens per side (the
paper's "about 25000 source tokens and 25000 target tokens"), on any number of processes:
micro-batches per process (update-freq) and the padded size of each, from the fill that
`batch_by_tokens` is measured to reach on the training lengths (`FillMeter`), derived the
same way every time (`derive_batching`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nmt.config import TrainConfig
from nmt.data.batching import batch_ends, pair_costs


@dataclass(frozen=True)
class Batching:
    """Micro-batches per process per update, padded tokens per micro-batch (the budget
    `batch_by_tokens` fills), and the fill the shape was derived with."""

    update_freq: int
    micro_tokens: int
    # Real tokens per side per micro-batch over `micro_tokens`, measured on the training
    # lengths at this size (`FillMeter`); None: not measured (no --batch-tokens or lengths).
    fill: float | None = None


class FillMeter:
    """How full `batch_by_tokens` packs the training pairs at a given micro-batch size.

    The fill at size M is the mean real tokens per side of a micro-batch, (source + target
    tokens) / 2 with EOS and no padding, over M, for the batches `batch_by_tokens` builds
    from these lengths with `--max-tokens` M. M counts padded slots of each pair's longer
    side, so the fill is below 1 by the padding of each batch's shorter pairs, by the slack
    a batch leaves under M, and by each pair's shorter side (docs/training.md). Those
    batches depend only on the sorted pair costs (max(src, tgt) + 1), so the costs are
    sorted once here and each size costs one vectorised pass plus a binary search per
    batch, with `batch_by_tokens`' own greedy rule (`batch_ends`);
    `tests/train/test_train_loop.py` holds the count to it.
    """

    def __init__(self, src_lens: np.ndarray, tgt_lens: np.ndarray, max_len: int) -> None:
        src = np.asarray(src_lens, np.int64)
        tgt = np.asarray(tgt_lens, np.int64)
        self.pair_cost = pair_costs(src, tgt)  # (pairs,) padded slots per pair
        self.both_sides = src + tgt + 2  # (pairs,) real source + target tokens, EOS included
        self.costs = np.sort(self.pair_cost)  # (pairs,) non-decreasing
        self.max_len = max_len

    def batch_count(self, micro_tokens: int) -> tuple[int, int]:
        """(batches, real source + target tokens in them) of
        `batch_by_tokens(src, tgt, micro_tokens, max_len)`."""
        limit = min(self.max_len, micro_tokens)  # longer pairs are skipped
        kept = self.costs[:int(np.searchsorted(self.costs, limit, side="right"))]
        count = len(batch_ends(kept, micro_tokens))  # batch_by_tokens' own rule
        return count, int(self.both_sides[self.pair_cost <= limit].sum())

    def fill(self, micro_tokens: int) -> float:
        """Real tokens per side per micro-batch over `micro_tokens` (1.0 without pairs)."""
        count, both = self.batch_count(micro_tokens)
        return both / 2 / (count * micro_tokens) if count else 1.0


REFILLS = 4  # at most this many micro-batch sizes measured after --max-tokens itself


def derive_batching(cfg: TrainConfig, world_size: int, src_lens: np.ndarray | None = None,
                    tgt_lens: np.ndarray | None = None) -> Batching:
    """The update's shape from --batch-tokens B: about B real tokens per side per update,
    i.e. (source + target tokens) / 2 = B, EOS included, no padding (the paper's "about
    25000 source tokens and 25000 target tokens"), on any number of processes W, in
    micro-batches of at most --max-tokens padded slots (the memory cap).

    A micro-batch of M slots holds M x fill(M) real tokens per side, the fill measured
    with the project's own batching on the training lengths (`FillMeter`), so:
    update_freq F = ceil(B / (W x max-tokens x fill(max-tokens))) and
    M = ceil(B / (W x F x fill)) (at most --max-tokens, at least --max-len), its fill
    re-measured at M and M adjusted to it (up to `REFILLS` times, until M repeats; the M
    whose W x F x M x fill(M) is nearest to B is kept). That product is then about B, on
    one GPU (F x M) as on eight (1 x M each) although smaller micro-batches pack tighter;
    counted in padded slots instead, the updates would fall short of B (docs/training.md).
    Deterministic: the same lengths, flags and W give the same shape, so a resume
    re-derives it exactly (and re-derives it on another W).

    Without lengths (the benches' shapes from flags alone) the fill is taken as 1: B then
    counts padded slots. The fill is measured on the whole training split; a weighted
    corpus mix draws each epoch from it and packs about alike. Without B: --update-freq
    and --max-tokens as given."""
    if not cfg.batch_tokens:
        return Batching(cfg.update_freq, cfg.max_tokens)
    batch, cap, floor = cfg.batch_tokens, cfg.max_tokens, cfg.max_len
    meter = None if src_lens is None or tgt_lens is None else FillMeter(src_lens, tgt_lens,
                                                                         floor)

    def fill_at(micro: int) -> float:
        return 1.0 if meter is None else meter.fill(micro)

    def size(freq: int, fill: float) -> int:
        return min(cap, max(math.ceil(batch / (world_size * freq * fill)), floor))

    fill = fill_at(cap)
    freq = max(1, math.ceil(batch / (world_size * cap * fill)))
    # Re-measure at each new size (a large corpus settles at once; a small one's fill
    # jumps with the size) and keep the size whose update comes nearest to B.
    tried: dict[int, float] = {cap: fill}
    micro = size(freq, fill)
    for _ in range(REFILLS):
        if micro in tried:
            break
        tried[micro] = fill_at(micro)
        micro = size(freq, tried[micro])
    micro = min(tried, key=lambda m: (abs(world_size * freq * m * tried[m] - batch), m))
    return Batching(freq, micro, None if meter is None else tried[micro])


def fill_note(batching: Batching, world_size: int) -> str:
    """What a derived shape holds, for the start-up line and the resume note: "micro-batches
    measured N % full, about R real tokens per side per update" (R = W x F x M x fill)."""
    if batching.fill is None:
        return "fill not measured: counted in padded slots"
    real = world_size * batching.update_freq * batching.micro_tokens * batching.fill
    return (f"micro-batches measured {100 * batching.fill:.1f} % full, about {real:,.0f} "
            "real tokens per side per update")
