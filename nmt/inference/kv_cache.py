"""The fast key/value cache of incremental decoding: its grouped layout, reordering and memory.

`GroupedCache` is what `nmt translate` decodes with; tests/helpers/plain_cache.py is the
readable reference it is tested equal to. Both serve the network through one interface
(`LayerCache`, nmt/inference/layer_step.py): a layer writes this position's key/value and
reads back what to attend over; the layout below is invisible to it and to the search.

The cache is organised by GROUP: the g rows of one sentence (its beam) share one copy of
the cross-attention K/V, and their self-attention K/V live in g slots of preallocated
per-group buffers, written in place one position per step. A reorder within the groups
(beam search's per-step reordering) copies no key or value: it only permutes a small
ancestry table (which slot holds each row's key at each position) that becomes the
attention mask (`slot_mask`: additive, built once per step for every layer). Whole groups
are copied only when sentences leave (shrink) or the layout changes; using a state after
`reorder` consumed it raises.

Host syncs: finding the layout of an arbitrary order means reading it back (two reads), so
a caller that knows it (beam search always does) says so with a `Regroup` and the reorder
reads nothing; NMT_CHECK_LAYOUT=1 (nmt/switches.py) verifies every such promise, at the
price of those reads.

Memory: buffers are plain tensors, freed when no state holds them, with no pool of our own
(docs/performance.md): on CPU the translator keeps glibc from unmapping freed blocks
(nmt/host_memory.py), so the next batch's caches land on pages already mapped.

Tensor bookkeeping only: the sizes come from the cross-attention K/V the caller computed;
capacities never exceed `limit`, the model's positions (see nmt/inference/decoding.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from nmt.inference.layer_step import additive_mask
from nmt.switches import switch

INITIAL_CAPACITY = 16  # target positions preallocated by a new state; doubled when full


class Regroup(NamedTuple):
    """What the caller of `GroupedCache.reorder` knows about its order, so that the cache
    need not read the order back to the host to find its layout: every `size` consecutive
    new rows come from one old group, new group i from old group `source[i]` (`source`
    (groups',) long, on the order's device), or from old group i when `source` is None
    (every old group kept, in place). Trusted as given (see NMT_CHECK_LAYOUT)."""

    size: int
    source: Tensor | None = None


@dataclass
class GroupedCache:
    """Everything incremental decoding caches, for n = groups * g rows, g rows per group.

    Row r is slot r % g of group r // g. A group is one sentence (g = beam during beam
    search, 1 before the expansion), so the encoder side is stored once per group. The
    self-attention keys/values of every layer live in buffers (groups, heads, capacity,
    g, d) whose capacity doubles when full (up to `limit`); each step writes row r's newest
    key into its own slot. `ancestry[b, s, p]` is the slot of group b that holds, at
    position p, the key of the prefix row (b, s) now extends; beam reordering permutes
    `ancestry` rows instead of copying the caches (see `reorder`).
    `attention_layer` picks the decoder layer whose encoder-decoder attention
    `decode_step(..., need_attention=True)` (nmt/inference/decoding.py) stores in `attention`
    (n, heads, src_len).
    """

    cross_k: list[Tensor]  # per layer (groups, heads, d_k, src_len): keys transposed
    cross_v: list[Tensor]  # per layer (groups, heads, src_len, d_v)
    padding_mask: Tensor  # (groups, src_len) True at PAD
    cross_mask: Tensor | None  # (groups, 1, 1, src_len) additive: 0 or -inf at PAD; None: no PAD
    self_k: list[Tensor]  # per layer (groups, heads, capacity, g, d_k); from `position` on unused
    self_v: list[Tensor]  # per layer (groups, heads, capacity, g, d_v)
    ancestry: Tensor  # (groups, g, capacity) long: slot holding each row's key per position
    limit: int  # the model's positions: the caches never grow beyond
    group_size: int = 1  # g
    position: int = 0  # target tokens fed so far = the position of the next one
    attention_layer: int = -1
    attention: Tensor | None = None
    consumed: bool = False  # set by reorder / release: no longer usable

    @classmethod
    def start(cls, cross_k: list[Tensor], cross_v: list[Tensor], padding_mask: Tensor,
              cross_mask: Tensor | None, limit: int, attention_layer: int = -1
              ) -> GroupedCache:
        """A state of one row (group of size 1) per sentence around the per-layer cross
        keys (n, heads, d_k, src_len: transposed) and values (n, heads, src_len, d_v), with
        empty self-attention caches of INITIAL_CAPACITY positions (at most `limit`).
        `cross_mask` (n, 1, 1, src_len) boolean, True = attend, is kept additive."""
        n, capacity = cross_k[0].size(0), min(INITIAL_CAPACITY, limit)
        self_k, self_v = _empty_caches(cross_k, cross_v, n, capacity, 1, k_dim=2)
        bias = None if cross_mask is None else additive_mask(cross_mask, cross_k[0].dtype)
        return cls(cross_k=cross_k, cross_v=cross_v, padding_mask=padding_mask,
                   cross_mask=bias, self_k=self_k, self_v=self_v,
                   ancestry=torch.zeros(n, 1, capacity, dtype=torch.long,
                                        device=padding_mask.device),
                   limit=limit, attention_layer=attention_layer)

    @property
    def rows(self) -> int:
        """n = groups * g, the number of hypotheses decoded side by side."""
        return self.ancestry.size(0) * self.group_size

    @property
    def capacity(self) -> int:
        """Target positions the caches hold before they must grow."""
        return self.ancestry.size(2)

    def layers(self, live: Tensor | None = None) -> list[_GroupedLayer]:
        """Open the step at `self.position`: every layer's view of the caches, with
        `live` (m,) the rows fed (None: all). The caller advances `position` afterwards."""
        mask, entries = self.open_step(live)
        return [_GroupedLayer(self, i, self.position, mask, live, entries)
                for i in range(len(self.self_k))]

    def open_step(self, live: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """The bookkeeping of a step at `self.position` (`layers`, and the native step of
        nmt/inference/native_step.py, which writes the caches itself): room for the
        position, each row's slot recorded, and what attention needs: the slot mask (None,
        or (groups, 1, g, (t+1)*g) additive) and the fed groups (e,) of `live` (None: all
        rows fed, or `live` is not whole groups)."""
        self.check_live()
        position = self.position
        if position == self.capacity:
            self.grow(min(2 * position, self.limit))
        mask = slot_mask(self, position)
        return mask, None if live is None else live_groups(live, self.group_size)

    def reserve(self, positions: int) -> None:
        """Make room for `positions` target tokens in all (capped by `limit`), so a search
        that knows about how long its hypotheses get grows the caches once, before the
        first step, instead of copying them at every doubling. Capacity is memory: on a CPU
        the heap reuses pages earlier batches touched, so reserve a likely length, not a
        far bound (`ModelStepDecoder.reserve`)."""
        self.check_live()
        positions = min(positions, self.limit)
        if positions > self.capacity:
            self.grow(positions)

    def release(self) -> None:
        """End incremental decoding: the state is consumed (a later step raises) and its
        caches are dropped, so their memory is free for the next batch's."""
        self.check_live()
        self.consumed = True
        self.self_k, self.self_v = [], []

    def check_live(self) -> None:
        """Refuse a state whose buffers were handed to a newer one by `reorder`."""
        if self.consumed:
            raise RuntimeError("this decoder state was consumed by reorder; "
                               "use the state it returned")

    def grow(self, new_capacity: int) -> None:
        """Enlarge the self-attention caches and ancestry to `new_capacity` positions, in
        place."""
        used = self.position

        def grown(old: Tensor) -> Tensor:
            shape = (*old.shape[:2], new_capacity, *old.shape[3:])  # (b, h, cap, g, d)
            new = old.new_empty(shape)
            new[:, :, :used] = old[:, :, :used]
            return new

        self.self_k = [grown(k) for k in self.self_k]
        self.self_v = [grown(v) for v in self.self_v]
        ancestry = self.ancestry.new_zeros(*self.ancestry.shape[:2], new_capacity)  # (b, g, cap)
        ancestry[:, :, :used] = self.ancestry[:, :, :used]
        self.ancestry = ancestry

    def reorder(self, new_order: Tensor, layout: Regroup | None = None) -> GroupedCache:
        """A state whose row j is row new_order[j] of this one (beam reordering, B -> B*beam
        expansion with `arange(B).repeat_interleave(beam)`, dropping sentences, or any
        other selection).

        The new layout keeps g rows per group when every block of g new rows comes from
        one old group: then only the ancestry table is permuted, and K/V are copied only
        for groups that move (shrinking, permuting sentences). Expanding g = 1 rows into
        blocks of k copies of one row makes groups of k. Anything else falls back to one
        row per group, each row's own history gathered. Deciding costs two host syncs,
        none when the caller gives the `layout` (see `Regroup`). This state is consumed:
        the returned one may share its buffers, so any later use of this one raises
        RuntimeError.
        """
        self.check_live()
        self.consumed = True
        g, groups, used = self.group_size, self.ancestry.size(0), self.position
        group_of = torch.div(new_order, g, rounding_mode="floor")  # (n',) old group
        if layout is None:
            new_g, src = self._find_layout(group_of, new_order.numel())
        else:
            new_g, src = _check_layout(layout, new_order.numel(), groups)
            if switch("NMT_CHECK_LAYOUT") == "1":  # a debugging aid: two host syncs
                _verify_layout(layout, self._find_layout(group_of, new_order.numel()),
                               groups)
        new_groups = new_order.numel() // new_g  # groups'
        if src is None:  # the same groups in the same places: encoder side unchanged
            cross_k, cross_v = self.cross_k, self.cross_v
            padding_mask, cross_mask = self.padding_mask, self.cross_mask
        else:
            cross_k = [_take_rows(k, src) for k in self.cross_k]
            cross_v = [v.index_select(0, src) for v in self.cross_v]
            padding_mask = self.padding_mask.index_select(0, src)
            cross_mask = (None if self.cross_mask is None
                          else self.cross_mask.index_select(0, src))
        cap = self.capacity
        if new_g == g:  # slots stay in their group: permute the ancestry, move whole groups
            ancestry = self.ancestry.view(-1, cap).index_select(0, new_order)
            ancestry = ancestry.view(-1, g, cap)  # (groups', g, capacity)
            self_k, self_v = self.self_k, self.self_v
            if src is not None:  # copy the groups that stay
                self_k = [_take_groups(c, src, used) for c in self_k]
                self_v = [_take_groups(c, src, used) for c in self_v]
        else:  # new layout: every row's own history gathered into its own slot
            self_k, self_v = _empty_caches(self.self_k, self.self_v, new_groups, cap, new_g)
            if used:
                slot_of = self.ancestry.view(-1, cap)[:, :used].index_select(0, new_order)
                for old, new in zip(self.self_k + self.self_v, self_k + self_v, strict=True):
                    _gather_history(old, new, group_of, slot_of, new_g)
            ancestry = torch.arange(new_g, device=new_order.device)  # (g',)
            ancestry = ancestry.view(1, new_g, 1).expand(new_groups, new_g, cap).clone()
        attention = (None if self.attention is None
                     else self.attention.index_select(0, new_order))
        return GroupedCache(cross_k=cross_k, cross_v=cross_v, padding_mask=padding_mask,
                            cross_mask=cross_mask, self_k=self_k, self_v=self_v,
                            ancestry=ancestry, limit=self.limit, group_size=new_g, position=used,
                            attention_layer=self.attention_layer, attention=attention)

    def _find_layout(self, group_of: Tensor, n_new: int) -> tuple[int, Tensor | None]:
        """The layout of an order whose new row j comes from old group group_of[j] (n',):
        rows per new group and the old group of each new group, None when that is every
        old group in place. Reads the order back: two host syncs."""
        groups = self.ancestry.size(0)
        new_g = _group_size(group_of, self.group_size, self.rows, n_new, groups)
        src = group_of.view(-1, new_g)[:, 0]  # (groups',) old group of each new group
        same_groups = src.numel() == groups and bool(torch.equal(src, torch.arange(
            groups, device=src.device)))
        return new_g, None if same_groups else src


class _GroupedLayer:
    """Layer `index`'s view of a GroupedCache at one position (a `LayerCache`): writes go
    to each row's own slot, the history is every slot of the group up to this position,
    and the slot mask keeps each row to its own ancestors."""

    def __init__(self, cache: GroupedCache, index: int, position: int, mask: Tensor | None,
                 live: Tensor | None, entries: Tensor | None = None) -> None:
        self.rows, self.live, self.entries = cache.rows, live, entries
        self._k, self._v = cache.self_k[index], cache.self_v[index]
        self._cross = cache.cross_k[index], cache.cross_v[index], cache.cross_mask
        self._position, self._mask = position, mask

    def write(self, k: Tensor, v: Tensor) -> None:
        groups, heads, _, g, _ = self._k.shape
        # (groups, heads, g, d): slot s of group b is row b * g + s
        self._k[:, :, self._position] = k.view(groups, g, heads, -1).transpose(1, 2)
        self._v[:, :, self._position] = v.view(groups, g, heads, -1).transpose(1, 2)

    def write_live(self, k: Tensor, v: Tensor) -> None:
        if self.entries is None:
            raise RuntimeError("write_live needs the fed rows as whole groups (entries)")
        _, heads, _, g, _ = self._k.shape
        # (entries, heads, g, d) into the live groups' slots at this position
        self._k[:, :, self._position].index_copy_(
            0, self.entries, k.view(-1, g, heads, k.size(-1)).transpose(1, 2))
        self._v[:, :, self._position].index_copy_(
            0, self.entries, v.view(-1, g, heads, v.size(-1)).transpose(1, 2))

    def history(self) -> tuple[Tensor, Tensor, Tensor | None]:
        end = self._position + 1
        keys = self._k[:, :, :end].flatten(2, 3)  # (groups, heads, (t+1)*g, d_k)
        values = self._v[:, :, :end].flatten(2, 3)  # (groups, heads, (t+1)*g, d_v)
        return keys, values, self._mask

    def encoder(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return self._cross


def live_groups(live: Tensor, g: int) -> Tensor | None:
    """The groups (e,) whose rows `live` (m,) lists, when it lists whole groups of g rows in
    slot order (the search feeds a sentence's whole beam; trusted, and checked under
    NMT_CHECK_LAYOUT=1 at the price of a host sync); None when m is no multiple of g."""
    if live.numel() % g:
        return None
    groups = torch.div(live.view(-1, g)[:, 0], g, rounding_mode="floor")  # (e,)
    if switch("NMT_CHECK_LAYOUT") == "1":
        whole = (groups[:, None] * g + torch.arange(g, device=live.device)).view(-1)
        if not torch.equal(whole, live):
            raise RuntimeError(f"live rows {live.tolist()} are not whole groups of {g}")
    return groups


def slot_mask(state: GroupedCache, position: int) -> Tensor | None:
    """Record that each row's key at `position` goes to its own slot, and return the
    additive mask (groups, 1, g, (position+1) * g), 0 where a slot holds the row's own
    ancestor and -inf elsewhere, that keeps each row to its own history; None when g == 1
    (one slot: nothing to mask). In the caches' dtype, built once for every layer's step
    (a boolean mask would cost each layer a negation and a masked fill)."""
    g = state.group_size
    if g == 1:
        return None
    slots = torch.arange(g, device=state.ancestry.device)
    state.ancestry[:, :, position] = slots
    ancestry = state.ancestry[:, :, : position + 1]  # (groups, g, t+1)
    mask = ancestry.unsqueeze(-1) == slots  # (groups, g, t+1, g)
    return additive_mask(mask.flatten(2).unsqueeze(1), state.self_v[0].dtype)  # (groups, 1, g, L)


def _empty_caches(like_k: list[Tensor], like_v: list[Tensor], groups: int, cap: int, g: int,
                  k_dim: int = -1) -> tuple[list[Tensor], list[Tensor]]:
    """Uninitialised self-attention buffers (groups, heads, cap, g, d) of every layer, with
    the heads (dim 1), d, dtype and device of the per-layer `like_k`/`like_v` tensors: d
    last, or for the keys in dim `k_dim` (2 for the transposed cross keys)."""

    def empty(likes: list[Tensor], d_dim: int) -> list[Tensor]:
        return [like.new_empty(groups, like.size(1), cap, g, like.size(d_dim))
                for like in likes]  # each (groups, heads, cap, g, d)

    return empty(like_k, k_dim), empty(like_v, -1)


def _group_size(group_of: Tensor, g: int, rows: int, n_new: int, groups: int) -> int:
    """Rows per group after a reorder whose new row j comes from old group group_of[j]:
    k when g == 1 and the new rows are blocks of k copies (an expansion), g when every
    block of g new rows stays within one old group, else 1."""
    if g == 1 and n_new > rows and n_new % rows == 0:
        candidate = n_new // rows
    elif g > 1 and n_new % g == 0:
        candidate = g
    else:
        return 1
    blocks = group_of.view(-1, candidate)  # (groups', candidate)
    return candidate if bool((blocks == blocks[:, :1]).all()) else 1


def _check_layout(layout: Regroup, n_new: int, groups: int) -> tuple[int, Tensor | None]:
    """`layout`'s rows per group and source groups, after the checks the host can make
    from sizes alone (ValueError): whole groups, and as many as `groups` (the old count)
    when they stay in place."""
    size, source = layout
    want = groups if source is None else source.numel()
    if size < 1 or n_new != want * size:
        raise ValueError(f"a reorder of {n_new} rows does not make {want} groups of {size}")
    return size, source


def _verify_layout(layout: Regroup, found: tuple[int, Tensor | None], groups: int) -> None:
    """Raise RuntimeError unless the layout a caller promised is the one its order has
    (`found`, from `GroupedCache._find_layout`; `groups` the old count, None sources
    standing for all of them in place)."""
    size, source = found
    in_place = torch.arange(groups)
    want = in_place if layout.source is None else layout.source.cpu()
    got = in_place if source is None else source.cpu()
    if size != layout.size or not torch.equal(got, want):
        raise RuntimeError(f"reorder promised groups of {layout.size} from old groups "
                           f"{want.tolist()}, but its order makes groups of {size} from "
                           f"{got.tolist()}")


def _take_rows(keys_t: Tensor, src: Tensor) -> Tensor:
    """Rows `src` of the transposed cross keys (groups, heads, d_k, src_len), in their
    memory layout: stored (.., src_len, d_k) for the fused kernel or transposed
    (nmt/inference/fused_attention.py `keys_layout`); a plain index_select would lay the
    first out as the second."""
    if keys_t.stride(-2) == 1 and keys_t.stride(-1) != 1:
        return keys_t.transpose(-1, -2).index_select(0, src).transpose(-1, -2)
    return keys_t.index_select(0, src)


def _take_groups(cache: Tensor, src: Tensor, used: int) -> Tensor:
    """Groups `src` of a (groups, heads, capacity, g, d) cache, first `used` positions
    copied (the rest is never read)."""
    new = cache.new_empty(src.numel(), *cache.shape[1:])  # (groups', heads, cap, g, d)
    if used:
        torch.index_select(cache[:, :, :used], 0, src, out=new[:, :, :used])  # no temporary
    return new


def _gather_history(old: Tensor, new: Tensor, group_of: Tensor, slot_of: Tensor,
                    new_g: int) -> None:
    """Write into `new` (groups', heads, cap, g', d) each new row's own key/value history
    from `old` (groups, heads, cap, g, d): row j at position p reads old group
    group_of[j], slot slot_of[j, p]; it lands in slot j % g' of group j // g'."""
    used = slot_of.size(1)
    positions = torch.arange(used, device=old.device)
    # advanced indices around the heads slice: (n', used, heads, d)
    picked = old[group_of[:, None], :, positions[None, :], slot_of]
    picked = picked.view(-1, new_g, used, old.size(1), old.size(-1))  # (groups', g', used, h, d)
    new[:, :, :used] = picked.permute(0, 3, 2, 1, 4)  # (groups', heads, used, g', d)
