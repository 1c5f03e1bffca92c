"""nmt.model.dropout.dropout: F.dropout's semantics with a cheaper CPU mask."""

from __future__ import annotations

import pytest
import torch

from nmt.model.dropout import dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.3])
def test_drops_with_probability_p_and_keeps_the_mean(dtype: torch.dtype, p: float) -> None:
    torch.manual_seed(0)
    x = torch.ones(400, 1000, dtype=dtype)
    y = dropout(x, p, training=True)
    assert y.dtype == dtype and y.shape == x.shape
    dropped = (y == 0).float().mean().item()
    assert dropped == pytest.approx(p, abs=0.005)  # 400k draws: sd ~0.0006
    kept = y[y != 0].float()
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-2, atol=0)
    assert y.float().mean().item() == pytest.approx(1.0, abs=0.01)


def test_identity_at_inference_and_at_zero() -> None:
    x = torch.randn(5, 7)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    assert bool((dropout(x, 1.0, training=True) == 0).all())


def test_gradient_is_the_same_mask() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    y = dropout(x, 0.25, training=True)
    y.sum().backward()
    expected = (y != 0).float() / 0.75
    torch.testing.assert_close(x.grad, expected)


def test_seeded_masks_repeat() -> None:
    x = torch.ones(50, 50)
    torch.manual_seed(3)
    a = dropout(x, 0.1, True)
    torch.manual_seed(3)
    b = dropout(x, 0.1, True)
    assert torch.equal(a, b)
