"""Learning-rate schedules by name (SCHEDULES, `--lr-schedule`) and the Adam optimiser
they drive.

The paper's (section 5.3), `inverse_sqrt`: lr(step) = lr_scale * d_model^-0.5 *
min(step^-0.5, step * warmup^-1.5), linear warm-up for `warmup` updates, then inverse
square root decay. Steps count from 1. A new schedule is a class with the `Schedule`
methods and one SCHEDULES entry (its name also in nmt.config.LR_SCHEDULES).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from nmt.config import TrainConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, lr_scale: float = 1.0) -> float:
    """The learning rate of update number `step` (1-based)."""
    step = max(step, 1)
    return lr_scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class InverseSqrtSchedule:
    """Sets every param group's lr for the next update; state is just the update count."""

    def __init__(self, optimizer: torch.optim.Optimizer, d_model: int, warmup: int,
                 lr_scale: float = 1.0) -> None:
        self.optimizer = optimizer
        self.d_model = d_model
        self.warmup = warmup
        self.lr_scale = lr_scale
        self.step_count = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses."""
        return inverse_sqrt_lr(self.step_count + 1, self.d_model, self.warmup, self.lr_scale)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        """Call after each successful optimizer step."""
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Plain-int state for checkpoints."""
        return {"step_count": self.step_count, "d_model": self.d_model, "warmup": self.warmup,
                "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the update count (the shape parameters come from the current config)."""
        self.step_count = int(state["step_count"])
        self._apply()


class Schedule(Protocol):
    """What the trainer needs of a schedule: the next lr, a step per successful update,
    and plain state for checkpoints."""

    @property
    def lr(self) -> float: ...

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# name -> builder(optimizer, d_model, train config); the names are nmt.config.LR_SCHEDULES.
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, int, TrainConfig], Schedule]] = {
    "inverse_sqrt": lambda optimizer, d_model, cfg: InverseSqrtSchedule(
        optimizer, d_model, cfg.warmup, cfg.lr_scale),
}


def build_schedule(optimizer: torch.optim.Optimizer, d_model: int, cfg: TrainConfig
                   ) -> Schedule:
    """The schedule `cfg.lr_schedule` names, driving `optimizer`'s learning rate."""
    return SCHEDULES[cfg.lr_schedule](optimizer, d_model, cfg)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig,
                    device: torch.device, fused: bool | None = None) -> torch.optim.Adam:
    """Adam(beta1, beta2, eps) as in the paper; fused kernel on CUDA, foreach on CPU
    unless `fused` says otherwise (the fused kernel can skip a step on the device: see
    nmt/train/step.py `launch_update`)."""
    if fused is None:
        fused = device.type == "cuda"
    return torch.optim.Adam(list(params), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                            fused=fused or None, foreach=None if fused else True)


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")  # how Adam runs, not what it is


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, keeping this process's implementation.

    torch takes the saved param groups whole, `fused`/`foreach` included, and places the
    step counters by them: a run saved on a CPU (foreach Adam) and resumed on a GPU would
    go on with foreach Adam and host-side step counters, which cannot skip a step on the
    device (nmt/train/step.py `launch_update`), and a GPU run resumed on a CPU would switch
    to the fused kernel. The hyperparameters and moments come from `state`; how the
    kernel runs stays as `build_optimizer` chose it here."""
    ours = optimizer.param_groups
    groups = [{**saved, **{k: mine[k] for k in IMPLEMENTATION_KEYS if k in mine}}
              for saved, mine in zip(state["param_groups"], ours, strict=False)]
    optimizer.load_state_dict({**state, "param_groups": groups})


def total_norm(grads: list[Tensor]) -> Tensor:
    """L2 norm of all gradients together (a 0-dim tensor on their device; no host sync).

    `torch.nn.utils.get_total_norm` where torch has it (>= 2.6), else the same computed
    with per-tensor norms (older releases).
    """
    fast = getattr(torch.nn.utils, "get_total_norm", None)
    if fast is not None:
        return fast(grads)
    if not grads:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])  # (n,)
    return torch.linalg.vector_norm(norms)
