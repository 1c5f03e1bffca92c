"""Multi-head attention on top of `torch.nn.functional.scaled_dot_product_attention`.

Self-attention projects Q, K and V with ONE fused Linear; encoder-decoder attention projects
K and V of the encoder output with one fused Linear (computed once per sentence when
decoding incrementally). On GPU, SDPA picks its flash/memory-efficient kernels; on CPU the
softmax is written out (`attend`, `attend_one`): SDPA's CPU flash kernel has a high fixed
cost at the short lengths of translation. Masks are boolean with SDPA's meaning (True = may
attend) and are built once per forward by the caller, never per layer. Tensors are
batch-first.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.model import fused_attention
from nmt.model.dropout import dropout
from nmt.model.incremental import LayerCache


def xavier_chunks_(linear: nn.Linear, sizes: list[int], gain: float = 1.0) -> None:
    """Xavier-uniform init (scaled by `gain`) of each row block of a fused projection, zero
    bias.

    A fused QKV weight (3*d, d) initialised as one matrix would get a smaller range than
    three separate (d, d) projections; initialising each block on its own matches the
    unfused reference (tensor2tensor, fairseq) while keeping one matmul.
    """
    with torch.no_grad():
        for block in linear.weight.split(sizes, dim=0):
            nn.init.xavier_uniform_(block, gain=gain)
        if linear.bias is not None:
            linear.bias.zero_()


# Gain of the query, key and value projections' Xavier init (the output projection keeps
# 1). The paper does not say how it initialises; fairseq uses 1/sqrt(2) for Q/K/V. Measured
# on Multi30k (`small`, the recipe's schedule, identical batches), against gain 1: valid
# loss 5.33 vs 5.55 at update 200, 4.25 vs 4.52 at 400; train NLL at 400 3.67 vs 3.99 nats.
# Smaller initial attention logits let the post-norm model learn faster from the start.
QKV_GAIN = 2 ** -0.5


def key_padding_mask(padding_mask: Tensor) -> Tensor:
    """SDPA mask from a (batch, src_len) PAD mask: True where attention is allowed."""
    return padding_mask.logical_not()[:, None, None, :]  # (batch, 1, 1, src_len)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection; d_k may differ from d_v."""

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.d_k, self.d_v = heads, d_k, d_v
        self.dropout = dropout
        self.sizes = [heads * d_k, heads * d_k, heads * d_v]
        self.qkv = nn.Linear(d_model, sum(self.sizes))
        self.out = nn.Linear(heads * d_v, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform per projection (Q, K, V with gain QKV_GAIN, output 1), zero
        biases."""
        xavier_chunks_(self.qkv, self.sizes, QKV_GAIN)
        xavier_chunks_(self.out, [self.out.out_features])

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V of `x` (batch, len, d_model), each (batch, heads, len, d)."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)  # each (batch, len, heads*d)
        q = q.view(batch, length, self.heads, self.d_k).transpose(1, 2)  # (batch, heads, len, d_k)
        k = k.view(batch, length, self.heads, self.d_k).transpose(1, 2)  # (batch, heads, len, d_k)
        v = v.view(batch, length, self.heads, self.d_v).transpose(1, 2)  # (batch, heads, len, d_v)
        return q, k, v

    def merge(self, context: Tensor) -> Tensor:
        """Concatenate heads of (batch, heads, len, d_v) and apply W^O."""
        batch, _, length, _ = context.shape
        context = context.transpose(1, 2).reshape(batch, length, -1)  # (batch, len, heads*d_v)
        return self.out(context)  # (batch, len, d_model)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        """Attend over the whole sequence `x` (batch, len, d_model).

        `attn_mask` is None (no padding) or a boolean mask broadcastable to
        (batch, heads, len, len); `is_causal` hides later positions without a mask tensor.
        """
        q, k, v = self.project(x)
        drop = self.dropout if self.training else 0.0
        context = attend(q, k, v, attn_mask, is_causal, drop)  # (batch, heads, len, d_v)
        return self.merge(context)

    def incremental(self, x: Tensor, cache: LayerCache) -> Tensor:
        """One incremental decoder step: project this position, write its key/value to the
        cache, attend over the history the cache hands back.

        `x` (m, 1, d_model) holds the newest position of the `cache.live` rows (all n rows
        when live is None); rows left out get zero query/key/value and their output is
        dropped, so finished sentences can stay in the cache without costing projections.
        The n rows are folded as the cache's entries (see nmt/model/incremental.py).
        Returns (m, 1, d_model).
        """
        entries = cache.entries
        if entries is not None and _feeds_live_only(x):
            qkv = self.qkv(x)  # (m, 1, 3 sizes)
            m = qkv.size(0)
            q, k, v = qkv.split(self.sizes, dim=-1)  # each (m, 1, heads*d)
            cache.write_live(k.view(m, self.heads, self.d_k), v.view(m, self.heads, self.d_v))
            keys, values, mask = cache.history()  # (all entries, heads, length, d), mask
            context = attend_entries(q, keys.transpose(-1, -2), values, mask, entries,
                                     self.heads)  # (m, 1, heads*d_v)
            return self.out(context)  # (m, 1, d_model)
        n = cache.rows
        qkv = all_rows(self.qkv(x), cache)  # (n, 1, 3 sizes)
        q, k, v = qkv.split(self.sizes, dim=-1)  # each (n, 1, heads*d)
        cache.write(k.view(n, self.heads, self.d_k), v.view(n, self.heads, self.d_v))
        keys, values, mask = cache.history()  # (entries, heads, length, d), mask
        entries = keys.size(0)
        q = q.view(entries, n // entries, self.heads, self.d_k)  # (entries, g, heads, d_k)
        context = attend_one(q.transpose(1, 2), keys.transpose(-1, -2), values,
                             mask)  # (entries, heads, g, d_v)
        context = context.transpose(1, 2).reshape(n, 1, -1)  # (n, 1, heads*d_v)
        return self.out(live_rows(context, cache))  # (m, 1, d_model)


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


@functools.lru_cache(maxsize=16)
def _later_keys(t: int, s: int, device: torch.device) -> Tensor:
    """(t, s) boolean, True where key j comes after query i (j > i): the causal mask, built
    once per shape and device and shared by every layer and step (never written to).
    Always a normal tensor, even when first asked for under torch.inference_mode (e.g. a
    translation inside a training process): an inference tensor cached here would make
    every later training step that uses it fail in backward."""
    with torch.inference_mode(False):
        return _later_keys_mask(t, s, device)


def _later_keys_mask(t: int, s: int, device: torch.device) -> Tensor:
    """(t, s) boolean, True where key j comes after query i: built, not cached (what a
    compiled graph uses: Dynamo does not trace `_later_keys`'s cache)."""
    return torch.ones(t, s, dtype=torch.bool, device=device).triu_(1)


def masked_scores(q: Tensor, k: Tensor, attn_mask: Tensor | None,
                  is_causal: bool = False) -> Tensor:
    """q k^T / sqrt(d_k) with hidden keys at -inf: q (b, heads, t, d_k), k (b, heads, s,
    d_k) -> (b, heads, t, s); `attn_mask` None or boolean broadcastable to that, True = may
    attend; `is_causal` also hides later keys. The scores are a fresh tensor, so the masks
    are applied in place (autograd-safe: the scaling's backward does not read its output)."""
    scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5  # (b, heads, t, s)
    if is_causal:
        t, s = scores.shape[-2:]
        later = (_later_keys_mask if torch.compiler.is_compiling() else _later_keys)(
            t, s, q.device)
        scores.masked_fill_(later, float("-inf"))
    return apply_mask_(scores, attn_mask)


def apply_mask_(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Hide keys in `scores` in place: `mask` None, boolean (True = may attend: the others
    get -inf) or additive float (0 or -inf, the scores' dtype: added), broadcastable to
    the scores. An additive mask is built once per step by a cache and shared by every
    layer (nmt/inference/kv_cache.py); a boolean one costs a negation per call."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(mask.logical_not(), float("-inf"))
    return scores.add_(mask)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask (True = may attend) as the additive one `apply_mask_`
    adds to the scores: 0 where True, -inf where False, in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), float("-inf"))


def attention_weights(q: Tensor, k: Tensor, attn_mask: Tensor | None, dtype: torch.dtype
                      ) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) written out, for when the weights themselves are wanted
    (attention plots): q (b, heads, t, d_k), k (b, heads, s, d_k), `attn_mask` None,
    boolean or additive, broadcastable to (b, heads, t, s) (see `apply_mask_`). Softmax in float32,
    returned as `dtype`: (b, heads, t, s)."""
    return masked_scores(q, k, attn_mask).float().softmax(dim=-1).to(dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
           is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) v over whole sequences, as SDPA computes it: q (b, heads,
    t, d_k), k (b, heads, s, d_k), v (b, heads, s, d_v) -> (b, heads, t, d_v); `attn_mask`
    None or boolean broadcastable to (b, heads, t, s), True = may attend; `is_causal` hides
    later keys; `dropout_p` drops attention weights (0 at inference).

    SDPA on GPU. On CPU the softmax is written out (in at least float32, cast back to
    v's dtype): SDPA's CPU flash kernel is slow at translation's short lengths, measured on
    this project's CPU for (96, 4, 22, 64), forward + backward, 2 threads: bf16 11.7 ms vs
    2.2 ms, fp32 5.3 ms vs 2.9 ms; in a `small` Multi30k training step it took a third of
    the time. The (t, s) scores it materialises are small at such lengths.
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal)
    scores = masked_scores(q, k, attn_mask, is_causal)  # (b, heads, t, s)
    wide = torch.promote_types(scores.dtype, torch.float32)  # bf16/fp16 -> fp32
    probs = torch.softmax(scores, dim=-1, dtype=wide).to(v.dtype)  # (b, heads, t, s)
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p, True)
    return probs @ v  # (b, heads, t, d_v)


def attend_one(q: Tensor, k_t: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """Attention at inference of a few queries per batch entry: q (b, heads, g, d_k)
    against keys given transposed, k_t (b, heads, d_k, len), and v (b, heads, len, d_v);
    `attn_mask` None, boolean (True = may attend) or additive float, broadcastable to
    (b, heads, g, len) (see `apply_mask_`).

    Incremental decoding groups the g beam rows of one sentence as the g queries of one
    entry, so the sentence's keys are read from memory once, not once per row. On GPU
    this is SDPA; on CPU the C kernel of nmt/model/fused_attention.py when it takes the
    operands (keys stored (b, heads, len, d_k), an additive mask), else: SDPA's CPU flash kernel
    has a high fixed cost for so few queries
    (about 2x slower than two batched matmuls at beam-search shapes, see
    bench/model_speed.py), so the softmax is written out there, with as few passes over
    the (b, heads, g, len) scores as it takes: the queries are scaled instead of the
    scores (in the copy that makes them contiguous for the batched matmul), and a cache's
    additive mask is one add. Keys stored transposed (the encoder's,
    nmt/inference/decoding.py) make the scores' matmul read contiguous matrices: half its
    time of a transposed view (docs/performance.md).
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
# AVX-512 register) for a scalar loop 6-7x slower (1,168 rows of 14 keys: 248 vs 40 us,
# torch 2.13): short sources in cross-attention, the first steps of self-attention.
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


class CrossAttention(nn.Module):
    """Encoder-decoder attention: queries from the decoder, fused K/V of the encoder."""

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.d_k, self.d_v = heads, d_k, d_v
        self.dropout = dropout
        self.kv_sizes = [heads * d_k, heads * d_v]
        self.q = nn.Linear(d_model, heads * d_k)
        self.kv = nn.Linear(d_model, sum(self.kv_sizes))
        self.out = nn.Linear(heads * d_v, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform per projection (Q, K, V with gain QKV_GAIN, output 1), zero
        biases."""
        xavier_chunks_(self.q, [self.q.out_features], QKV_GAIN)
        xavier_chunks_(self.kv, self.kv_sizes, QKV_GAIN)
        xavier_chunks_(self.out, [self.out.out_features])

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """K (batch, heads, src_len, d_k) and V (batch, heads, src_len, d_v) of the encoder
        output `memory` (batch, src_len, d_model)."""
        batch, length, _ = memory.shape
        k, v = self.kv(memory).split(self.kv_sizes, dim=-1)  # each (batch, src_len, heads*d)
        k = k.view(batch, length, self.heads, self.d_k).transpose(1, 2)  # (b, heads, S, d_k)
        v = v.view(batch, length, self.heads, self.d_v).transpose(1, 2)  # (b, heads, S, d_v)
        return k, v

    def forward(self, x: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attend from `x` (batch, tgt_len, d_model) over projected encoder K/V.

        `attn_mask` is None or (batch, 1, 1, src_len) boolean (True = real token). With
        `need_weights` the softmax is computed explicitly (no SDPA) and the attention
        weights (batch, heads, tgt_len, src_len) are returned for plotting.
        """
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.heads, self.d_k)  # (batch, tgt_len, heads, d_k)
        q = q.transpose(1, 2)  # (batch, heads, tgt_len, d_k)
        drop = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            weights = attention_weights(q, k, attn_mask, v.dtype)  # (batch, heads, tgt, src)
            context = dropout(weights, drop, self.training) @ v  # (batch, heads, tgt, d_v)
        elif length == 1 and not self.training:  # one position at inference
            context = attend_one(q, k.transpose(-1, -2), v, attn_mask)  # (batch, heads, 1, d_v)
        else:
            context = attend(q, k, v, attn_mask, dropout_p=drop)  # (batch, heads, tgt, d_v)
        context = context.transpose(1, 2).reshape(batch, length, -1)  # (batch, tgt, heads*d_v)
        return self.out(context), weights

    def incremental(self, x: Tensor, cache: LayerCache, need_weights: bool = False
             ) -> tuple[Tensor, Tensor | None]:
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
            context = attend_entries(self.q(x), k_t, v, attn_mask, fed,
                                     self.heads)  # (m, 1, heads*d_v)
            return self.out(context), None
        n = cache.rows
        entries = k_t.size(0)
        q = all_rows(self.q(x), cache)  # (n, 1, heads*d_k)
        q = q.view(entries, n // entries, self.heads, self.d_k).transpose(1, 2)
        # q: (entries, heads, g, d_k)
        weights = None
        if need_weights:
            probs = attention_weights(q, k_t.transpose(-1, -2), attn_mask,
                                      v.dtype)  # (entries, heads, g, S)
            context = probs @ v  # (entries, heads, g, d_v)
            weights = probs.transpose(1, 2).reshape(n, self.heads, -1)  # (n, heads, S)
        else:
            context = attend_one(q, k_t, v, attn_mask)  # (entries, heads, g, d_v)
        context = context.transpose(1, 2).reshape(n, 1, -1)  # (n, 1, heads*d_v)
        return self.out(live_rows(context, cache)), live_rows(weights, cache)
