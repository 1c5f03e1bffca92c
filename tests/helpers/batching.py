"""The obviously-correct batching loop that nmt/data/batching.py's `batch_by_tokens` (one
binary search per batch) is tested equal to."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nmt.data.batching import Batches


def batch_by_tokens_slow(src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int,
                         max_len: int) -> Batches:
    """Reference: walk the length order, close a batch when the next pair would overflow."""
    costs = [max(s, t) + 1 for s, t in zip(src_lens, tgt_lens, strict=True)]
    order = sorted(range(len(costs)), key=lambda i: (costs[i], src_lens[i], tgt_lens[i], i))
    batches: list[np.ndarray] = []
    current: list[int] = []
    longest = 0
    skipped = 0
    for i in order:
        if costs[i] > max_len or costs[i] > max_tokens:
            skipped += 1
            continue
        if current and max(longest, costs[i]) * (len(current) + 1) > max_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, costs[i])
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return Batches(batches, skipped)
