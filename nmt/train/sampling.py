"""Which training pairs an epoch visits: every pair once, or a weighted mix of corpora.

Without corpus weights (`nmt prep` recorded none) every epoch visits every pair once, and one
batch list, shuffled per epoch, serves all epochs. With weights, an epoch has as many pairs
as the training split (N) and corpus i supplies round(share_i x N) of them (share_i = w_i /
sum w; largest remainders make the counts sum to N): as many whole copies of the corpus as
fit, plus a sample without replacement of the rest. The sample is seeded by (seed, epoch,
corpus), so every rank and every resumed run draws the same epoch; the epoch's pairs are
then batched by length like the unweighted list.
"""

from __future__ import annotations

import math

import numpy as np

from nmt.data.batching import Batches, batch_by_tokens
from nmt.data.dataset import CorpusRange, epoch_shares


def corpus_counts(ranges: list[CorpusRange]) -> list[int]:
    """Pairs each corpus supplies to a weighted epoch of N = all lines (sums to N)."""
    total = sum(r.stop - r.start for r in ranges)
    exact = [share * total for share in epoch_shares(ranges)]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(ranges)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def epoch_pairs(ranges: list[CorpusRange], seed: int, epoch: int) -> np.ndarray:
    """Indices of the training pairs of one weighted epoch (repeats allowed), in corpus
    order; batching sorts them by length."""
    parts = []
    for i, (corpus, count) in enumerate(zip(ranges, corpus_counts(ranges), strict=True)):
        size = corpus.stop - corpus.start
        if size == 0 or count == 0:
            continue
        copies, rest = divmod(count, size)
        lines = np.arange(corpus.start, corpus.stop, dtype=np.int64)  # (size,)
        rng = np.random.default_rng([seed, epoch, i])
        parts.extend([lines] * copies)
        parts.append(np.sort(rng.choice(lines, size=rest, replace=False)))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class EpochBatches:
    """The batch list of each epoch: fixed when unweighted, drawn per epoch when weighted
    (the latest epoch's list is kept: batching a large corpus takes a while)."""

    def __init__(self, src_lens: np.ndarray, tgt_lens: np.ndarray,
                 ranges: list[CorpusRange], max_tokens: int, max_len: int, seed: int) -> None:
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self.ranges = ranges
        self.weighted = all(r.weight is not None for r in ranges) and len(ranges) > 1
        self.max_tokens, self.max_len, self.seed = max_tokens, max_len, seed
        self._cache: tuple[int, Batches] | None = None
        self._sizes: dict[int, int] = {}  # epoch -> its number of batches (at least 1)
        self._fixed = None if self.weighted else batch_by_tokens(src_lens, tgt_lens,
                                                                 max_tokens, max_len)

    def get(self, epoch: int) -> Batches:
        """Batches (indices into the training split) of `epoch` (1-based)."""
        if self._fixed is not None:
            return self._fixed
        if self._cache is None or self._cache[0] != epoch:
            pairs = epoch_pairs(self.ranges, self.seed, epoch)  # (N,)
            local = batch_by_tokens(self.src_lens[pairs], self.tgt_lens[pairs],
                                    self.max_tokens, self.max_len)
            batches = Batches([pairs[b] for b in local.batches], local.skipped)
            self._cache = (epoch, batches)
        return self._cache[1]

    def size(self, epoch: int) -> int:
        """Number of batches of `epoch` (at least 1), remembered: asking about an epoch
        the feed has read past must not draw and batch it again."""
        if epoch not in self._sizes:
            self._sizes[epoch] = max(len(self.get(epoch).batches), 1)
        return self._sizes[epoch]
