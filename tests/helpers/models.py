"""Tiny random Transformers and batches for the model, decoding and loss tests."""

from __future__ import annotations

import numpy as np
import torch

from nmt.config import model_preset
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID
from nmt.model.transformer import Transformer
from nmt.train.loss import target_positions

VOCAB = 50


def make_model(seed: int = 0, **overrides: object) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_preset("tiny", vocab_size=VOCAB, **overrides)).eval()


def random_batch(lengths: list[int], seed: int, bos: bool = False) -> torch.Tensor:
    """Right-padded (batch, max_len) ids; rows end with EOS (source) or start with BOS."""
    gen = torch.Generator().manual_seed(seed)
    batch = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
    for row, n in enumerate(lengths):
        batch[row, :n] = torch.randint(EOS_ID + 1, VOCAB, (n,), generator=gen)
        if bos:
            batch[row, 0] = BOS_ID
        else:
            batch[row, n - 1] = EOS_ID
    return batch


def tiny_model_batch() -> tuple:
    """A tiny fp64 Transformer (vocab 50, no dropout) and a padded batch of 3 pairs (PAD 0):
    model, src (3, 6), tgt_in and tgt_out (3, 5), and `select`, the flat positions of the
    real target tokens."""
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny", vocab_size=50, dropout=0.0)).double()
    lengths = np.array([5, 2, 4])
    src = torch.randint(4, 50, (3, 6))
    src[1, 3:] = 0
    tgt_in = torch.randint(4, 50, (3, 5))
    tgt_out = torch.randint(4, 50, (3, 5))
    for row, n in enumerate(lengths):
        tgt_in[row, n:] = 0
        tgt_out[row, n:] = 0
    return model, src, tgt_in, tgt_out, torch.from_numpy(target_positions(lengths, 5))
