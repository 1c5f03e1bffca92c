"""Exact-duplicate detection for corpora of tens of millions of pairs, in bounded memory.

A pair is remembered as an 8-byte digest (blake2b of its two sides) in `DigestSet`, an
open-addressing hash table held in one numpy uint64 array, filled at most to 70% and doubled
when fuller. Memory: 8 bytes / 0.35..0.7 = 11-23 bytes per distinct pair: WMT14 En-Fr's
~40M pairs fit a 2^26-slot table, 512 MiB (about 1 GiB for a moment while it doubles into
it), several times less than a Python set of the same digests (an int object plus a hash
slot per entry). With 64-bit digests the chance that any two of 40M distinct pairs
collide (and one is wrongly dropped) is about n^2 / 2^65 = 4e-5.
"""

from __future__ import annotations

import hashlib

import numpy as np

_EMPTY = np.uint64(0)  # marks a free slot; a digest of 0 is stored as 1
_MAX_LOAD = 0.7


def pair_digest(src: str, tgt: str) -> int:
    """64-bit digest of a pair; the source's length goes in first, so ('a b', 'c') and
    ('a', 'b c') differ."""
    src_bytes = src.encode("utf-8")
    digest = hashlib.blake2b(len(src_bytes).to_bytes(8, "little"), digest_size=8)
    digest.update(src_bytes)
    digest.update(tgt.encode("utf-8"))
    return int.from_bytes(digest.digest(), "little")


class DigestSet:
    """A set of 64-bit digests in one numpy array (linear probing), added to in batches."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        size = 1 << max(4, (capacity - 1).bit_length())  # a power of two
        self._table = np.zeros(size, dtype=np.uint64)  # (slots,)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Memory held by the table."""
        return self._table.nbytes

    def add_new(self, digests: np.ndarray) -> np.ndarray:
        """Add a batch; return a bool mask, True where the digest was not in the set before
        and is its first occurrence in the batch (the ones to keep, in order)."""
        digests = np.asarray(digests, dtype=np.uint64)  # (n,)
        digests = np.where(digests == _EMPTY, np.uint64(1), digests)
        unique, first = np.unique(digests, return_index=True)  # (u,), (u,)
        while (self._count + len(unique)) > _MAX_LOAD * len(self._table):
            self._grow()
        inserted = self._insert(unique)  # (u,) True where new
        self._count += int(inserted.sum())
        keep = np.zeros(len(digests), dtype=bool)
        keep[first[inserted]] = True
        return keep

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct `keys`; True for each that was absent. All keys probe one step
        per round, so a round is a few vectorised operations over the pending ones."""
        table, mask = self._table, np.uint64(len(self._table) - 1)
        new = np.zeros(len(keys), dtype=bool)
        pending = np.arange(len(keys))  # indices into keys still probing
        slots = (keys & mask).astype(np.int64)  # (u,) current probe slot of each key
        while len(pending):
            key, slot = keys[pending], slots[pending]
            held = table[slot]
            found = held == key
            free = held == _EMPTY
            table[slot[free]] = key[free]  # several keys may claim one free slot: one wins
            won = free & (table[slot] == key)
            new[pending[won]] = True
            pending = pending[~(found | won)]
            slots[pending] = (slots[pending] + 1) & int(mask)
        return new

    def _grow(self) -> None:
        old = self._table[self._table != _EMPTY]
        self._table = np.zeros(2 * len(self._table), dtype=np.uint64)
        self._insert(old)
