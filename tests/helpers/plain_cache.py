"""The reference key/value cache: one plain history per row, concatenated and indexed.

Every row keeps its own keys/values (n, heads, length, d) and its own copy of the encoder
K/V; a step concatenates the new position, a reorder index-selects every tensor. It does
what nmt/inference/kv_cache.py's `GroupedCache` does with none of its tricks (no groups,
slots, masks, preallocation or growth), so it is easy to check by reading, and the tests
hold the fast cache equal to it (tests/inference/test_decoding.py). Slower: each step copies the
whole history and beam search copies it again at every reorder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class PlainCache:
    """Per-row caches for n rows: `self_k[i]` (n, heads, position, d_k) for layer i, the
    encoder K/V and mask per row. Same methods as GroupedCache."""

    cross_k: list[Tensor]  # per layer (n, heads, d_k, src_len): keys transposed
    cross_v: list[Tensor]  # per layer (n, heads, src_len, d_v)
    cross_mask: Tensor | None  # (n, 1, 1, src_len) True = attend; None: no padding
    limit: int  # the model's positions, checked by the model itself
    self_k: list[Tensor] = field(default_factory=list)  # per layer (n, heads, step, d_k)
    self_v: list[Tensor] = field(default_factory=list)  # per layer (n, heads, step, d_v)
    position: int = 0
    attention_layer: int = -1
    attention: Tensor | None = None
    consumed: bool = False

    @classmethod
    def start(cls, cross_k: list[Tensor], cross_v: list[Tensor], padding_mask: Tensor,
              cross_mask: Tensor | None, limit: int, attention_layer: int = -1
              ) -> PlainCache:
        """Empty histories of n rows around the per-layer encoder keys (n, heads, d_k,
        src_len: transposed) and values (n, heads, src_len, d_v)."""
        del padding_mask  # the mask `cross_mask` says the same
        empty = [k.new_empty(*k.shape[:2], 0, k.size(2)) for k in cross_k]  # (n, h, 0, d_k)
        empty_v = [v.new_empty(*v.shape[:2], 0, v.size(-1)) for v in cross_v]  # (n, h, 0, d_v)
        return cls(cross_k=cross_k, cross_v=cross_v, cross_mask=cross_mask, limit=limit,
                   self_k=empty, self_v=empty_v, attention_layer=attention_layer)

    @property
    def rows(self) -> int:
        """n, the rows decoded side by side."""
        return self.cross_k[0].size(0)

    def layers(self, live: Tensor | None = None) -> list[_PlainLayer]:
        """Every layer's view for the step at `self.position`."""
        self.check_live()
        return [_PlainLayer(self, i, live) for i in range(len(self.cross_k))]

    def reserve(self, positions: int) -> None:
        """Nothing to preallocate: histories grow by concatenation."""
        self.check_live()

    def release(self) -> None:
        """Drop the histories; the state can no longer step."""
        self.check_live()
        self.consumed = True
        self.self_k, self.self_v = [], []

    def check_live(self) -> None:
        """Refuse a state that `reorder` or `release` consumed."""
        if self.consumed:
            raise RuntimeError("this decoder state was consumed by reorder; "
                               "use the state it returned")

    def reorder(self, new_order: Tensor, layout: object = None) -> PlainCache:
        """A state whose row j is row new_order[j] of this one; this one is consumed.
        `layout` (the fast cache's `kv_cache.Regroup` hint) is ignored: one row per entry,
        nothing to find out (no host sync), and this reference cache stays standalone."""
        del layout
        self.check_live()
        self.consumed = True

        def pick(tensors: list[Tensor]) -> list[Tensor]:
            return [t.index_select(0, new_order) for t in tensors]

        return PlainCache(
            cross_k=pick(self.cross_k), cross_v=pick(self.cross_v),
            cross_mask=None if self.cross_mask is None else self.cross_mask[new_order],
            limit=self.limit, self_k=pick(self.self_k), self_v=pick(self.self_v),
            position=self.position, attention_layer=self.attention_layer,
            attention=None if self.attention is None else self.attention[new_order])


class _PlainLayer:
    """Layer `index`'s view of a PlainCache: write appends a position, history is all of
    it, one entry per row (no mask needed)."""

    def __init__(self, cache: PlainCache, index: int, live: Tensor | None) -> None:
        self.rows, self.live = cache.rows, live
        self.entries = None  # the reference feeds every row: no `write_live`
        self._cache, self._index = cache, index

    def write_live(self, k: Tensor, v: Tensor) -> None:
        raise RuntimeError("the plain cache takes every row's key and value (write)")

    def write(self, k: Tensor, v: Tensor) -> None:
        cache, i = self._cache, self._index
        cache.self_k[i] = torch.cat([cache.self_k[i], k.unsqueeze(2)], dim=2)  # (n, h, t+1, d)
        cache.self_v[i] = torch.cat([cache.self_v[i], v.unsqueeze(2)], dim=2)  # (n, h, t+1, d)

    def history(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self._cache.self_k[self._index], self._cache.self_v[self._index], None

    def encoder(self) -> tuple[Tensor, Tensor, Tensor | None]:
        cache = self._cache
        return cache.cross_k[self._index], cache.cross_v[self._index], cache.cross_mask
