"""Multi-head attention, one function for every use (`attend`): SDPA on a GPU, the softmax
written out on a CPU.

Self-attention projects Q, K and V with ONE fused Linear; encoder-decoder attention projects
K and V of the encoder output with one fused Linear (computed once per sentence when
decoding incrementally, nmt/inference/layer_step.py). On GPU, SDPA picks its
flash/memory-efficient kernels; on CPU the softmax is written out: SDPA's CPU flash kernel
has a high fixed cost at the short lengths of translation. Masks are boolean with SDPA's
meaning (True = may attend) and are built once per forward by the caller, never per layer.
Tensors are batch-first. A full-sequence pass carries each layer's input as rows (batch *
len, d_model) with the batch size beside it, so each linear layer takes it as it is and the
heads are split with one view and one permute (`heads`): every view saved is an op fewer
for a GPU's host to dispatch (docs/training.md, "GPU levers").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.model.dropout import dropout
from nmt.model.paths import cpu_path


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
# 1). The paper does not say how it initialises; fairseq uses 1/sqrt(2) for Q/K/V. Smaller
# initial attention logits let the post-norm model learn faster from the start (lower valid
# and train loss early on Multi30k than gain 1).
QKV_GAIN = 2 ** -0.5


def as_rows(x: Tensor, batch: int | None) -> tuple[Tensor, int]:
    """`x` as rows (batch * len, d) and the batch size: x (batch, len, d), or x already as
    rows with `batch` given. The network carries rows from layer to layer, so its linear
    layers take them as they are (no view on either side of each)."""
    if x.dim() == 2:
        assert batch is not None, "rows need their batch size"
        return x, batch
    return x.reshape(-1, x.size(-1)), x.size(0)  # (batch * len, d)


def shaped_like(rows: Tensor, x: Tensor) -> Tensor:
    """`rows` (n, d) in the shape of the input `x` they came from: themselves for rows (no
    op), else viewed as (batch, len, d)."""
    return rows if x.dim() == 2 else rows.view(*x.shape[:-1], rows.size(-1))


def heads(t: Tensor, batch: int, parts: int, count: int) -> tuple[Tensor, ...]:
    """`parts` projections side by side in `t` (batch * len, parts * count * d), each as
    (batch, count heads, len, d): one view and one permute whatever `parts`."""
    d = t.size(-1) // (parts * count)
    if parts == 1:
        return (t.view(batch, -1, count, d).transpose(1, 2),)  # (batch, heads, len, d)
    split = t.view(batch, -1, parts, count, d)  # (batch, len, parts, heads, d)
    return split.permute(2, 0, 3, 1, 4).unbind(0)  # parts x (batch, heads, len, d)


def merge_heads(context: Tensor) -> Tensor:
    """(batch, heads, len, d_v) -> rows (batch * len, heads * d_v), heads side by side."""
    batch, count, length, d = context.shape
    return context.transpose(1, 2).reshape(batch * length, count * d)


def key_padding_mask(padding_mask: Tensor) -> Tensor:
    """SDPA mask from a (batch, src_len) PAD mask: True where attention is allowed. The
    first key is always allowed: a real row starts with a real token, and an all-PAD row
    (the filler of a batch padded to a static shape, nmt/train/buckets.py) then attends to
    a finite key instead of to none, whose softmax is NaN (its outputs are never used)."""
    allowed = padding_mask.logical_not()  # (batch, src_len)
    allowed[:, 0] = True
    return allowed[:, None, None, :]  # (batch, 1, 1, src_len)


def additive_mask(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """On SDPA's path, boolean `mask` as SDPA would convert it in every call (three ops per
    layer): additive, 0 where allowed and -inf elsewhere, in the dtype attention computes in
    (autocast's, else `like`'s), built once per forward and shared by the layers. On the
    CPU's path (`masked_scores`), the boolean mask as it is."""
    if mask is None or cpu_path(like):
        return mask
    device = like.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else like.dtype
    hidden = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return hidden.masked_fill_(mask.logical_not(), float("-inf"))  # same shape as mask


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

    def project(self, rows: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V of `rows` (batch * len, d_model), each (batch, heads, len, d)."""
        qkv = self.qkv(rows)  # (batch * len, (2 d_k + d_v) heads)
        if self.d_k == self.d_v:  # one view and one permute for all three
            q, k, v = heads(qkv, batch, 3, self.heads)
            return q, k, v
        q, k, v = qkv.split(self.sizes, dim=-1)  # each (batch * len, heads*d)
        return (heads(q, batch, 1, self.heads)[0], heads(k, batch, 1, self.heads)[0],
                heads(v, batch, 1, self.heads)[0])

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                batch: int | None = None) -> Tensor:
        """Attend over whole sequences: `x` (batch, len, d_model), or its rows (batch *
        len, d_model) with `batch`; the result has x's shape.

        `attn_mask` is None (no padding), a boolean mask broadcastable to (batch, heads,
        len, len), or its `additive_mask` (SDPA's path); `is_causal` hides later
        positions without a mask tensor.
        """
        rows, batch = as_rows(x, batch)
        q, k, v = self.project(rows, batch)
        drop = self.dropout if self.training else 0.0
        context = attend(q, k, v, attn_mask, is_causal, drop)  # (batch, heads, len, d_v)
        return shaped_like(self.out(merge_heads(context)), x)


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


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
           is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(d_k)) v over whole sequences, as SDPA computes it: q (b, heads,
    t, d_k), k (b, heads, s, d_k), v (b, heads, s, d_v) -> (b, heads, t, d_v); `attn_mask`
    None, boolean broadcastable to (b, heads, t, s) (True = may attend) or additive;
    `is_causal` hides later keys; `dropout_p` drops attention weights (0 at inference).

    SDPA on GPU. On CPU the softmax is written out (in at least float32, cast back to
    v's dtype): SDPA's CPU flash kernel has a high fixed cost at translation's short
    lengths, where the (t, s) scores written out are small.
    """
    if not cpu_path(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal)
    scores = masked_scores(q, k, attn_mask, is_causal)  # (b, heads, t, s)
    wide = torch.promote_types(scores.dtype, torch.float32)  # bf16/fp16 -> fp32
    probs = torch.softmax(scores, dim=-1, dtype=wide).to(v.dtype)  # (b, heads, t, s)
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p, True)
    return probs @ v  # (b, heads, t, d_v)


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

    def project_kv(self, memory: Tensor, batch: int | None = None) -> tuple[Tensor, Tensor]:
        """K (batch, heads, src_len, d_k) and V (batch, heads, src_len, d_v) of the encoder
        output `memory` (batch, src_len, d_model), or of its rows with `batch`."""
        rows, batch = as_rows(memory, batch)
        kv = self.kv(rows)  # (batch * src_len, heads * (d_k + d_v))
        if self.d_k == self.d_v:
            k, v = heads(kv, batch, 2, self.heads)
            return k, v
        k, v = kv.split(self.kv_sizes, dim=-1)  # each (batch * src_len, heads*d)
        return heads(k, batch, 1, self.heads)[0], heads(v, batch, 1, self.heads)[0]

    def forward(self, x: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                batch: int | None = None) -> Tensor:
        """Attend from `x` (batch, tgt_len, d_model), or its rows with `batch`, over
        projected encoder K/V; `attn_mask` is None or (batch, 1, 1, src_len), boolean (True
        = real token) or its `additive_mask`. The result has x's shape."""
        rows, batch = as_rows(x, batch)
        q = heads(self.q(rows), batch, 1, self.heads)[0]  # (batch, heads, tgt_len, d_k)
        drop = self.dropout if self.training else 0.0
        context = attend(q, k, v, attn_mask, dropout_p=drop)  # (batch, heads, tgt, d_v)
        return shaped_like(self.out(merge_heads(context)), x)
