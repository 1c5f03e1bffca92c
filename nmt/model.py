"""The Transformer of "Attention Is All You Need": encoder, decoder, incremental decoding.

One weight matrix is shared by the source embedding, the target embedding and the output
projection (section 3.4). Masks are built once per forward: source padding becomes one
boolean SDPA mask reused by every encoder self-attention and decoder cross-attention layer,
and is skipped entirely when the batch has no padding; the decoder's causal mask is SDPA's
`is_causal`. Knowing whether a batch has padding costs one host sync per `encode()` unless
the caller passes `has_pad` (the training loop may pass True to avoid it on GPU).

Incremental decoding (`init_state`, `decode_step`, `reorder_cache`) keeps a key/value cache:
cross-attention K/V of every layer are computed once per sentence (and copied by a reorder
only when rows change sentence), self-attention K/V are written in place into preallocated
buffers, one position per step. `reorder_cache` consumes its input state: the new state
reuses the old buffers as the destination of the next reorder (ping-pong, no allocation
or page faults per step), and using a consumed state raises. Search code treats
`DecoderState` as opaque. Training uses `forward` (or
`decode_features` + `logits` to project only non-padding positions).

Inputs longer than `cfg.max_positions` raise UsageError; `nmt translate` truncates first.
Imports torch only: no files, no CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.attention import key_padding_mask
from nmt.config import ModelConfig
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
    """Everything incremental decoding caches; dim 0 of every tensor is the row (n).

    Self-attention keys/values live in preallocated buffers (one per layer, contiguous so
    a slice of them feeds batched matmuls without a copy) whose capacity doubles when
    full, so a step writes in place instead of concatenating. `rows` holds
    the sentence each row belongs to: a reorder that keeps every row within its sentence
    (beam search within a beam) leaves the per-sentence cross-attention K/V and masks
    untouched. `attention_layer` picks the decoder layer whose encoder-decoder attention
    `decode_step(..., need_attention=True)` stores in `attention` (n, heads, src_len).
    """

    cross_k: list[Tensor]  # per layer (n, heads, src_len, d_k)
    cross_v: list[Tensor]  # per layer (n, heads, src_len, d_v)
    padding_mask: Tensor  # (n, src_len) True at PAD
    cross_mask: Tensor | None  # (n, 1, 1, src_len) True = attend; None: no padding
    rows: Tensor  # (n,) sentence index of each row
    self_k: list[Tensor]  # per layer (n, heads, capacity, d_k); positions >= step unused
    self_v: list[Tensor]  # per layer (n, heads, capacity, d_v)
    step: int = 0  # number of target tokens fed so far = position of the next one
    attention_layer: int = -1
    attention: Tensor | None = None
    spare_k: list[Tensor] | None = None  # buffers of the previous state, reused by reorders
    spare_v: list[Tensor] | None = None
    consumed: bool = False  # set by reorder_cache: this state's buffers now belong to another


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
        return F.dropout(x, self.cfg.dropout, self.training)

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

    def logits(self, features: Tensor) -> Tensor:
        """Output projection with the shared embedding matrix: (..., d_model) -> (..., vocab),
        in the compute dtype (the loss or search casts as it needs)."""
        return F.linear(features, self.embed.weight)

    def forward(self, src: Tensor, tgt_in: Tensor, has_pad: bool | None = None) -> Tensor:
        """Teacher-forced logits (batch, tgt_len, vocab)."""
        return self.decode(tgt_in, self.encode(src, has_pad=has_pad))

    def init_state(self, enc: EncoderOutput, attention_layer: int = -1) -> DecoderState:
        """Start incremental decoding: cross-attention K/V of every layer, computed once,
        and an empty self-attention cache."""
        cross = [layer.cross_attn.project_kv(enc.states) for layer in self.decoder]
        cross_k, cross_v = [k for k, _ in cross], [v for _, v in cross]
        n, cfg = enc.states.size(0), self.cfg
        capacity = min(INITIAL_CAPACITY, cfg.max_positions)
        dtype, device = cross_k[0].dtype, cross_k[0].device
        self_k = [torch.empty(n, cfg.heads, capacity, cfg.head_dim_k, dtype=dtype,
                              device=device) for _ in self.decoder]  # (n, heads, cap, d_k)
        self_v = [torch.empty(n, cfg.heads, capacity, cfg.head_dim_v, dtype=dtype,
                              device=device) for _ in self.decoder]  # (n, heads, cap, d_v)
        return DecoderState(cross_k=cross_k, cross_v=cross_v, padding_mask=enc.padding_mask,
                            cross_mask=enc.attn_mask(), rows=torch.arange(n, device=device),
                            self_k=self_k, self_v=self_v, attention_layer=attention_layer)

    def decode_step(self, tokens: Tensor, state: DecoderState,
                    need_attention: bool = False) -> Tensor:
        """Feed the newest token of each row, `tokens` (n,), at position `state.step`;
        update `state` in place and return next-token logits (n, vocab), computed for
        this one position only.

        With `need_attention`, the encoder-decoder attention of layer
        `state.attention_layer` is stored in `state.attention` (n, heads, src_len).
        """
        _check_live(state)
        position = state.step
        positions = self.dec_positions(1, offset=position)  # (1, d_model); checks the limit
        if position == state.self_k[0].size(2):
            _grow(state, min(2 * position, self.cfg.max_positions))
        x = self._embed(tokens[:, None], positions)  # (n, 1, d_model)
        want = state.attention_layer % len(self.decoder) if need_attention else -1
        for i, layer in enumerate(self.decoder):
            x, weights = layer.step(x, state.self_k[i], state.self_v[i], position,
                                    state.cross_k[i], state.cross_v[i], state.cross_mask,
                                    need_weights=i == want)
            if weights is not None:
                state.attention = weights[:, :, 0]  # (n, heads, src_len)
        if self.dec_norm is not None:
            x = self.dec_norm(x)
        state.step += 1
        return self.logits(x[:, 0])  # (n, vocab)

    def reorder_cache(self, state: DecoderState, new_order: Tensor) -> DecoderState:
        """A state whose row j is row new_order[j] of `state` (beam reordering, or B ->
        B*beam expansion with `arange(B).repeat_interleave(beam)`).

        Cross-attention K/V and masks are copied only when some row changes sentence
        (expansion, shrinking, arbitrary permutations); checking that is one host sync.
        `state` is consumed: its buffers become the spare of the returned state, so any
        later use of `state` raises RuntimeError.
        """
        _check_live(state)
        state.consumed = True
        rows = state.rows.index_select(0, new_order)
        if rows.shape == state.rows.shape and torch.equal(rows, state.rows):
            cross_k, cross_v = state.cross_k, state.cross_v
            padding_mask, cross_mask = state.padding_mask, state.cross_mask
        else:
            cross_k = [k.index_select(0, new_order) for k in state.cross_k]
            cross_v = [v.index_select(0, new_order) for v in state.cross_v]
            padding_mask = state.padding_mask.index_select(0, new_order)
            cross_mask = (None if state.cross_mask is None
                          else state.cross_mask.index_select(0, new_order))
        attention = (None if state.attention is None
                     else state.attention.index_select(0, new_order))
        return DecoderState(cross_k=cross_k, cross_v=cross_v, padding_mask=padding_mask,
                            cross_mask=cross_mask, rows=rows,
                            self_k=_pick_used(state.self_k, new_order, state.step, state.spare_k),
                            self_v=_pick_used(state.self_v, new_order, state.step, state.spare_v),
                            spare_k=state.self_k, spare_v=state.self_v,
                            step=state.step, attention_layer=state.attention_layer,
                            attention=attention)


def _pick_used(caches: list[Tensor], new_order: Tensor, used: int,
               spares: list[Tensor] | None) -> list[Tensor]:
    """Rows `new_order` of each (n, heads, capacity, d) cache, written into the matching
    spare buffer when it has the right shape (else a new one); only the `used` positions
    are copied, the rest is never read."""
    out = []
    for i, cache in enumerate(caches):
        shape = (new_order.size(0), *cache.shape[1:])  # (n', heads, capacity, d)
        new = spares[i] if spares is not None and spares[i].shape == shape else None
        if new is None:
            new = cache.new_empty(shape)
        torch.index_select(cache[:, :, :used], 0, new_order, out=new[:, :, :used])
        out.append(new)
    return out


def _check_live(state: DecoderState) -> None:
    """Refuse a state whose buffers were handed to a newer one by reorder_cache."""
    if state.consumed:
        raise RuntimeError("this DecoderState was consumed by reorder_cache; "
                           "use the state it returned")


def _grow(state: DecoderState, capacity: int) -> None:
    """Enlarge the self-attention caches of `state` to `capacity` positions, in place."""
    used = state.step

    def grown(old: Tensor) -> Tensor:
        new = old.new_empty(old.size(0), old.size(1), capacity, old.size(3))  # (n, h, cap, d)
        new[:, :, :used] = old[:, :, :used]
        return new

    state.self_k = [grown(k) for k in state.self_k]
    state.self_v = [grown(v) for v in state.self_v]
    state.spare_k = state.spare_v = None  # the wrong capacity now; reorders allocate anew
