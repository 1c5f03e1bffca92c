"""Incremental decoding of the network, one target position a step, with the CPU's fast paths.

The network (nmt/model) is the paper's, computed over whole sequences; this module runs its
layers one position at a time over a key/value cache, reading their parameters:
`decoder_layer_step` (self-attention that writes this position's key/value and attends over
the history, encoder-decoder attention over the encoder's K/V computed once, feed-forward)
and `encoder_layer` (an encoder layer, for `model.encode(src, layer_step=encoder_layer)`).
On a CPU a step's attention runs the C kernel of nmt/inference/fused_attention.py where it
takes the operands, and a post-norm residual the add + LayerNorm kernel of
nmt/inference/add_norm.py; elsewhere PyTorch's ops. tests/inference/test_layer_step.py
holds every path to the network's own forward.

Caches are decoding's business (nmt/inference/kv_cache.py); a layer's step sees its part of
the state through one interface, `LayerCache`: project -> write -> attend. The n rows decoded
side by side are folded as (entries, n // entries) queries: the cache hands back keys of
shape (entries, heads, length, d) and the n rows are entries * g consecutive queries,
g = n // entries, so rows that share a history (a sentence's beam) read it from memory
once. A plain cache has one entry per row (g = 1).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.inference import add_norm, fused_attention
from nmt.model.attention import CrossAttention, SelfAttention, apply_mask_, masked_scores
from nmt.model.layers import DecoderLayer, EncoderLayer, Residual


class LayerCache(Protocol):
    """One decoder layer's view of the decoding state for the current step."""

    @property
    def rows(self) -> int:
        """n, the rows the caches hold (finished ones included)."""
        ...

    @property
    def live(self) -> Tensor | None:
        """(m,) indices of the rows fed this step, or None when all n are: the other rows
        are finished for good and get zero queries, keys and values (their output is
        dropped), so their projections are never computed."""
        ...

    @property
    def entries(self) -> Tensor | None:
        """(e,) long: the entries whose rows are fed this step, when `live` is a whole
        number of entries in order (each entry's g rows consecutive, m = e * g); None when
        all rows are fed or the cache cannot say. Then a layer may feed only those: queries
        of the m rows, `write_live`, and attention over entries `entries` of the history
        (finished sentences stay in the caches untouched, costing nothing)."""
        ...

    def write_live(self, k: Tensor, v: Tensor) -> None:
        """Store this position's self-attention key (m, heads, d_k) and value (m, heads,
        d_v) of the fed rows only (`live`, in its order; only when `entries` is not None);
        the other rows' slots at this position are left as they are (never read)."""
        ...

    def write(self, k: Tensor, v: Tensor) -> None:
        """Store this position's self-attention key (n, heads, d_k) and value
        (n, heads, d_v) of every row."""
        ...

    def history(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The self-attention keys (entries, heads, length, d_k) and values (entries,
        heads, length, d_v) the rows attend over, this position included, and a mask None,
        boolean (True = may attend) or additive (0 / -inf; see nmt/model/attention.py
        `apply_mask_`), broadcastable to (entries, heads, g, length)."""
        ...

    def encoder(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The encoder-decoder attention's keys, TRANSPOSED (entries, heads, d_k, src_len),
        as the scores' matmul reads them, V (entries, heads, src_len, d_v), and the source
        mask None or (entries, 1, 1, src_len), boolean (True = real token) or additive;
        rows per entry as for `history`."""
        ...


def residual(res: Residual, x: Tensor, out: Tensor) -> Tensor:
    """`res.after(x, out)` at inference: for a post-norm residual on a CPU, one C kernel
    that writes LayerNorm(x + out) over `out` (every caller passes the sub-layer's fresh
    output, used nowhere else), where it takes the operands; else the network's own."""
    if not (res.training or res.pre_norm):
        fused = add_norm.add_norm_(out, x, res.norm)
        if fused is not None:
            return fused
    return res.after(x, out)


def encoder_layer(layer: EncoderLayer, x: Tensor, mask: Tensor | None) -> Tensor:
    """`layer(x, mask)` at inference, its residuals through `residual`."""
    x = residual(layer.res_attn, x, layer.self_attn(layer.res_attn.before(x), mask))
    return residual(layer.res_ffn, x, layer.ffn(layer.res_ffn.before(x)))


def decoder_layer_step(layer: DecoderLayer, x: Tensor, cache: LayerCache,
                       need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """One incremental step of `layer` on `x` (m, 1, d_model), the newest position of the
    `cache.live` rows (all rows when None): self-attention writes to and reads from
    `cache`, encoder-decoder attention reads the encoder K/V it holds. Every projection and
    the feed-forward net run on the m rows fed. Returns (output (m, 1, d_model),
    cross-attention weights (m, heads, src_len) when `need_weights`, else None)."""
    attended = self_attention_step(layer.self_attn, layer.res_self.before(x), cache)
    x = residual(layer.res_self, x, attended)
    cross, weights = cross_attention_step(layer.cross_attn, layer.res_cross.before(x), cache,
                                          need_weights)
    x = residual(layer.res_cross, x, cross)
    x = residual(layer.res_ffn, x, layer.ffn(layer.res_ffn.before(x)))
    return x, weights


def self_attention_step(attn: SelfAttention, x: Tensor, cache: LayerCache) -> Tensor:
    """One incremental decoder step: project this position, write its key/value to the
    cache, attend over the history the cache hands back.

    `x` (m, 1, d_model) holds the newest position of the `cache.live` rows (all n rows
    when live is None); rows left out get zero query/key/value and their output is
    dropped, so finished sentences can stay in the cache without costing projections.
    The n rows are folded as the cache's entries (see the module docstring).
    Returns (m, 1, d_model).
    """
    entries = cache.entries
    if entries is not None and _feeds_live_only(x):
        qkv = attn.qkv(x)  # (m, 1, 3 sizes)
        m = qkv.size(0)
        q, k, v = qkv.split(attn.sizes, dim=-1)  # each (m, 1, heads*d)
        cache.write_live(k.view(m, attn.heads, attn.d_k), v.view(m, attn.heads, attn.d_v))
        keys, values, mask = cache.history()  # (all entries, heads, length, d), mask
        context = attend_entries(q, keys.transpose(-1, -2), values, mask, entries,
                                 attn.heads)  # (m, 1, heads*d_v)
        return attn.out(context)  # (m, 1, d_model)
    n = cache.rows
    qkv = all_rows(attn.qkv(x), cache)  # (n, 1, 3 sizes)
    q, k, v = qkv.split(attn.sizes, dim=-1)  # each (n, 1, heads*d)
    cache.write(k.view(n, attn.heads, attn.d_k), v.view(n, attn.heads, attn.d_v))
    keys, values, mask = cache.history()  # (entries, heads, length, d), mask
    entries = keys.size(0)
    q = q.view(entries, n // entries, attn.heads, attn.d_k)  # (entries, g, heads, d_k)
    context = attend_one(q.transpose(1, 2), keys.transpose(-1, -2), values,
                         mask)  # (entries, heads, g, d_v)
    context = context.transpose(1, 2).reshape(n, 1, -1)  # (n, 1, heads*d_v)
    return attn.out(live_rows(context, cache))  # (m, 1, d_model)


def cross_attention_step(attn: CrossAttention, x: Tensor, cache: LayerCache,
                         need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Incremental decoding: `x` (m, 1, d_model) holds the `cache.live` rows (all n when
    live is None) against the encoder K/V the cache holds, one entry per group of
    rows (a sentence's beam), so a sentence's g queries share one matmul against its
    K/V. Rows left out attend with a zero query and their output is dropped. Returns
    (output (m, 1, d_model), weights (m, heads, src_len) when `need_weights`, else
    None).
    """
    k_t, v, attn_mask = cache.encoder()  # (entries, heads, d, src_len), V, mask
    fed = cache.entries
    if fed is not None and not need_weights and _feeds_live_only(x):
        context = attend_entries(attn.q(x), k_t, v, attn_mask, fed,
                                 attn.heads)  # (m, 1, heads*d_v)
        return attn.out(context), None
    n = cache.rows
    entries = k_t.size(0)
    q = all_rows(attn.q(x), cache)  # (n, 1, heads*d_k)
    q = q.view(entries, n // entries, attn.heads, attn.d_k).transpose(1, 2)
    # q: (entries, heads, g, d_k)
    weights = None
    if need_weights:
        probs = attention_weights(q, k_t.transpose(-1, -2), attn_mask,
                                  v.dtype)  # (entries, heads, g, S)
        context = probs @ v  # (entries, heads, g, d_v)
        weights = probs.transpose(1, 2).reshape(n, attn.heads, -1)  # (n, heads, S)
    else:
        context = attend_one(q, k_t, v, attn_mask)  # (entries, heads, g, d_v)
    context = context.transpose(1, 2).reshape(n, 1, -1)  # (n, 1, heads*d_v)
    return attn.out(live_rows(context, cache)), live_rows(weights, cache)


def _feeds_live_only(x: Tensor) -> bool:
    """Whether a step on CPU rows `x` takes the fed rows alone through the cache's entries
    (`attend_entries`): where the C attention kernel runs, which reads only those entries'
    history; elsewhere the step runs on every row (`all_rows`), since gathering the fed
    entries' history would copy it at every step."""
    return x.device.type == "cpu" and fused_attention.enabled()


def attend_entries(q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None, entries: Tensor,
                   heads: int) -> Tensor:
    """Attention of the fed rows' queries q (m, 1, heads*d_k), g = m / e consecutive rows
    per entry of `entries` (e,), against those entries of the keys k_t (E, heads, d_k,
    len), values (E, heads, len, d_v) and mask (E or 1, 1, g, len): the C kernel reads
    them in place; otherwise they are gathered first. Returns (m, 1, heads*d_v)."""
    m = q.size(0)
    q = q.view(entries.numel(), -1, heads, q.size(-1) // heads).transpose(1, 2)
    # q: (e, heads, g, d_k)
    context = fused_attention.attend(q, k_t, v, mask, entries)
    if context is None:
        if mask is not None and mask.size(0) > 1:
            mask = mask.index_select(0, entries)
        context = attend_one(q, k_t.index_select(0, entries), v.index_select(0, entries),
                             mask)
    return context.transpose(1, 2).reshape(m, 1, -1)  # (e, heads, g, d_v) -> (m, 1, ...)


def all_rows(x: Tensor, cache: LayerCache) -> Tensor:
    """`x` (m, ...) of the cache's live rows, as (n, ...) with zeros for the others."""
    if cache.live is None:
        return x
    return x.new_zeros(cache.rows, *x.shape[1:]).index_copy_(0, cache.live, x)  # (n, ...)


def live_rows(x: Tensor | None, cache: LayerCache) -> Tensor | None:
    """The live rows (m, ...) of `x` (n, ...); `x` itself when all rows are live."""
    if x is None or cache.live is None:
        return x
    return x.index_select(0, cache.live)  # (m, ...)


def attend_one(q: Tensor, k_t: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """Attention at inference of a few queries per batch entry: q (b, heads, g, d_k)
    against keys given transposed, k_t (b, heads, d_k, len), and v (b, heads, len, d_v);
    `attn_mask` None, boolean (True = may attend) or additive float, broadcastable to
    (b, heads, g, len) (see `apply_mask_`).

    Incremental decoding groups the g beam rows of one sentence as the g queries of one
    entry, so the sentence's keys are read from memory once, not once per row. On GPU
    this is SDPA; on CPU the C kernel of nmt/inference/fused_attention.py when it takes the
    operands (keys stored (b, heads, len, d_k), an additive mask), else the softmax written
    out (SDPA's CPU flash kernel has a high fixed cost for so few queries), with as few
    passes over the (b, heads, g, len) scores as it takes: the queries are scaled instead
    of the scores (in the copy that makes them contiguous for the batched matmul), and a
    cache's additive mask is one add. Keys stored transposed (the encoder's,
    nmt/inference/decoding.py) make the scores' matmul read contiguous matrices, faster
    than a transposed view (docs/performance.md).
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k_t.transpose(-1, -2), v, attn_mask=attn_mask)
    fused = fused_attention.attend(q, k_t, v, attn_mask)  # (b, heads, g, d_v) or None
    if fused is not None:
        return fused
    scaled = torch.empty(q.shape, dtype=q.dtype)  # (b, heads, g, d_k), contiguous
    torch.mul(q, q.size(-1) ** -0.5, out=scaled)  # exact for d_k = 64 (a power of two)
    scores = apply_mask_(scaled @ k_t, attn_mask)  # (b, heads, g, len)
    return softmax_keys(scores) @ v  # (b, heads, g, d_v)


# Below this many keys torch's CPU softmax leaves its vectorised kernel (16 floats: one
# AVX-512 register) for a much slower scalar loop: short sources in cross-attention, the
# first steps of self-attention.
SOFTMAX_FAST_FROM = 16


def softmax_keys(scores: Tensor) -> Tensor:
    """softmax over the last dim of `scores`, a fresh tensor that may be overwritten; in
    float32 arithmetic below SOFTMAX_FAST_FROM keys (max, exp, sum, divide written out),
    returned in the scores' dtype."""
    if scores.size(-1) >= SOFTMAX_FAST_FROM:
        return scores.softmax(dim=-1)
    wide = scores.float()  # the same tensor when float32
    wide = wide.sub_(wide.amax(dim=-1, keepdim=True)).exp_()
    return wide.div_(wide.sum(dim=-1, keepdim=True)).to(scores.dtype)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask (True = may attend) as the additive one `apply_mask_`
    adds to the scores: 0 where True, -inf where False, in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), float("-inf"))


def attention_weights(q: Tensor, k: Tensor, attn_mask: Tensor | None, dtype: torch.dtype
                      ) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) written out, for when the weights themselves are wanted
    (attention plots): q (b, heads, t, d_k), k (b, heads, s, d_k), `attn_mask` None,
    boolean or additive, broadcastable to (b, heads, t, s) (see `apply_mask_`). Softmax in
    float32, returned as `dtype`: (b, heads, t, s)."""
    return masked_scores(q, k, attn_mask).float().softmax(dim=-1).to(dtype)
