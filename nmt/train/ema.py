"""Exponential moving average of the weights (`nmt train --ema-decay 0.9999`).

After every optimizer step, ema = d x ema + (1 - d) x weights, with d = min(decay,
(1 + t) / (10 + t)) at update t (TensorFlow's ExponentialMovingAverage with num_updates):
early on, when the raw weights move fast, the average follows them instead of holding on to
the random initialisation. Marian's `--exponential-smoothing` and fairseq's `--ema-decay`
do the same. The average is kept in the parameters' own dtype and device (fp32 master
weights under autocast), validated instead of the raw weights, and saved beside them in
every checkpoint (`ema`), so a resumed run continues it exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class WeightAverage:
    """The EMA of a model's parameters."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model = model
        self.decay = decay
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.shadow = [p.detach().clone() for p in self.params]
        self.updates = 0

    def current_decay(self) -> float:
        """The decay of the next update (warmed up by the update count)."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into the average (call after each optimizer step)."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params],
                             1.0 - self.current_decay())
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own ones after."""
        raw = [p.detach().clone() for p in self.params]
        torch._foreach_copy_([p.data for p in self.params], self.shadow)
        try:
            yield
        finally:
            torch._foreach_copy_([p.data for p in self.params], raw)

    def weights(self) -> dict[str, torch.Tensor]:
        """name -> averaged tensor (for checkpoints and model files)."""
        return dict(zip(self.names, self.shadow, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """Decay, update count and the averaged weights."""
        return {"decay": self.decay, "updates": self.updates, "weights": self.weights()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue an average saved by `state_dict` (its decay is kept as configured)."""
        weights = state["weights"]
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise KeyError(f"EMA state lacks {missing[0]}")
        for name, tensor in zip(self.names, self.shadow, strict=True):
            tensor.copy_(weights[name])
        self.updates = int(state["updates"])

