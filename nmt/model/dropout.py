"""Dropout for every layer of the model, with a cheaper mask on CPU.

On a CPU, drawing the mask is the costly part of dropout: `F.dropout` draws a float per
element with `bernoulli_`. Here each 64-bit draw of torch's generator is cut into four
16-bit uniforms and compared with p rounded to 1/65536, far cheaper than a float per
element (docs/training.md). Inverted scaling as in F.dropout, by the rounded p, so the
expectation is exact and inference needs nothing. Other devices use torch's fused dropout
kernel (`native_dropout`, what F.dropout calls on CUDA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.model.paths import cpu_path

_LEVELS = 1 << 16  # 16-bit uniforms: p is rounded to a multiple of 1/65536


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Zero each element of `x` with probability `p` and scale the rest by 1 / (1 - p)
    when `training`; `x` itself otherwise (or when p is 0)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return F.dropout(x, p, training)
    if not cpu_path(x):  # what F.dropout runs on CUDA: one fused kernel each way
        return torch.native_dropout(x, p, True)[0]
    keep, kept = keep_mask(x.shape, p, x.device)
    scale = keep.to(x.dtype).mul_(1.0 / kept)  # 0 or 1 / (1 - p), outside autograd
    return x * scale


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[Tensor, float]:
    """A bool mask of `shape`, each element True with probability 1 - p (p rounded to a
    multiple of 1/65536, or drawn as float32 where that rounding would reach 0 or 1),
    and that keep probability."""
    threshold = round(p * _LEVELS)
    if not 0 < threshold < _LEVELS:
        return torch.rand(shape, dtype=torch.float32, device=device) >= p, 1.0 - p
    n = math.prod(shape)
    # Full-range 64-bit draws (the default range leaves the top bit 0), viewed as four
    # int16 lanes each: (ceil(n / 4),) int64 -> (4 * ceil(n / 4),) int16 -> shape.
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    lanes = words.random_(-(1 << 63), None).view(torch.int16)[:n].view(shape)
    keep = lanes >= threshold - _LEVELS // 2  # P = 1 - threshold / 65536
    return keep, 1.0 - threshold / _LEVELS
