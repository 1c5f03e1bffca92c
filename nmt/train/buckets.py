"""Length buckets for a compiled model: a few static batch shapes instead of one per batch.

A token-count batcher gives every micro-batch its own (rows, length), and a compiled model
specialised on shapes would compile for each; dynamic shapes compile once but give up
static kernels and CUDA graphs. Under `nmt train --compile` each micro-batch's source and
target are padded with PAD up to the same bucket length (the smallest of `LENGTHS` that
holds the longer side), so the model compiles once per bucket used. Its rows stay dynamic,
marked so when the batch reaches the model (one row is padded to two: a dimension of size
1 would be specialised). Under `--cuda-graphs` the rows are padded too,
to the most a batch of that bucket can have (`bucket_rows`), with all-PAD rows: every
shape is static, so each bucket's graph is recorded once and replayed.

Padding changes no result: PAD keys are masked, PAD targets weigh nothing in the loss, and
an all-PAD row may still attend to its first key (nmt/model/attention.py), so it carries no
NaN into the gradients.
"""

from __future__ import annotations

import torch

from nmt.data.batching import Batch
from nmt.data.vocab import PAD_ID

# Bucket lengths in tokens (EOS/BOS included): steps of 8 up to 64, then 16, then 32, up
# to the default --max-len. Padding adds at most a step, about 12 % at most past 64.
LENGTHS: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224,
                            256)


def bucket_length(width: int) -> int:
    """The bucket of a batch whose longer side has `width` tokens: the smallest of
    `LENGTHS` that holds it, else `width` rounded up to a multiple of 32 (a --max-len past
    256)."""
    for length in LENGTHS:
        if length >= width:
            return length
    return -(-width // 32) * 32


def bucket_rows(length: int, micro_tokens: int) -> int:
    """The most rows a micro-batch of `micro_tokens` padded slots has in the bucket of
    `length`: its pairs cost more than the bucket below, so rows * (that + 1) fit."""
    below = max((b for b in LENGTHS if b < length), default=0)
    if length > LENGTHS[-1]:
        below = length - 32
    return max(1, micro_tokens // (below + 1))


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` (r, c) int64 as (rows, cols), PAD to the right and below."""
    out = torch.full((rows, cols), PAD_ID, dtype=t.dtype)
    out[:t.size(0), :t.size(1)] = t
    return out


def pad_to_bucket(batch: Batch, micro_tokens: int | None = None) -> Batch:
    """`batch` with source and target as wide as its bucket (host tensors, before the copy
    to the device); with `micro_tokens` also as many rows as the bucket can have (all-PAD
    rows below), for fully static shapes. Token counts are unchanged. A batch of one row
    gets a second, all-PAD: a compiler specialises a dimension of size 1 (a graph more)."""
    width = max(batch.src.size(1), batch.tgt_in.size(1))
    length = bucket_length(width)
    rows = max(2, batch.src.size(0))
    if micro_tokens is not None:
        rows = max(rows, bucket_rows(length, micro_tokens))
    return Batch(_pad(batch.src, rows, length), _pad(batch.tgt_in, rows, length),
                 _pad(batch.tgt_out, rows, length), batch.src_tokens, batch.tgt_tokens)
