"""The Transformer of "Attention Is All You Need": encoder, decoder, incremental decoding.

One weight matrix is shared by the source embedding, the target embedding and the output
projection (section 3.4). Masks are built once per forward: source padding becomes one
boolean SDPA mask reused by every encoder self-attention and decoder cross-attention layer,
and is skipped entirely when the batch has no padding; the decoder's causal mask is
`is_causal` (SDPA's on GPU, one cached mask per shape on CPU). Knowing whether a batch has
padding costs one host sync per `encode()` unless the caller passes `has_pad` (the training
loop may pass True to avoid it on GPU).

Incremental decoding (`init_state`, `decode_step`, `reorder_cache`) keeps a key/value cache
organised by GROUP: the g rows of one sentence (its beam) share one copy of the
cross-attention K/V, and their self-attention K/V live in g slots of preallocated per-group
buffers, written in place one position per step. A reorder within the groups (beam search's
per-step reordering) copies no key or value: it only permutes a small ancestry table
(which slot holds each row's key at each position) that the attention turns into a mask.
Whole groups are copied only when sentences leave (shrink) or the layout changes; using a
state after `reorder_cache` consumed it raises. Search code treats
`DecoderState` as opaque. Training uses `forward(..., select=rows)`, which projects only
the non-padding target positions to the vocabulary (`decode_features` + `logits` do the
same outside DistributedDataParallel).

Inputs longer than `cfg.max_positions` raise UsageError; `nmt translate` truncates first.
Imports torch only: no files, no CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.attention import key_padding_mask
from nmt.config import ModelConfig
from nmt.dropout import dropout
from nmt.layers import DecoderLayer, EncoderLayer, Positions, embedding_scale


@dataclass
class EncoderOutput:
    """Encoder result: `states` (batch, src_len, d_model), `padding_mask` (batch, src_len)
    True at PAD; `has_pad` None means "not known yet" (computed on first use)."""

    states: Tensor
    padding_mask: Tensor
    has_pad: bool | None = None

    def attn_mask(self) -> Tensor | None:
        """SDPA key mask (batch, 1, 1, src_len), or None when no row has padding."""
        if self.has_pad is None:
            self.has_pad = bool(self.padding_mask.any())  # one host sync, once per batch
        return key_padding_mask(self.padding_mask) if self.has_pad else None


@dataclass
class DecoderState:
    """Everything incremental decoding caches, for n = groups * g rows, g rows per group.

    Row r is slot r % g of group r // g. A group is one sentence (g = beam during beam
    search, 1 before the expansion), so the encoder side is stored once per group. The
    self-attention keys/values of every layer live in buffers (groups, heads, capacity,
    g, d) whose capacity doubles when full; `decode_step` writes row r's newest key into
    its own slot. `ancestry[b, s, p]` is the slot of group b that holds, at position p,
    the key of the prefix row (b, s) now extends; beam reordering permutes `ancestry`
    rows instead of copying the caches (see `Transformer.reorder_cache`).
    `attention_layer` picks the decoder layer whose encoder-decoder attention
    `decode_step(..., need_attention=True)` stores in `attention` (n, heads, src_len).
    """

    cross_k: list[Tensor]  # per layer (groups, heads, src_len, d_k)
    cross_v: list[Tensor]  # per layer (groups, heads, src_len, d_v)
    padding_mask: Tensor  # (groups, src_len) True at PAD
    cross_mask: Tensor | None  # (groups, 1, 1, src_len) True = attend; None: no padding
    self_k: list[Tensor]  # per layer (groups, heads, capacity, g, d_k); positions >= step unused
    self_v: list[Tensor]  # per layer (groups, heads, capacity, g, d_v)
    ancestry: Tensor  # (groups, g, capacity) long: slot holding each row's key per position
    group_size: int = 1  # g
    step: int = 0  # number of target tokens fed so far = position of the next one
    attention_layer: int = -1
    attention: Tensor | None = None
    consumed: bool = False  # set by reorder_cache: this state's buffers now belong to another
    # Buffers whose memory the state no longer uses (caches that a shrink or a growth
    # copied from, or handed in by `reserve_cache`), reused for the next new cache: their
    # pages are already mapped, fresh large ones would be page-faulted in afresh.
    free: list[Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """n = groups * g, the number of hypotheses decoded side by side."""
        return self.ancestry.size(0) * self.group_size


INITIAL_CAPACITY = 16  # target positions preallocated by init_state; doubled when full


class Transformer(nn.Module):
    """Encoder-decoder Transformer built from a ModelConfig alone (see module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.scale = embedding_scale(cfg.d_model)
        self.enc_positions = Positions(cfg)
        self.dec_positions = Positions(cfg)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the residual stream unnormalised: one final LayerNorm per stack.
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else None
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else None
        # Inference-time replacement of the output projection (a packed copy of the shared
        # matrix, see nmt/packed_linear.py); None: F.linear with `output_weight`.
        self.output_projection: nn.Module | None = None
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, mean=0.0, std=cfg.d_model ** -0.5)
            self.embed.weight[cfg.pad_id].zero_()

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection: the shared embedding matrix (vocab, d_model)."""
        return self.embed.weight

    def num_parameters(self) -> int:
        """Trainable parameters, the shared embedding counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Scaled token embeddings plus positions, then dropout: (..., len, d_model)."""
        x = self.embed(tokens) * self.scale + positions
        return dropout(x, self.cfg.dropout, self.training)

    def encode(self, src: Tensor, has_pad: bool | None = None) -> EncoderOutput:
        """Encode `src` (batch, src_len) of ids (pieces + EOS, right-padded with PAD).

        `has_pad` tells whether any row has padding; None computes it (one host sync).
        """
        padding_mask = src.eq(self.cfg.pad_id)  # (batch, src_len)
        if has_pad is None:
            has_pad = bool(padding_mask.any())  # the one host sync of a forward
        # (batch, 1, 1, src_len) or None, shared by every encoder layer
        mask = key_padding_mask(padding_mask) if has_pad else None
        x = self._embed(src, self.enc_positions(src.size(1)))  # (batch, src_len, d_model)
        for layer in self.encoder:
            x = layer(x, mask)
        if self.enc_norm is not None:
            x = self.enc_norm(x)
        return EncoderOutput(states=x, padding_mask=padding_mask, has_pad=has_pad)

    def decode(self, tgt_in: Tensor, enc: EncoderOutput) -> Tensor:
        """Logits (batch, tgt_len, vocab) for decoder input `tgt_in` (batch, tgt_len) =
        [BOS] + pieces, right-padded; position i sees tgt_in[:, :i+1] and the source."""
        return self.logits(self.decode_features(tgt_in, enc))

    def decode_features(self, tgt_in: Tensor, enc: EncoderOutput) -> Tensor:
        """Final decoder states (batch, tgt_len, d_model) before the output projection,
        so a loss can project only the non-padding positions with `logits()`."""
        mask = enc.attn_mask()
        x = self._embed(tgt_in, self.dec_positions(tgt_in.size(1)))  # (batch, tgt, d_model)
        for layer in self.decoder:
            cross_k, cross_v = layer.cross_attn.project_kv(enc.states)
            x = layer(x, cross_k, cross_v, mask)
        if self.dec_norm is not None:
            x = self.dec_norm(x)
        return x

    def logits(self, features: Tensor, out: Tensor | None = None) -> Tensor:
        """Output projection with the shared embedding matrix: (..., d_model) -> (..., vocab),
        in the compute dtype (the loss or search casts as it needs).

        `out` (at least rows x vocab, for 2-D `features`) receives the logits in its first
        rows when the plain projection runs; a packed `output_projection` returns a new
        tensor instead (its kernel has no out= form)."""
        if self.output_projection is not None:
            return self.output_projection(features)
        if out is None:
            return F.linear(features, self.embed.weight)
        return torch.mm(features, self.output_weight.t(), out=out[: features.size(0)])

    def forward(self, src: Tensor, tgt_in: Tensor, has_pad: bool | None = None,
                select: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (batch, tgt_len, vocab).

        With `select` (n,) flat indices into (batch * tgt_len), only those positions are
        projected and the result is (n, vocab): training passes the non-PAD target
        positions, so padding costs nothing in the biggest matmul or the loss. Going through
        `forward` (not `decode_features` + `logits`) keeps DistributedDataParallel's hooks.
        """
        enc = self.encode(src, has_pad=has_pad)
        if select is None:
            return self.decode(tgt_in, enc)
        features = self.decode_features(tgt_in, enc)  # (batch, tgt_len, d_model)
        flat = features.reshape(-1, features.size(-1))  # (batch * tgt_len, d_model)
        return self.logits(flat.index_select(0, select))  # (n, vocab)

    def init_state(self, enc: EncoderOutput, attention_layer: int = -1) -> DecoderState:
        """Start incremental decoding: cross-attention K/V of every layer, computed once,
        and an empty self-attention cache; one row (group of size 1) per sentence."""
        # Contiguous once here, so every step's matmuls read K/V in place (a transposed
        # view would make each step's bmm copy them).
        cross = [tuple(t.contiguous() for t in layer.cross_attn.project_kv(enc.states))
                 for layer in self.decoder]  # per layer (K, V), each (n, heads, src_len, d)
        n = enc.states.size(0)
        capacity = min(INITIAL_CAPACITY, self.cfg.max_positions)
        self_k, self_v = self._empty_caches(n, capacity, 1, cross[0][0])
        return DecoderState(cross_k=[k for k, _ in cross], cross_v=[v for _, v in cross],
                            padding_mask=enc.padding_mask, cross_mask=enc.attn_mask(),
                            self_k=self_k, self_v=self_v,
                            ancestry=torch.zeros(n, 1, capacity, dtype=torch.long,
                                                 device=enc.states.device),
                            attention_layer=attention_layer)

    def _empty_caches(self, groups: int, capacity: int, g: int, like: Tensor,
                      free: list[Tensor] | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """Uninitialised self-attention buffers of every layer, dtype/device of `like`,
        taken from the `free` buffers where possible."""
        cfg = self.cfg
        pool = [] if free is None else free

        def empty(d: int) -> list[Tensor]:
            return [_alloc(pool, (groups, cfg.heads, capacity, g, d), like)  # (b, h, cap, g, d)
                    for _ in self.decoder]

        return empty(cfg.head_dim_k), empty(cfg.head_dim_v)

    def decode_step(self, tokens: Tensor, state: DecoderState,
                    need_attention: bool = False, live: Tensor | None = None,
                    out: Tensor | None = None) -> Tensor:
        """Feed the newest token of each row, `tokens` (n,), at position `state.step`;
        update `state` in place and return next-token logits (n, vocab), computed for
        this one position only.

        With `live` (m,) row indices, `tokens` (m,) are the newest tokens of those rows
        only and the logits are (m, vocab): the other rows (finished sentences that a
        search keeps in the state until it compacts it, saving a cache copy per finished
        sentence) cost no projection, feed-forward or vocabulary matmul. They get zero
        keys/values at this position, so leave a row out only once it is done for good.

        With `out` (at least n or m rows, vocab), the logits are written into its first
        rows and that view is returned: a search reusing one buffer avoids a fresh
        (rows, vocab) allocation per step (large enough to be page-faulted in each time).
        A packed `output_projection` ignores it (see `logits`).

        With `need_attention`, the encoder-decoder attention of layer
        `state.attention_layer` is stored in `state.attention` (n or m, heads, src_len).
        """
        _check_live(state)
        position = state.step
        positions = self.dec_positions(1, offset=position)  # (1, d_model); checks the limit
        if position == state.ancestry.size(2):
            _grow(state, min(2 * position, self.cfg.max_positions))
        g = state.group_size
        slot_mask = None
        if g > 1:  # each row's newest key goes to its own slot; mask the others' history
            slots = torch.arange(g, device=tokens.device)
            state.ancestry[:, :, position] = slots
            ancestry = state.ancestry[:, :, : position + 1]  # (groups, g, t+1)
            slot_mask = ancestry.unsqueeze(-1) == slots  # (groups, g, t+1, g)
            slot_mask = slot_mask.flatten(2).unsqueeze(1)  # (groups, 1, g, (t+1)*g)
        x = self._embed(tokens[:, None], positions)  # (n, 1, d_model)
        want = state.attention_layer % len(self.decoder) if need_attention else -1
        for i, layer in enumerate(self.decoder):
            x, weights = layer.step(x, state.self_k[i], state.self_v[i], position, slot_mask,
                                    state.cross_k[i], state.cross_v[i], state.cross_mask,
                                    need_weights=i == want, live=live)
            if weights is not None:
                state.attention = weights  # (n, heads, src_len)
        if self.dec_norm is not None:
            x = self.dec_norm(x)
        state.step += 1
        return self.logits(x[:, 0], out=out)  # (n or m, vocab)

    def reserve_cache(self, state: DecoderState, positions: int,
                      buffers: list[Tensor] | None = None) -> None:
        """Make room in `state` for `positions` target tokens in all (capped by
        max_positions), so a search that knows its length limit grows the caches once,
        before the first step, instead of copying them at every doubling. Untouched
        capacity costs address space only. `buffers` (from `release_cache` of a finished
        state) lend their memory to this state's caches."""
        _check_live(state)
        state.free = _release(state.free, buffers or [])
        capacity = min(positions, self.cfg.max_positions)
        if capacity > state.ancestry.size(2):
            _grow(state, capacity)

    def release_cache(self, state: DecoderState) -> list[Tensor]:
        """End incremental decoding on `state`: the memory of its self-attention caches,
        as buffers for `reserve_cache` of a later state (a search over many batches thus
        maps its cache memory once). `state` is consumed."""
        _check_live(state)
        state.consumed = True
        return _release(state.free, state.self_k + state.self_v)

    def reorder_cache(self, state: DecoderState, new_order: Tensor) -> DecoderState:
        """A state whose row j is row new_order[j] of `state` (beam reordering, B -> B*beam
        expansion with `arange(B).repeat_interleave(beam)`, dropping sentences, or any
        other selection).

        The new layout keeps g rows per group when every block of g new rows comes from
        one old group: then only the ancestry table is permuted, and K/V are copied only
        for groups that move (shrinking, permuting sentences). Expanding g = 1 rows into
        blocks of k copies of one row makes groups of k. Anything else falls back to one
        row per group, each row's own history gathered. Deciding costs one host sync.
        `state` is consumed: the returned state may share its buffers, so any later use
        of `state` raises RuntimeError.
        """
        _check_live(state)
        state.consumed = True
        g, groups, used = state.group_size, state.ancestry.size(0), state.step
        n_new = new_order.numel()
        group_of = torch.div(new_order, g, rounding_mode="floor")  # (n',) old group
        new_g = _group_size(group_of, g, state.rows, n_new, groups)
        src = group_of.view(-1, new_g)[:, 0]  # (groups',) old group of each new group
        same_groups = src.numel() == groups and bool(torch.equal(src, torch.arange(
            groups, device=src.device)))
        if same_groups:
            cross_k, cross_v = state.cross_k, state.cross_v
            padding_mask, cross_mask = state.padding_mask, state.cross_mask
        else:
            cross_k = [k.index_select(0, src) for k in state.cross_k]
            cross_v = [v.index_select(0, src) for v in state.cross_v]
            padding_mask = state.padding_mask.index_select(0, src)
            cross_mask = (None if state.cross_mask is None
                          else state.cross_mask.index_select(0, src))
        capacity = state.ancestry.size(2)
        if new_g == g:  # slots stay in their group: permute the ancestry, move whole groups
            ancestry = state.ancestry.view(-1, capacity).index_select(0, new_order)
            ancestry = ancestry.view(-1, g, capacity)  # (groups', g, capacity)
            self_k, self_v = state.self_k, state.self_v
            free = state.free
            if not same_groups:  # copy into free buffers; the old ones become free
                self_k = [_take_groups(c, src, used, free) for c in self_k]
                self_v = [_take_groups(c, src, used, free) for c in self_v]
                free = _release(free, state.self_k + state.self_v)
        else:  # new layout: every row's own history gathered into its own slot
            free = state.free
            self_k, self_v = self._empty_caches(src.numel(), capacity, new_g,
                                                state.cross_k[0], free)
            if used:
                slot_of = state.ancestry.view(-1, capacity)[:, :used].index_select(0, new_order)
                for old, new in zip(state.self_k + state.self_v, self_k + self_v, strict=True):
                    _gather_history(old, new, group_of, slot_of, new_g)
            free = _release(free, state.self_k + state.self_v)
            ancestry = torch.arange(new_g, device=new_order.device)  # (g',)
            ancestry = ancestry.view(1, new_g, 1).expand(src.numel(), new_g, capacity).clone()
        attention = (None if state.attention is None
                     else state.attention.index_select(0, new_order))
        return DecoderState(cross_k=cross_k, cross_v=cross_v, padding_mask=padding_mask,
                            cross_mask=cross_mask, self_k=self_k, self_v=self_v,
                            ancestry=ancestry, group_size=new_g, step=used, free=free,
                            attention_layer=state.attention_layer, attention=attention)


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


def _take_groups(cache: Tensor, src: Tensor, used: int, free: list[Tensor]) -> Tensor:
    """Groups `src` of a (groups, heads, capacity, g, d) cache, first `used` positions
    copied (the rest is never read), into a buffer from `free` when one is large enough."""
    new = _alloc(free, (src.numel(), *cache.shape[1:]), cache)  # (groups', heads, cap, g, d)
    if used:
        torch.index_select(cache[:, :, :used], 0, src, out=new[:, :, :used])  # no temporary
    return new


def _alloc(free: list[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised tensor of `shape`, dtype/device of `like`, carved from the smallest
    large-enough buffer of `free` (removed from the list), else newly allocated."""
    numel = math.prod(shape)
    fits = [b for b in free if b.numel() >= numel and b.dtype == like.dtype
            and b.device == like.device]
    if not fits:
        return like.new_empty(shape)
    buffer = min(fits, key=Tensor.numel)
    del free[next(i for i, b in enumerate(free) if b is buffer)]  # by identity, not ==
    return buffer[:numel].view(shape)


def _release(free: list[Tensor], tensors: list[Tensor]) -> list[Tensor]:
    """`free` plus the whole flat storage of each of `tensors` (once each)."""
    out = list(free)
    seen = {b.data_ptr() for b in out}
    for tensor in tensors:
        base = tensor if tensor._base is None else tensor._base
        flat = base.view(-1)  # (numel,)
        if flat.data_ptr() not in seen:
            seen.add(flat.data_ptr())
            out.append(flat)
    return out


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


def _check_live(state: DecoderState) -> None:
    """Refuse a state whose buffers were handed to a newer one by reorder_cache."""
    if state.consumed:
        raise RuntimeError("this DecoderState was consumed by reorder_cache; "
                           "use the state it returned")


def _grow(state: DecoderState, capacity: int) -> None:
    """Enlarge the self-attention caches and ancestry of `state` to `capacity` positions,
    in place."""
    used = state.step

    def grown(old: Tensor) -> Tensor:
        new = _alloc(state.free, (*old.shape[:2], capacity, *old.shape[3:]), old)  # (b,h,cap,g,d)
        new[:, :, :used] = old[:, :, :used]
        return new

    old = state.self_k + state.self_v
    state.self_k = [grown(k) for k in state.self_k]
    state.self_v = [grown(v) for v in state.self_v]
    state.free = _release(state.free, old)
    ancestry = state.ancestry.new_zeros(*state.ancestry.shape[:2], capacity)  # (b, g, cap)
    ancestry[:, :, :used] = state.ancestry[:, :, :used]
    state.ancestry = ancestry
