"""Label-smoothed cross-entropy against a hand computation."""

from __future__ import annotations

import math

import torch

from nmt.train.loss import label_smoothed_nll


def test_matches_hand_computation_and_ignores_pad():
    logits = torch.tensor([[[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0], [9.0, 9.0, 9.0, 9.0]]])
    target = torch.tensor([[1, 2, 0]])  # last position is PAD (id 0)
    eps, vocab = 0.1, 4
    loss, nll = label_smoothed_nll(logits, target, eps, pad_id=0)
    hand_loss = hand_nll = 0.0
    for row, gold in ((logits[0, 0].tolist(), 1), (logits[0, 1].tolist(), 2)):
        log_z = math.log(sum(math.exp(x) for x in row))
        logp = [x - log_z for x in row]
        q = [eps / (vocab - 1)] * vocab
        q[gold] = 1 - eps
        hand_loss += -sum(qi * lp for qi, lp in zip(q, logp, strict=True))
        hand_nll += -logp[gold]
    assert math.isclose(loss.item(), hand_loss, rel_tol=1e-6)
    assert math.isclose(nll.item(), hand_nll, rel_tol=1e-6)


def test_no_smoothing_is_plain_nll_and_grad_flows():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    target = torch.tensor([[3, 4, 0], [5, 0, 0]])
    loss, nll = label_smoothed_nll(logits, target, 0.0, pad_id=0)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), target.reshape(-1),
                                            ignore_index=0, reduction="sum")
    assert torch.allclose(loss, ref) and torch.allclose(nll, ref)
    loss.backward()
    assert logits.grad[1, 1].abs().sum() == 0  # PAD positions get no gradient


def test_bf16_logits_give_fp32_loss():
    logits = torch.randn(1, 2, 5).bfloat16()
    loss, _ = label_smoothed_nll(logits, torch.tensor([[1, 2]]), 0.1, pad_id=0)
    assert loss.dtype == torch.float32
