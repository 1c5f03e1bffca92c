"""Learning-rate schedules by name (SCHEDULES, `--lr-schedule`) and the Adam optimiser
they drive.

The paper's (section 5.3), `inverse_sqrt`: lr(step) = lr_scale * d_model^-0.5 *
min(step^-0.5, step * warmup^-1.5), linear warm-up for `warmup` updates, then inverse
square root decay. Steps count from 1. It assumes training runs as long as it takes.

The budgeted ones know where training ends: `linear` (Li, Yumer and Ramanan, "Budgeted
training", ICLR 2020: linear decay to the budget's end), `cosine` (Loshchilov and Hutter's
SGDR without restarts) and `wsd` (warm-up, stable, decay: a constant peak, then a linear
decay over the budget's last `decay_fraction`). All warm up linearly for `warmup` updates
to the inverse-sqrt schedule's peak, lr_scale * d_model^-0.5 * warmup^-0.5 (so --lr-scale
means the same for every schedule), then follow the budget's progress p in [0, 1] (the
larger of updates / --max-updates, minutes / --max-minutes and epochs / --max-epochs, from
the trainer), rebased to start at the end of warm-up, down to `final` x peak at p = 1.
A new schedule is a class with the `Schedule` methods and one SCHEDULES entry (its name
also in nmt.config.LR_SCHEDULES).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from nmt.config import TrainConfig


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, lr_scale: float = 1.0) -> float:
    """The learning rate of update number `step` (1-based)."""
    step = max(step, 1)
    return lr_scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def peak_lr(d_model: int, warmup: int, lr_scale: float = 1.0) -> float:
    """The inverse-sqrt schedule's highest rate, at the end of warm-up: where every
    budgeted schedule's warm-up goes too, so `lr_scale` means the same for all of them."""
    return lr_scale * d_model ** -0.5 * warmup ** -0.5


class InverseSqrtSchedule:
    """Sets every param group's lr for the next update; state is just the update count."""

    def __init__(self, optimizer: torch.optim.Optimizer, d_model: int, warmup: int,
                 lr_scale: float = 1.0) -> None:
        self.optimizer = optimizer
        self.d_model = d_model
        self.warmup = warmup
        self.lr_scale = lr_scale
        self.step_count = 0
        self.progress = 0.0  # of the last update (for --dropout-schedule; not the lr)
        self._apply()

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses."""
        return inverse_sqrt_lr(self.step_count + 1, self.d_model, self.warmup, self.lr_scale)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self, progress: float = 0.0) -> None:
        """Call after each successful optimizer step (`progress` is kept, not used here)."""
        self.step_count += 1
        self.progress = min(max(progress, self.progress), 1.0)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Plain state for checkpoints."""
        return {"step_count": self.step_count, "d_model": self.d_model, "warmup": self.warmup,
                "lr_scale": self.lr_scale, "progress": self.progress}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the update count and progress (the shape parameters come from the
        current config; a checkpoint from before progress was kept restores 0)."""
        self.step_count = int(state["step_count"])
        self.progress = float(state.get("progress", 0.0))
        self._apply()


def budget_factor(shape: str, q: float, final: float, decay_fraction: float = 0.2) -> float:
    """The budgeted schedules' lr after warm-up as a fraction of the peak, at `q` in [0, 1],
    the share of the budget after warm-up that has passed: 1 at q = 0, `final` at q = 1.
    linear: straight down; cosine: half a cosine; wsd: 1 until 1 - `decay_fraction`, then
    straight down."""
    q = min(max(q, 0.0), 1.0)
    if shape == "linear":
        left = 1.0 - q
    elif shape == "cosine":
        left = 0.5 * (1.0 + math.cos(math.pi * q))
    elif shape == "wsd":
        left = min(1.0, (1.0 - q) / decay_fraction) if decay_fraction > 0 else float(q < 1)
    else:
        raise ValueError(f"unknown budgeted schedule {shape!r}")
    return final + (1.0 - final) * left


class BudgetSchedule:
    """Warm-up to the peak, then `budget_factor(shape, ...)` of the budget's progress.

    The trainer passes each update's progress p (see the module docstring) to `step`;
    the lr it sets is the next update's. Warm-up ends at update `warmup`, at whatever
    progress p_w that is (unknown in advance with a time budget): the decay then runs over
    q = (p - p_w) / (1 - p_w), so the peak is reached whatever the budget. State: the
    update count, p_w and the last p (so a resumed run goes on exactly)."""

    def __init__(self, optimizer: torch.optim.Optimizer, shape: str, d_model: int,
                 warmup: int, lr_scale: float = 1.0, final: float = 0.0,
                 decay_fraction: float = 0.2) -> None:
        budget_factor(shape, 0.0, final, decay_fraction)  # refuses an unknown shape
        self.optimizer, self.shape = optimizer, shape
        self.warmup, self.final, self.decay_fraction = warmup, final, decay_fraction
        self.peak = peak_lr(d_model, warmup, lr_scale)
        self.step_count = 0
        self.progress = 0.0  # of the last update
        self.warmup_progress: float | None = None  # p_w, once warm-up has ended
        self._apply()

    @property
    def lr(self) -> float:
        """The lr the next optimizer step uses."""
        if self.step_count < self.warmup:
            return self.peak * (self.step_count + 1) / self.warmup
        start = self.warmup_progress if self.warmup_progress is not None else self.progress
        q = (self.progress - start) / (1.0 - start) if start < 1.0 else 1.0
        return self.peak * budget_factor(self.shape, q, self.final, self.decay_fraction)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self, progress: float = 0.0) -> None:
        """Call after each successful optimizer step with the budget's `progress` then."""
        self.step_count += 1
        self.progress = min(max(progress, self.progress), 1.0)  # never backwards
        if self.step_count == self.warmup:
            self.warmup_progress = self.progress
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Plain state for checkpoints."""
        return {"step_count": self.step_count, "progress": self.progress,
                "warmup_progress": self.warmup_progress, "shape": self.shape}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the update count and progress (the shape comes from the current config;
        a checkpoint of another schedule gives only its update count)."""
        self.step_count = int(state["step_count"])
        self.progress = float(state.get("progress", 0.0))
        warmup_progress = state.get("warmup_progress")
        if warmup_progress is None and self.step_count >= self.warmup:
            warmup_progress = self.progress if "progress" in state else 0.0
        self.warmup_progress = None if warmup_progress is None else float(warmup_progress)
        self._apply()


class Schedule(Protocol):
    """What the trainer needs of a schedule: the next lr, a step per successful update
    (told the budget's progress then), the progress of the last one (which
    `dropout_factor` also follows), and plain state for checkpoints."""

    progress: float

    @property
    def lr(self) -> float: ...

    def step(self, progress: float = 0.0) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


BUDGETED = ("linear", "cosine", "wsd")  # the schedules that need a budget


def _budgeted(shape: str) -> Callable[[torch.optim.Optimizer, int, TrainConfig], Schedule]:
    """The SCHEDULES builder of the budgeted schedule `shape`."""
    def build(optimizer: torch.optim.Optimizer, d_model: int, cfg: TrainConfig) -> Schedule:
        return BudgetSchedule(optimizer, shape, d_model, cfg.warmup, cfg.lr_scale,
                              cfg.lr_final, cfg.decay_fraction)
    return build


# name -> builder(optimizer, d_model, train config); the names are nmt.config.LR_SCHEDULES.
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, int, TrainConfig], Schedule]] = {
    "inverse_sqrt": lambda optimizer, d_model, cfg: InverseSqrtSchedule(
        optimizer, d_model, cfg.warmup, cfg.lr_scale),
    **{shape: _budgeted(shape) for shape in BUDGETED},
}


def dropout_factor(schedule: str, progress: float, epochs: float = 0.0,
                   full_epochs: float = 0.0) -> float:
    """The share of its set dropout rates the model uses after an update that left the
    budget at `progress` in [0, 1], `epochs` epochs into the data: 1 for `constant`;
    for `linear` the progress itself, so the rates rise from 0 at the start to their set
    values at the budget's end (`--dropout-schedule`; Morerio et al., "Curriculum
    Dropout", ICCV 2017, raise the rate over training the same way, there by an
    exponential). With `full_epochs` > 0 (`--dropout-epochs`) it is at most
    epochs / full_epochs: a budget that holds fewer epochs ends below the set rates,
    in proportion, since a model that sees its data fewer times overfits it less."""
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        share = progress if full_epochs <= 0 else min(progress, epochs / full_epochs)
        return min(max(share, 0.0), 1.0)
    raise ValueError(f"unknown dropout schedule {schedule!r}")


def epochs_seen(epoch: int, index: int, epoch_size: Callable[[int], int]) -> float:
    """Epochs of data seen `index` batches into `epoch` (1-based) of `epoch_size(epoch)`
    batches: epoch - 1 plus the share of this one."""
    return epoch - 1 + (index / epoch_size(epoch) if index else 0.0)


def budget_progress(cfg: TrainConfig, updates: int, elapsed: float, epoch: int, index: int,
                    epoch_size: Callable[[int], int]) -> float:
    """How much of the budget has passed after `updates` updates, `elapsed` seconds in,
    `index` batches into `epoch` (of `epoch_size(epoch)`): the largest share of
    --max-updates, --max-minutes and --max-epochs (those set), at most 1."""
    shares = [updates / cfg.max_updates]
    if cfg.max_minutes > 0:
        shares.append(elapsed / (cfg.max_minutes * 60))
    if cfg.max_epochs > 0:
        shares.append(epochs_seen(epoch, index, epoch_size) / cfg.max_epochs)
    return min(max(shares), 1.0)


def describe_schedule(cfg: TrainConfig, d_model: int) -> str:
    """The start-up line's words for the schedule and the budget it follows, e.g.
    "lr schedule linear: warm-up 400 updates to 1.25e-03, then down to 0 at the end of
    the budget (15 minutes or 100000 updates, whichever comes first)"."""
    peak = peak_lr(d_model, cfg.warmup, cfg.lr_scale)
    budget = [f"{cfg.max_minutes:g} minutes"] if cfg.max_minutes > 0 else []
    budget += [f"{cfg.max_epochs} epochs"] if cfg.max_epochs > 0 else []
    budget.append(f"{cfg.max_updates} updates")
    limit = budget[0] if len(budget) == 1 else (
        f"{', '.join(budget[:-1])} or {budget[-1]}, whichever comes first")
    head = f"lr schedule {cfg.lr_schedule}: warm-up {cfg.warmup} updates to {peak:.3g}"
    if cfg.lr_schedule not in BUDGETED:
        return f"{head}, then 1/sqrt(update); budget {limit}"
    final = f"{cfg.lr_final * peak:.3g}" if cfg.lr_final else "0"
    hold = (f", held until the last {cfg.decay_fraction:g} of the budget"
            if cfg.lr_schedule == "wsd" else "")
    return f"{head}{hold}, then down to {final} at the end of the budget ({limit})"


def describe_dropout(cfg: TrainConfig, rates: dict[str, float]) -> str | None:
    """The start-up line for a dropout schedule, e.g. "dropout schedule linear: rates rise
    from 0 to dropout 0.3 at the end of the budget"; None for `constant`. `rates`: the
    model's set rates by name (the zero ones are left out)."""
    if cfg.dropout_schedule == "constant":
        return None
    named = ", ".join(f"{name} {rate:g}" for name, rate in rates.items() if rate) or "0"
    line = (f"dropout schedule {cfg.dropout_schedule}: rates rise from 0 to {named} at "
            "the end of the budget")
    if cfg.dropout_epochs > 0:
        line += (f", if it holds {cfg.dropout_epochs:g} epochs (else in proportion to the "
                 "epochs seen)")
    return line


def build_schedule(optimizer: torch.optim.Optimizer, d_model: int, cfg: TrainConfig
                   ) -> Schedule:
    """The schedule `cfg.lr_schedule` names, driving `optimizer`'s learning rate."""
    return SCHEDULES[cfg.lr_schedule](optimizer, d_model, cfg)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig,
                    device: torch.device, fused: bool | None = None) -> torch.optim.Adam:
    """Adam(beta1, beta2, eps) as in the paper, as torch's fused kernel on a CPU and on
    CUDA (one pass over the weights, where foreach Adam on a CPU loops tensor by tensor),
    foreach elsewhere or with `fused=False`. The fused kernel can also skip a step on the
    device: see nmt/train/step.py `DeviceSkip`."""
    if fused is None:
        fused = device.type in ("cpu", "cuda")
    return torch.optim.Adam(list(params), lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                            fused=fused or None, foreach=None if fused else True)


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")  # how Adam runs, not what it is


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, keeping this process's implementation.

    torch takes the saved param groups whole, `fused`/`foreach` included, and places the
    step counters by them: a run saved on a CPU (foreach Adam) and resumed on a GPU would
    go on with foreach Adam and host-side step counters, which cannot skip a step on the
    device (nmt/train/step.py `DeviceSkip`), and a GPU run resumed on a CPU would switch
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
