"""Transformer building blocks: positional encodings, feed-forward net, encoder and
decoder layers (post-norm as published, or pre-norm).

Post-norm wraps every sub-layer as `LayerNorm(x + Dropout(Sublayer(x)))` (section 3.1 and
5.4 of the paper); pre-norm computes `x + Dropout(Sublayer(LayerNorm(x)))` and needs a
final LayerNorm on each stack (added by the model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.config import ModelConfig
from nmt.errors import UsageError
from nmt.model.attention import CrossAttention, SelfAttention, shaped_like, xavier_chunks_
from nmt.model.dropout import dropout


def sinusoids(length: int, d_model: int) -> Tensor:
    """The paper's encoding, (length, d_model) float32, positions 0..length-1.

    PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)):
    sines on even, cosines on odd channels (interleaved, not fairseq's concatenated halves).
    Computed in float64 so large positions stay accurate.
    """
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (length, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(d_model/2),)
    angle = pos / 10000.0 ** (two_i / d_model)  # (length, ceil(d_model/2))
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


class Positions(nn.Module):
    """Position encodings for positions offset..offset+length-1: fixed sinusoids (the
    default) or a learned table (Table 3 row E), both limited to cfg.max_positions.

    Callers truncate longer inputs (translate does); asking for more raises UsageError.
    The check compares Python ints only, so it costs no host-device sync.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_positions = cfg.max_positions
        self.learned: nn.Embedding | None = None
        if cfg.learned_positions:
            self.learned = nn.Embedding(cfg.max_positions, cfg.d_model)
            nn.init.normal_(self.learned.weight, mean=0.0, std=cfg.d_model ** -0.5)
        # Not persistent: rebuilt from the config, so checkpoints do not carry it.
        self.register_buffer("table", sinusoids(cfg.max_positions, cfg.d_model),
                             persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """Encodings (length, d_model) of positions offset..offset+length-1."""
        if offset + length > self.max_positions:
            raise UsageError(f"sequence of {offset + length} tokens exceeds max_positions "
                             f"{self.max_positions}; truncate the input or train with a "
                             "larger --max-positions")
        if self.learned is not None:
            return self.learned.weight[offset: offset + length]  # (length, d_model)
        return self.table[offset: offset + length]  # (length, d_model)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 with optional dropout after the ReLU."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = activation_dropout
        xavier_chunks_(self.fc1, [d_ff])
        xavier_chunks_(self.fc2, [d_model])

    def forward(self, x: Tensor) -> Tensor:
        """(..., d_model) -> (..., d_model).

        Runs on the rows flattened to 2-D: fc1's output is then the addmm's own tensor, not
        a view of it, so the in-place ReLU costs autograd no copies (on a 3-D view, its
        backward rebuilds the base with a clone and slice copies of the (rows, d_ff) hidden)."""
        rows = x if x.dim() == 2 else x.reshape(-1, x.size(-1))  # (rows, d_model)
        hidden = F.relu(self.fc1(rows), inplace=True)  # (rows, d_ff); in place: no new buffer
        hidden = dropout(hidden, self.activation_dropout, self.training)
        return shaped_like(self.fc2(hidden), x)  # (..., d_model)


class Residual(nn.Module):
    """Residual connection + dropout + LayerNorm around one sub-layer, post- or pre-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def before(self, x: Tensor) -> Tensor:
        """Input of the sub-layer: LayerNorm(x) for pre-norm, x itself for post-norm."""
        return self.norm(x) if self.pre_norm else x

    def after(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """Combine the residual `x` with the sub-layer output."""
        y = x + dropout(sublayer_out, self.dropout, self.training)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped by `Residual`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.heads, cfg.head_dim_k, cfg.head_dim_v,
                                       cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, attn_mask: Tensor | None, batch: int | None = None
                ) -> Tensor:
        """`x` (batch, src_len, d_model), or its rows with `batch`; `attn_mask` None or
        (batch, 1, 1, src_len)."""
        attended = self.self_attn(self.res_attn.before(x), attn_mask, batch=batch)
        x = self.res_attn.after(x, attended)
        return self.res_ffn.after(x, self.ffn(self.res_ffn.before(x)))


class DecoderLayer(nn.Module):
    """Causal self-attention, encoder-decoder attention, feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dims = (cfg.d_model, cfg.heads, cfg.head_dim_k, cfg.head_dim_v, cfg.attention_dropout)
        self.self_attn = SelfAttention(*dims)
        self.cross_attn = CrossAttention(*dims)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, cross_k: Tensor, cross_v: Tensor,
                cross_mask: Tensor | None, batch: int | None = None) -> Tensor:
        """Full-sequence pass over `x` (batch, tgt_len, d_model), or its rows with `batch`.

        Targets are right-padded, so the causal mask alone keeps every real position away
        from padding (pads only ever follow it); is_causal=True applies it, no mask tensor.
        """
        attended = self.self_attn(self.res_self.before(x), is_causal=True, batch=batch)
        x = self.res_self.after(x, attended)
        cross = self.cross_attn(self.res_cross.before(x), cross_k, cross_v, cross_mask,
                                batch=batch)
        x = self.res_cross.after(x, cross)
        return self.res_ffn.after(x, self.ffn(self.res_ffn.before(x)))


def embedding_scale(d_model: int) -> float:
    """Embeddings are multiplied by sqrt(d_model) (section 3.4)."""
    return math.sqrt(d_model)
