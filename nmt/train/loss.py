"""Label-smoothed cross-entropy that ignores padding and also reports the plain NLL.

With smoothing eps over a vocabulary of V, the target distribution puts 1 - eps on the gold
token and eps / (V - 1) on every other token (fairseq's `label_smoothed_cross_entropy`).
Both sums are returned un-normalised so the caller can divide by the number of target
tokens of the whole update (all micro-batches, all ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(smoothed loss sum, NLL sum) over non-PAD positions, both fp32 scalars.

    logits: (B, T, V) in any float dtype; target: (B, T) int64.
    """
    vocab = logits.size(-1)
    flat_logits = logits.reshape(-1, vocab)  # (B*T, V)
    flat_target = target.reshape(-1)  # (B*T,)
    keep = flat_target != pad_id
    lprobs = F.log_softmax(flat_logits.float(), dim=-1)  # (B*T, V) fp32
    nll = -lprobs.gather(-1, flat_target.unsqueeze(-1)).squeeze(-1)  # (B*T,)
    nll = nll.masked_fill(~keep, 0.0).sum()
    if epsilon == 0.0:
        return nll, nll.detach()
    smooth = -lprobs.sum(-1).masked_fill(~keep, 0.0).sum()  # sum over all V of -log p
    eps_i = epsilon / (vocab - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll.detach()
