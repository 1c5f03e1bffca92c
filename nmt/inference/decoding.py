"""Incremental decoding of a Transformer for search: one target position per step.

`init_state` computes the cross-attention K/V of every decoder layer once per sentence and
opens an empty key/value cache: `GroupedCache` (nmt/inference/kv_cache.py), or another of the
`DecodingCache` protocol (the tests' readable reference, tests/helpers/plain_cache.py).
`decode_step` feeds each row's newest token at the next position and returns next-token
logits for that position only; each decoder layer sees its cache through one interface
(`LayerCache`, nmt/inference/layer_step.py). `ModelStepDecoder` adapts this to the search's
`StepDecoder` protocol (nmt/inference/search.py): next-token logits, row reordering,
finished rows skipped; search code never sees a cache. `greedy_search` is the one-call
greedy decoder validation uses.

Memory has an explicit owner. A `DecodingWorkspace` (one per model, kept by the engine)
holds the model's output projection layer where it has one (nmt/inference/backends.py
`prepare`) and lends the (rows, vocab) logits buffer its previous batch's decoder left to
the next one (`with workspace.decoder(src) as decoder: ...`). The key/value caches are
plain tensors freed with their decoder (why no pool: nmt/inference/kv_cache.py). Nothing
global, no finalisers.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

import torch
from torch import Tensor, nn

from nmt.config import DecodeConfig
from nmt.inference import backends
from nmt.inference.fused_attention import keys_layout
from nmt.inference.int8_linear import Int8Linear
from nmt.inference.kernel_linear import KernelLinear
from nmt.inference.kv_cache import GroupedCache, Regroup
from nmt.inference.layer_step import LayerCache, decoder_layer_step, encoder_layer
from nmt.inference.native_step import NativeStep, plan_for
from nmt.inference.rest_mass import RestMass, VocabularyMoments
from nmt.inference.search import beam_search, greedy_decode, max_output_lengths
from nmt.model.transformer import EncoderOutput, Transformer
from nmt.switches import switch

_DEFAULTS = DecodeConfig()


class DecodingCache(Protocol):
    """What decoding needs of a key/value cache (GroupedCache; the tests' PlainCache):
    per-layer views for a step, reordering, and an explicit end."""

    position: int  # target tokens fed so far = the position of the next one
    attention_layer: int
    attention: Tensor | None  # (n, heads, src_len) when a step stored it
    consumed: bool

    @classmethod
    def start(cls, cross_k: list[Tensor], cross_v: list[Tensor], padding_mask: Tensor,
              cross_mask: Tensor | None, limit: int, attention_layer: int = -1
              ) -> DecodingCache:
        """A state of one row per sentence around the per-layer cross keys (n, heads,
        d_k, src_len: transposed) and values (n, heads, src_len, d_v)."""
        ...

    @property
    def rows(self) -> int: ...

    def layers(self, live: Tensor | None = None) -> Sequence[LayerCache]: ...

    def reorder(self, new_order: Tensor, layout: Regroup | None = None) -> DecodingCache: ...

    def reserve(self, positions: int) -> None: ...

    def release(self) -> None: ...

    def check_live(self) -> None: ...


def init_state(model: Transformer, enc: EncoderOutput, attention_layer: int = -1,
               cache: type[DecodingCache] = GroupedCache) -> DecodingCache:
    """Start incremental decoding: cross-attention K/V of every layer, computed once,
    and an empty self-attention cache of type `cache`; one row per sentence.
    `attention_layer` picks the layer whose cross-attention `need_attention` stores."""
    # Laid out once here as every step's attention reads them (fused_attention.keys_layout:
    # d contiguous for the C kernel, else transposed in memory for q @ K^T); values as
    # they are. A strided view would cost each step.
    cross = [layer.cross_attn.project_kv(enc.states) for layer in model.decoder]
    keys_t = [keys_layout(k) for k, _ in cross]  # (n, heads, d_k, src_len)
    values = [v.contiguous() for _, v in cross]  # (n, heads, src_len, d_v)
    return cache.start(keys_t, values, enc.padding_mask, enc.attn_mask(),
                       model.config.max_positions, attention_layer)


def decode_step(model: Transformer, tokens: Tensor, state: DecodingCache, *,
                need_attention: bool = False, live: Tensor | None = None,
                out: Tensor | None = None, projection: nn.Module | None = None,
                weight: Tensor | None = None, rest: RestMass | None = None,
                native: NativeStep | None = None) -> Tensor:
    """Feed the newest token of each row, `tokens` (n,), at position `state.position`;
    update `state` in place and return next-token logits (n, vocab), computed for
    this one position only.

    With `live` (m,) row indices, `tokens` (m,) are the newest tokens of those rows
    only and the logits are (m, vocab): the other rows (finished sentences that a
    search keeps in the state until it compacts it, saving a cache copy per finished
    sentence) cost no projection, feed-forward or vocabulary matmul. They get no
    keys/values at this position (zeros, or on a CPU with the attention kernel nothing:
    their slots keep what they held), so leave a row out only once it is done for good.

    With `out` (at least n or m rows, vocab), the logits are written into its first
    rows and that view is returned: a search reusing one buffer avoids a fresh
    (rows, vocab) allocation per step (large enough to be page-faulted in each time).
    A packed `projection` of the output weight replaces the plain matmul; it ignores
    `out` (its kernel has no out= form and returns a new tensor). `weight` (V', d_model),
    rows of the output weight (a shortlist's), replaces it in the plain matmul; `rest`
    then adds the mass of the pieces it leaves out to the PAD column
    (nmt/inference/rest_mass.py).

    With `need_attention`, the encoder-decoder attention of layer
    `state.attention_layer` is stored in `state.attention` (n or m, heads, src_len).

    With `native` (nmt/inference/native_step.py), the decoder layers run as one C call
    where it takes the step (not with `need_attention`), with the same results.
    """
    state.check_live()
    positions = model.dec_positions(1, offset=state.position)  # (1, d_model); checks the limit
    features = None
    if native is not None and not need_attention and isinstance(state, GroupedCache):
        features = native.step(tokens, state, positions, live)  # (n or m, d_model) or None
    if features is None:
        features = _layers(model, tokens, state, positions, live, need_attention)
    logits = _logits(model, features, out, projection, weight)  # (n or m, vocab)
    return logits if rest is None else rest.fold_into(logits, features)


def _layers(model: Transformer, tokens: Tensor, state: DecodingCache, positions: Tensor,
            live: Tensor | None, need_attention: bool) -> Tensor:
    """`decode_step`'s decoder layers in PyTorch: the features (n or m, d_model) of
    `tokens` at `positions`; the state advanced by one position."""
    x = model.embed_tokens(tokens[:, None], positions)  # (n, 1, d_model)
    want = state.attention_layer % len(model.decoder) if need_attention else -1
    for i, (layer, cache) in enumerate(zip(model.decoder, state.layers(live), strict=True)):
        x, weights = decoder_layer_step(layer, x, cache, need_weights=i == want)
        if weights is not None:
            state.attention = weights  # (n, heads, src_len)
    if model.dec_norm is not None:
        x = model.dec_norm(x)
    state.position += 1
    return x[:, 0]


def _logits(model: Transformer, features: Tensor, out: Tensor | None,
            projection: nn.Module | None, weight: Tensor | None = None) -> Tensor:
    """`model.logits` of (rows, d_model) `features`, through the packed `projection` when
    given, else with `weight` (default: the model's output weight), into the first rows of
    `out` when given: (rows, vocab or V')."""
    if projection is not None:
        return projection(features)
    if weight is None and out is None:
        return model.logits(features)
    weight = model.output_weight if weight is None else weight
    if out is None:
        return torch.mm(features, weight.t())
    return torch.mm(features, weight.t(), out=out[: features.size(0)])


class DecodingWorkspace:
    """What one model's step decoders hand on from batch to batch: the logits buffer of the
    last closed decoder (CPU), the packed output projection, and the plan of the native
    decoder step where it runs the model (nmt/inference/native_step.py).

    Lent to one decoder at a time: `decoder(src)` takes the buffer, the decoder's `close()`
    gives its own back; a second decoder opened meanwhile allocates afresh (two live
    decoders never share memory). Keep one per model for as long as it translates. It
    holds at most one buffer, the largest batch's (rows, vocab) logits.
    """

    def __init__(self, model: Transformer, projection: nn.Module | None = None) -> None:
        """`projection`: the layer of the vocabulary matmul, the biggest of a step (what
        `backends.prepare` returned); None: the plain matmul with the output weight."""
        self.model = model
        self.projection = projection
        self.native = plan_for(model)  # None: the PyTorch layers decode
        self._logits: Tensor | None = None
        self._moments: VocabularyMoments | None = None  # made by the first shortlist

    def decoder(self, src: Tensor, columns: Tensor | None = None) -> ModelStepDecoder:
        """A step decoder over `src` (batch, src_len) that reuses this workspace; close it
        (or use it as a context manager) to leave its memory to the next one. `columns`
        (V',) sorted target ids, the specials first: score only those (a shortlist)."""
        return ModelStepDecoder(self.model, src, self, columns=columns)

    def restricted(self, columns: Tensor) -> tuple[nn.Module | None, Tensor | None]:
        """The output projection (of this workspace's kind: int8, packed or plain) and
        weight for the rows `columns` of the output weight only (V', d_model); no weight
        with an int8 projection (its rows come from the int8 copy)."""
        projection = self.projection
        if isinstance(projection, Int8Linear | KernelLinear) and projection.quantized is not None:
            with torch.no_grad():  # int8: quantized once, not per batch
                return projection.rows(columns), None
        weight = self.model.output_weight.index_select(0, columns)  # (V', d_model)
        if self.projection is None:
            return None, weight
        precision = "bf16" if weight.dtype == torch.bfloat16 else "fp32"
        with torch.no_grad():
            return backends.layer(weight, None, precision), weight

    def rest_mass(self, columns: Tensor) -> RestMass | None:
        """The estimator of the mass a shortlist of `columns` leaves out (None: nothing,
        or NMT_SHORTLIST_REST=0)."""
        if switch("NMT_SHORTLIST_REST") == "0":
            return None
        if self._moments is None:
            self._moments = VocabularyMoments(self.model.output_weight)
        return self._moments.rest(columns)

    def take(self) -> Tensor | None:
        """The pooled logits buffer, leaving the workspace empty."""
        lent, self._logits = self._logits, None
        return lent

    def give_back(self, logits: Tensor | None) -> None:
        """Keep a finished decoder's logits buffer for the next one."""
        self._logits = logits


def likely_positions(src_len: int) -> int:
    """Target positions to preallocate for sources of at most `src_len` pieces: 1.5 times
    that plus 8 (BOS, EOS and slack), which covers nearly every hypothesis of a language
    pair of similar lengths. The search's limit (`--max-len-a/b`) is a bound, not a length:
    on a CPU freed blocks stay in the heap (nmt/host_memory.py), so capacity reserved for
    the bound is memory each worker keeps (docs/performance.md)."""
    return src_len + src_len // 2 + 8


class ModelStepDecoder:
    """StepDecoder over a `Transformer` for one batch: encodes once, then decodes one token
    at a time.

    The log-probabilities a step returns live in a buffer that the next step overwrites
    (one (rows, V) allocation per search instead of two per step, each big enough to be
    page-faulted in afresh): use them before the next `step`, or copy them. With a
    `workspace` on a CPU, the decoder starts from the logits buffer the workspace's
    previous decoder left, and `close()` (or leaving its `with` block) gives its own back.
    Without one it allocates afresh. A closed decoder cannot step.
    """

    def __init__(self, model: Transformer, src: Tensor,
                 workspace: DecodingWorkspace | None = None,
                 cache: type[DecodingCache] = GroupedCache,
                 columns: Tensor | None = None) -> None:
        self.model = model
        self.state = init_state(model, model.encode(src, layer_step=encoder_layer),
                                cache=cache)
        self._likely = likely_positions(src.size(1))
        self.projection = None if workspace is None else workspace.projection
        # A shortlist: the search sees columns 0..V'-1 (token `columns[c]`), the specials
        # first, so their ids are their columns.
        self.columns, self.weight, self.rest = columns, None, None
        if columns is not None:
            if workspace is None:
                workspace = DecodingWorkspace(model)
            self.projection, self.weight = workspace.restricted(columns)
            self.rest = workspace.rest_mass(columns)
        self._workspace = workspace if src.device.type == "cpu" else None
        self._logits = self._workspace.take() if self._workspace is not None else None
        plan = None if self._workspace is None else self._workspace.native
        self._native = None if plan is None else plan.stepper()

    def __enter__(self) -> ModelStepDecoder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End decoding: drop the caches; with a workspace, leave the logits buffer to its
        next decoder. Idempotent."""
        if self.state.consumed:
            return
        self.state.release()
        if self._workspace is not None:
            self._workspace.give_back(self._logits)

    def step(self, tokens: Tensor) -> Tensor:
        """Next-token logits (N, V) in the model's precision (over the shortlist's columns
        when there is one); the search normalises them. A view of this decoder's buffer,
        which the next step overwrites: copy what must outlive it."""
        return decode_step(self.model, self._ids(tokens), self.state,
                           out=self._out(tokens.numel()), projection=self.projection,
                           weight=self.weight, rest=self.rest, native=self._native)

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """Like `step` for rows `rows` (m,) of the `n_rows` only, `tokens` (m,) -> logits
        (m, V); the other rows are finished for good (see `decode_step`)."""
        return decode_step(self.model, self._ids(tokens), self.state, live=rows,
                           out=self._out(tokens.numel()), projection=self.projection,
                           weight=self.weight, rest=self.rest, native=self._native)

    def _ids(self, tokens: Tensor) -> Tensor:
        """The token ids of the search's columns (the same without a shortlist)."""
        return tokens if self.columns is None else self.columns[tokens]

    def reserve(self, positions: int) -> None:
        """Preallocate the key/value caches for the tokens the search will likely feed:
        `positions` at most, fewer when the sources are short (`likely_positions`); a
        longer hypothesis grows them by doubling."""
        self.state.reserve(min(positions, self._likely))

    def reorder(self, new_order: Tensor, layout: Regroup | None = None) -> None:
        """Select/duplicate rows of the key/value cache and the encoder mask; `layout`,
        when known, spares the cache reading the order back (see kv_cache.Regroup)."""
        self.state = self.state.reorder(new_order, layout)

    def regroup(self, new_order: Tensor, group_size: int, source: Tensor | None) -> None:
        """`reorder` with its layout (the search's `regroup`, nmt/inference/search.py):
        the cache takes it from `Regroup(group_size, source)` instead of reading the order
        back to the host (two syncs per reorder on a GPU)."""
        self.reorder(new_order, Regroup(group_size, source))

    def _out(self, rows: int) -> Tensor | None:
        """The reused logits buffer, grown to at least `rows` rows (model dtype); None when
        the output projection is packed (it allocates its own output)."""
        if self.projection is not None:
            return None
        weight = self.model.output_weight if self.weight is None else self.weight
        if (self._logits is None or self._logits.size(0) < rows
                or self._logits.size(1) != weight.size(0)
                or self._logits.dtype != weight.dtype):
            self._logits = weight.new_empty(rows, weight.size(0))  # (rows, V)
        return self._logits


@torch.no_grad()
def greedy_search(model: Transformer, src: Tensor, max_len_a: float = _DEFAULTS.max_len_a,
                  max_len_b: int = _DEFAULTS.max_len_b, min_len: int = _DEFAULTS.min_len
                  ) -> list[list[int]]:
    """Greedy piece ids (without EOS) for a padded source batch (B, S); for validation BLEU.

    The caller puts the model in eval mode (dropout off) and back; gradients are off here.
    """
    cap = model.config.max_positions - 1
    max_lens = max_output_lengths(src, max_len_a, max_len_b, cap)
    with ModelStepDecoder(model, src) as decoder:
        hyps = greedy_decode(decoder, max_lens, alpha=0.0, min_len=min_len)  # tokens only
    return [h.tokens for h in hyps]


@torch.no_grad()
def search_ids(model: Transformer, src: Tensor, cfg: DecodeConfig = _DEFAULTS
               ) -> list[list[int]]:
    """Best piece ids (without EOS) of each sentence of a padded source batch (B, S) by
    beam search with `cfg`'s beam, length penalty and length limits (beam 1: greedy), as
    `nmt translate` decodes; for validation BLEU. The caller puts the model in eval mode
    (dropout off) and back; gradients are off here."""
    if cfg.beam == 1:
        return greedy_search(model, src, cfg.max_len_a, cfg.max_len_b, cfg.min_len)
    max_lens = max_output_lengths(src, cfg.max_len_a, cfg.max_len_b,
                                  model.config.max_positions - 1)
    with ModelStepDecoder(model, src) as decoder:
        hyps = beam_search(decoder, max_lens, beam=cfg.beam, alpha=cfg.alpha, nbest=1,
                           min_len=cfg.min_len)
    return [h[0].tokens if h else [] for h in hyps]
