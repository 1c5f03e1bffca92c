"""nmt.model.dropout.dropout: F.dropout's semantics with a cheaper CPU mask."""

from __future__ import annotations

import pytest
import torch

from nmt.model.dropout import dropout, keep_mask


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


def test_each_16_bit_lane_drops_at_p() -> None:
    """Four elements share one 64-bit draw; a draw whose top bit is always 0 (torch's
    default random_ range) would make every fourth element's drop rate 0."""
    torch.manual_seed(4)
    keep, kept = keep_mask(torch.Size((1000, 400)), 0.1, torch.device("cpu"))
    assert kept == pytest.approx(1 - 6554 / 65536)
    lanes = (~keep).reshape(-1, 4).float().mean(0)  # (4,) drop rate per lane
    torch.testing.assert_close(lanes, torch.full((4,), 0.1), atol=0.004, rtol=0)


@pytest.mark.parametrize("shape", [(3, 5), (1,), (2, 3, 7)])
def test_sizes_that_are_not_a_multiple_of_four(shape: tuple[int, ...]) -> None:
    keep, _ = keep_mask(torch.Size(shape), 0.5, torch.device("cpu"))
    assert keep.shape == shape and keep.dtype == torch.bool


@pytest.mark.parametrize("p", [1e-6, 0.999999])
def test_p_beyond_16_bits_falls_back_to_float_draws(p: float) -> None:
    torch.manual_seed(5)
    keep, kept = keep_mask(torch.Size((1000, 100)), p, torch.device("cpu"))
    assert kept == pytest.approx(1 - p)
    assert (~keep).float().mean().item() == pytest.approx(p, abs=0.002)
    y = dropout(torch.ones(1000, 100), p, training=True)
    assert bool(torch.isfinite(y).all())
