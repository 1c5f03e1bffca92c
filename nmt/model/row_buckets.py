"""Linear layers whose row counts come in steps (zero rows appended), for bf16 training on a
CPU with AMX.

Why: oneDNN compiles a kernel for every matmul shape it meets, about 2.6 ms each with AMX at
training shapes, and every batch of a token-count batcher has its own number of tokens:
the forward, input-gradient and weight-gradient matmuls of every linear layer meet new
shapes at almost every update (Multi30k, `small`: 2,558 compilations, 9.5 s, in the first
100 updates, about a fifth of the time). Rounding each layer's rows (tokens) up to a
multiple of `ROWS` with zero rows leaves a few row counts per run, compiled once. Zero rows
change no result: their outputs are cut off, they add nothing to the weight gradient and
receive none. The attention's batched matmuls (a tenth of the compilations' time) are left
as they are. Which runs bucket: nmt/train/setup.py (`buckets_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROWS = 64  # rows per step: about 3 % more rows at 2,048-token batches


def linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """F.linear(x, weight, bias) with x's rows (its leading dimensions flattened) padded by
    zero rows to a multiple of `multiple` for the matmul: (..., in) -> (..., out)."""
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    extra = -rows % multiple if multiple > 1 else 0
    if extra == 0 or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.size(-1))  # (rows, in)
    flat = torch.cat([flat, flat.new_zeros(extra, flat.size(1))])  # (rows + extra, in)
    out = F.linear(flat, weight, bias)[:rows]  # (rows, out); leading rows: contiguous
    return out.view(*x.shape[:-1], out.size(-1))


class RowBucketedLinear(nn.Linear):
    """nn.Linear whose forward runs `linear_rows` at `row_multiple`; the same parameters and
    state dict (`bucket_rows` swaps a layer's class in place)."""

    row_multiple: int = ROWS

    def forward(self, x: Tensor) -> Tensor:
        return linear_rows(x, self.weight, self.bias, self.row_multiple)


def bucket_rows(model: nn.Module, multiple: int = ROWS) -> int:
    """Make every plain nn.Linear of `model` a RowBucketedLinear at `multiple` (in place,
    parameters untouched), and a model with a `row_multiple` attribute (the Transformer's
    output projection) use it too. Returns the number of layers changed."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowBucketedLinear
            module.row_multiple = multiple
            count += 1
    if hasattr(model, "row_multiple"):
        model.row_multiple = multiple
    return count
