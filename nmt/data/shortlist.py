"""A lexical shortlist: the target pieces worth scoring for a given source (Marian's
lexical shortlist, CTranslate2's vocabulary map), learned from the training data.

For each source piece, the K target pieces it most probably translates into, by IBM Model 1
translation probabilities p(t | s) estimated with a few rounds of EM over the training
pairs (as fast_align's tables, which Marian's shortlists are built from, without the
alignment prior), plus the N most frequent target pieces. A batch's candidates are the
union of those for its source pieces: translation then scores, normalises and ranks only
them, not the whole vocabulary (nmt/inference/decoding.py). The specials come first, so
their ids are their columns.

Pure numpy; EM over the pairs' token co-occurrences (one event per source x target token
of a pair), at most `max_events` of them: a large corpus is subsampled evenly.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmt.errors import DataError
from nmt.fileio import atomic_write_bytes
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SPECIALS = np.array(sorted((PAD_ID, BOS_ID, EOS_ID, UNK_ID)), dtype=np.int64)
PER_SOURCE = 20  # K: translations kept per source piece (chosen on the valid split)
FREQUENT = 100  # N: most frequent target pieces, always candidates
EM_ROUNDS = 5
MAX_EVENTS = 20_000_000  # source x target token pairs EM holds at once (about 1.2 GB)
FORMAT = "nmt-shortlist-1"


@dataclass(frozen=True)
class Shortlist:
    """`table[s]`: the target pieces source piece s most probably translates into, best
    first, -1 where fewer are known; `frequent`: the most frequent target pieces."""

    table: np.ndarray  # (vocab, K) int32
    frequent: np.ndarray  # (N,) int32
    vocab_size: int

    def candidates(self, sources: Iterable[Sequence[int]]) -> np.ndarray:
        """Sorted unique target piece ids worth scoring for these source pieces (ids), the
        specials first (so each special's id is its position): (C,) int64."""
        ids = np.fromiter((i for s in sources for i in s), dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < len(self.table))]
        picked = self.table[np.unique(ids)].ravel()
        picked = picked[picked >= 0]
        return np.unique(np.concatenate([SPECIALS, self.frequent, picked]).astype(np.int64))

    def save(self, path: Path) -> None:
        """Write atomically as a .npz file."""
        buffer = io.BytesIO()
        np.savez(buffer, format=np.array(FORMAT), table=self.table, frequent=self.frequent,
                 vocab_size=np.array(self.vocab_size))
        atomic_write_bytes(Path(path), lambda sink: sink.write(buffer.getvalue()))

    @classmethod
    def load(cls, path: Path, vocab_size: int | None = None) -> Shortlist:
        """Read a file `save` wrote; with `vocab_size`, check it was made for that
        vocabulary (DataError naming the file otherwise)."""
        try:
            with np.load(Path(path), allow_pickle=False) as data:
                if str(data["format"]) != FORMAT:
                    raise DataError(f"{path}: not an nmt shortlist ({data['format']}); "
                                    "make one with `nmt shortlist DATA`")
                shortlist = cls(data["table"].astype(np.int32), data["frequent"].astype(np.int32),
                                int(data["vocab_size"]))
        except (OSError, KeyError, ValueError) as err:
            raise DataError(f"{path}: unreadable shortlist ({err}); make one with "
                            "`nmt shortlist DATA`") from err
        if vocab_size is not None and shortlist.vocab_size != vocab_size:
            raise DataError(f"{path}: made for a vocabulary of {shortlist.vocab_size} pieces, "
                            f"the model has {vocab_size}; make it from the model's data")
        return shortlist


def learn_shortlist(src_tokens: np.ndarray, src_offsets: np.ndarray, tgt_tokens: np.ndarray,
                    tgt_offsets: np.ndarray, vocab_size: int, per_source: int = PER_SOURCE,
                    frequent: int = FREQUENT, rounds: int = EM_ROUNDS,
                    max_events: int = MAX_EVENTS) -> Shortlist:
    """Learn a shortlist from aligned pairs given as flat ids + offsets (the binarized
    format of nmt/data/binarize.py): pair i is src_tokens[src_offsets[i]:src_offsets[i+1]]
    and the same on the target side."""
    src_len = np.diff(src_offsets).astype(np.int64)  # (pairs,)
    tgt_len = np.diff(tgt_offsets).astype(np.int64)
    counts = np.bincount(np.asarray(tgt_tokens, dtype=np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    top = order[:frequent][counts[order[:frequent]] > 0].astype(np.int32)
    pairs = _sampled_pairs(src_len * tgt_len, max_events)
    src_of, tgt_of, position = _events(pairs, src_offsets, tgt_offsets, src_len, tgt_len,
                                       np.asarray(src_tokens), np.asarray(tgt_tokens))
    table = _ibm1_table(src_of, tgt_of, position, vocab_size, per_source, rounds)
    return Shortlist(table, top, vocab_size)


def _sampled_pairs(events: np.ndarray, budget: int) -> np.ndarray:
    """Indices of the pairs used: all when their events fit `budget`, else an even stride
    through the corpus that does."""
    total = int(events.sum())
    if total <= budget:
        return np.arange(len(events))
    stride = int(np.ceil(total / budget))
    return np.arange(0, len(events), stride)


def _events(pairs: np.ndarray, src_offsets: np.ndarray, tgt_offsets: np.ndarray,
            src_len: np.ndarray, tgt_len: np.ndarray, src_tokens: np.ndarray,
            tgt_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (source token, target token) of the chosen pairs: the source id, the target
    id, and the target token's global position (EM normalises over a target token's
    source tokens)."""
    ls, lt = src_len[pairs], tgt_len[pairs]  # (P,)
    per_pair = ls * lt
    total = int(per_pair.sum())
    pair_of = np.repeat(np.arange(len(pairs)), per_pair)  # (E,)
    start = np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
    local = np.arange(total, dtype=np.int64) - start  # index within the pair's grid
    width = lt[pair_of]
    a, b = local // width, local % width  # source position, target position
    src_pos = src_offsets[pairs][pair_of] + a
    tgt_pos = tgt_offsets[pairs][pair_of] + b
    return (src_tokens[src_pos].astype(np.int64), tgt_tokens[tgt_pos].astype(np.int64),
            tgt_pos.astype(np.int64))


def _ibm1_table(src_of: np.ndarray, tgt_of: np.ndarray, position: np.ndarray,
                vocab_size: int, per_source: int, rounds: int) -> np.ndarray:
    """EM for IBM Model 1's p(t | s) over the co-occurrence events, then each source
    piece's `per_source` most probable targets: (vocab, per_source) int32, -1 padded."""
    table = np.full((vocab_size, per_source), -1, dtype=np.int32)
    if not len(src_of):
        return table
    pair_key, pair_of = np.unique(src_of * vocab_size + tgt_of, return_inverse=True)
    pair_src = pair_key // vocab_size  # (U,)
    _, group = np.unique(position, return_inverse=True)  # one group per target token
    prob = np.ones(len(pair_key))  # uniform start: the first round counts co-occurrences
    for _ in range(rounds):
        weight = prob[pair_of]  # (E,)
        norm = np.bincount(group, weights=weight)  # (G,) sum over the token's sources
        posterior = weight / norm[group]
        expected = np.bincount(pair_of, weights=posterior, minlength=len(pair_key))  # (U,)
        per_src = np.bincount(pair_src, weights=expected, minlength=vocab_size)
        prob = expected / per_src[pair_src]
    pair_tgt = pair_key % vocab_size
    ranked = np.lexsort((-prob, pair_src))  # by source, most probable first
    src_sorted = pair_src[ranked]
    first = np.searchsorted(src_sorted, src_sorted, side="left")  # each group's start
    rank = np.arange(len(ranked)) - first
    keep = rank < per_source
    table[src_sorted[keep], rank[keep]] = pair_tgt[ranked][keep]
    return table
