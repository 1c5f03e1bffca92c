"""The Transformer of "Attention Is All You Need": embeddings, encoder, decoder.

One weight matrix is shared by the source embedding, the target embedding and the output
projection (section 3.4). Masks are built once per forward: source padding becomes one
SDPA mask (additive on SDPA's path, boolean on the CPU's) reused by every encoder
self-attention and decoder cross-attention layer, and is skipped entirely when the batch
has no padding; the decoder's causal mask is `is_causal` (SDPA's on GPU, one cached mask
per shape on CPU). Knowing whether a batch has padding costs one host sync per `encode()`
unless the caller passes `has_pad` (the training loop may pass True to avoid it on GPU).
Training uses `forward(..., select=rows)`, which projects only the non-padding target
positions to the vocabulary (`decode_features` + `logits` do the same outside
DistributedDataParallel). Between layers the states are rows,
(batch * len, d_model) (nmt/model/attention.py, `as_rows`).

Incremental decoding (one target position at a time over a key/value cache, for search)
lives in nmt/inference/ (decoding.py, layer_step.py); it runs the same modules one position a
step, through `embed_tokens`, the layers' parameters and `dec_norm`. Inputs longer than
`config.max_positions` raise UsageError; `nmt translate` truncates first. Imports torch and
the network modules only: no files, no CLI, no search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.config import ModelConfig
from nmt.model.attention import CrossAttention, SelfAttention, additive_mask, key_padding_mask
from nmt.model.dropout import dropout
from nmt.model.layers import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    Positions,
    Residual,
    embedding_scale,
)


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


class Transformer(nn.Module):
    """Encoder-decoder Transformer built from a ModelConfig alone (see module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.scale = embedding_scale(cfg.d_model)
        self.embed_dropout = cfg.dropout  # scale_dropout sets it
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

    def scale_dropout(self, factor: float) -> None:
        """Set every dropout rate to `factor` times its configured value (the trainer's
        --dropout-schedule; 1 restores them). `config` keeps the configured rates, so
        checkpoints and `nmt average` see one model whatever the factor."""
        cfg = self.config
        self.embed_dropout = cfg.dropout * factor
        for module in self.modules():
            if isinstance(module, Residual):
                module.dropout = cfg.dropout * factor
            elif isinstance(module, FeedForward):
                module.activation_dropout = cfg.activation_dropout * factor
            elif isinstance(module, (SelfAttention, CrossAttention)):
                module.dropout = cfg.attention_dropout * factor

    def embed_tokens(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Scaled token embeddings plus `positions` (len, d_model), then dropout:
        (..., len) ids -> (..., len, d_model)."""
        x = self.embed(tokens) * self.scale + positions
        return dropout(x, self.embed_dropout, self.training)

    def encode(self, src: Tensor, has_pad: bool | None = None,
               layer_step: Callable[[EncoderLayer, Tensor, Tensor | None], Tensor] | None = None
               ) -> EncoderOutput:
        """Encode `src` (batch, src_len) of ids (pieces + EOS, right-padded with PAD).

        `has_pad` tells whether any row has padding; None computes it (one host sync).
        `layer_step(layer, x, mask)` runs each layer in place of `layer(x, mask)` (the same
        function computed another way: inference's fast paths, nmt/inference/layer_step.py).
        """
        padding_mask = src.eq(self.config.pad_id)  # (batch, src_len)
        if has_pad is None:
            has_pad = bool(padding_mask.any())  # the one host sync of a forward
        # (batch, 1, 1, src_len) or None, shared by every encoder layer
        mask = key_padding_mask(padding_mask) if has_pad else None
        x = self.embed_tokens(src, self.enc_positions(src.size(1)))  # (batch, src_len, d_model)
        if layer_step is None:  # rows from layer to layer (nmt/model/attention.py, as_rows)
            mask = additive_mask(mask, x)  # SDPA's path: converted once, not in each layer
            batch = src.size(0)
            rows = x.view(-1, x.size(-1))  # (batch * src_len, d_model)
            for layer in self.encoder:
                rows = layer(rows, mask, batch)
            x = rows.view_as(x)
        else:
            for layer in self.encoder:
                x = layer_step(layer, x, mask)
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
        return self.decoder_rows(tgt_in, enc).view(*tgt_in.shape, -1)

    def decoder_rows(self, tgt_in: Tensor, enc: EncoderOutput) -> Tensor:
        """`decode_features` as rows, (batch * tgt_len, d_model)."""
        batch = tgt_in.size(0)
        x = self.embed_tokens(tgt_in, self.dec_positions(tgt_in.size(1)))  # (batch, tgt, d_model)
        mask = additive_mask(enc.attn_mask(), x)  # SDPA's path: once, not in each layer
        rows = x.view(-1, x.size(-1))  # (batch * tgt_len, d_model)
        memory = enc.states.view(-1, enc.states.size(-1))  # (batch * src_len, d_model)
        for layer in self.decoder:
            cross_k, cross_v = layer.cross_attn.project_kv(memory, batch)
            rows = layer(rows, cross_k, cross_v, mask, batch)
        if self.dec_norm is not None:
            rows = self.dec_norm(rows)
        return rows

    def logits(self, features: Tensor) -> Tensor:
        """Output projection with the shared embedding matrix: (..., d_model) -> (..., vocab),
        in the compute dtype (the loss or search casts as it needs)."""
        return F.linear(features, self.embed.weight)

    def forward(self, src: Tensor, tgt_in: Tensor, has_pad: bool | None = None,
                select: Tensor | None = None, project: bool = True) -> Tensor:
        """Teacher-forced logits (batch, tgt_len, vocab).

        With `select` (n,) flat indices into (batch * tgt_len), only those positions are
        projected and the result is (n, vocab): training passes the non-PAD target
        positions, so padding costs nothing in the biggest matmul or the loss. With
        `project=False` the final decoder states of those positions, (n or batch * tgt_len,
        d_model), come back unprojected, for a loss that projects them itself chunk by
        chunk (nmt.train.loss.projected_smoothed_loss). Going through `forward` (not
        `decode_features` + `logits`) keeps DistributedDataParallel's hooks.
        """
        enc = self.encode(src, has_pad=has_pad)
        if select is None and project:
            return self.decode(tgt_in, enc)
        flat = self.decoder_rows(tgt_in, enc)  # (batch * tgt_len, d_model)
        rows = flat if select is None else flat.index_select(0, select)  # (n, d_model)
        return self.logits(rows) if project else rows  # (n, vocab) or (n, d_model)
