"""Label-smoothed cross-entropy that ignores padding and also reports the plain NLL.

With smoothing eps over a vocabulary of V, the target distribution puts 1 - eps on the gold
token and eps / (V - 1) on every other token (fairseq's `label_smoothed_cross_entropy`).
Both sums are returned un-normalised so the caller can divide by the number of target
tokens of the whole update (all micro-batches, all ranks).

The (rows, V) logits are the biggest activation of a training step, so the loss is one
autograd function with the minimum of (rows, V) work: the forward runs one log_softmax
(in fp32 straight from bf16/fp16 logits, no cast copy), a gather and a row sum, and keeps
only the log-probabilities; the backward writes the gradient
`softmax - (1 - eps - eps_i) * onehot - eps_i` into one fresh (rows, V) buffer in place.
Autograd through log_softmax + gather + sum + masked_fill instead allocates several more
(rows, V) tensors. The training loop also projects only the non-PAD target positions
(`target_positions` + the model's `select`), so padding costs nothing in the output
projection or the loss.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row smoothed loss and NLL of (N, V) logits; rows with weight 0 are ignored."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, weight: Tensor | None,
                epsilon: float) -> tuple[Tensor, Tensor]:
        vocab = logits.size(-1)
        eps_i = epsilon / (vocab - 1)
        # (N, V) log-probabilities in fp32 (fp64 for fp64 logits), one vectorised kernel
        lprobs = torch.log_softmax(logits, dim=-1, dtype=_compute_dtype(logits))
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
        if weight is not None:
            weight = weight.to(lprobs.dtype)
            nll = nll * weight
        if epsilon == 0.0:
            loss = nll.sum()
        else:
            smooth = -lprobs.sum(-1)  # (N,) = -sum_v log p_v
            if weight is not None:
                smooth = smooth * weight
            loss = (1.0 - epsilon - eps_i) * nll.sum() + eps_i * smooth.sum()
        # Only log-probabilities are kept (the logits can be freed): exp gives the softmax.
        ctx.save_for_backward(lprobs, target, weight)
        ctx.coef = (1.0 - epsilon - eps_i, eps_i)
        ctx.logits_dtype = logits.dtype
        return loss, nll.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor
                 ) -> tuple[Tensor, None, None, None]:
        lprobs, target, weight = ctx.saved_tensors
        gold, eps_i = ctx.coef
        # d loss / d logits = g * (softmax - gold * onehot - eps_i), built in one buffer.
        scale = grad_loss if weight is None else grad_loss * weight[:, None]  # () or (N, 1)
        grad = lprobs.exp()  # (N, V) softmax, a fresh buffer: backward may run again
        grad.mul_(scale)
        if eps_i:
            grad.sub_(scale * eps_i)
        gold_scale = (scale * -gold).expand(target.size(0), 1)  # (N, 1)
        grad.scatter_add_(-1, target[:, None], gold_scale.to(grad.dtype))
        # The NLL output is a detached statistic; its gradient (always zero here) is ignored.
        return grad.to(ctx.logits_dtype), None, None, None


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for half-precision logits (softmax sums need the range), else their own."""
    return torch.promote_types(logits.dtype, torch.float32)


def smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float,
                           weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) of `logits` (N, V) against `target` (N,), fp32 scalars.

    `weight` (N,) of 0/1 masks rows out (padding); None counts every row. The NLL is a
    detached statistic.
    """
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, weight, float(epsilon))
    return loss, nll.detach()


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float,
                       pad_id: int) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) over non-PAD positions, both fp32 scalars.

    logits: (..., V) in any float dtype; target: (...) int64 with `pad_id` at padding.
    """
    flat_logits = logits.reshape(-1, logits.size(-1))  # (B*T, V)
    flat_target = target.reshape(-1)  # (B*T,)
    keep = flat_target.ne(pad_id).to(_compute_dtype(logits))  # (B*T,) 1 at real tokens
    return smoothed_cross_entropy(flat_logits, flat_target, epsilon, keep)


def target_positions(tgt_lengths: np.ndarray, width: int) -> np.ndarray | None:
    """Flat indices into (batch * width) of the real (non-PAD) target positions of a
    right-padded batch whose rows hold `tgt_lengths` tokens (EOS included); None when no
    row is padded. Computed on the host, so selecting them costs no device sync."""
    lengths = np.asarray(tgt_lengths, dtype=np.int64)
    if lengths.min() == width:
        return None
    starts = np.arange(lengths.size, dtype=np.int64) * width  # (batch,)
    ends = np.cumsum(lengths)  # (batch,) position after each row in the packed order
    offsets = np.repeat(starts - (ends - lengths), lengths)  # (n_real,)
    return np.arange(int(ends[-1]), dtype=np.int64) + offsets
