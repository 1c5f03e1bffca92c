"""The learning-rate schedule equals the paper's formula; the optimiser is the paper's."""

from __future__ import annotations

import math

import pytest
import torch

from nmt.config import TrainConfig
from nmt.train.schedule import InverseSqrtSchedule, build_optimizer, inverse_sqrt_lr


@pytest.mark.parametrize("step", [1, 4000, 100000])
def test_formula_at_paper_steps(step):
    expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    assert math.isclose(inverse_sqrt_lr(step, 512, 4000), expected, rel_tol=1e-12)
    assert math.isclose(inverse_sqrt_lr(step, 512, 4000, lr_scale=2.0), 2 * expected,
                        rel_tol=1e-12)


def test_peak_at_warmup_and_known_values():
    assert math.isclose(inverse_sqrt_lr(4000, 512, 4000), 512 ** -0.5 / math.sqrt(4000))
    assert inverse_sqrt_lr(3999, 512, 4000) < inverse_sqrt_lr(4000, 512, 4000)
    assert inverse_sqrt_lr(4001, 512, 4000) < inverse_sqrt_lr(4000, 512, 4000)
    assert math.isclose(inverse_sqrt_lr(1, 512, 4000), 512 ** -0.5 * 4000 ** -1.5)


def test_schedule_drives_optimizer_and_restores():
    param = torch.nn.Parameter(torch.zeros(3))
    cfg = TrainConfig()
    opt = build_optimizer([param], cfg, torch.device("cpu"))
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    sched = InverseSqrtSchedule(opt, d_model=512, warmup=4000)
    assert group["lr"] == inverse_sqrt_lr(1, 512, 4000)
    for _ in range(9):
        sched.step()
    assert group["lr"] == inverse_sqrt_lr(10, 512, 4000)
    other = InverseSqrtSchedule(build_optimizer([param], cfg, torch.device("cpu")), 512, 4000)
    other.load_state_dict(sched.state_dict())
    assert other.lr == sched.lr


def test_schedules_and_metrics_are_chosen_by_name():
    """The schedule is built from its name (every name in LR_SCHEDULES has a builder; an
    unknown one is a usage error), and --best-metric's direction comes from BEST_METRICS."""
    import pytest

    from nmt.config import BEST_METRICS, LR_SCHEDULES
    from nmt.errors import UsageError
    from nmt.train.best import BestTracker
    from nmt.train.schedule import SCHEDULES, build_schedule

    assert set(SCHEDULES) == set(LR_SCHEDULES)
    cfg = TrainConfig(warmup=100, lr_scale=2.0)
    param = torch.nn.Parameter(torch.zeros(3))
    sched = build_schedule(build_optimizer([param], cfg, torch.device("cpu")), 256, cfg)
    assert sched.lr == inverse_sqrt_lr(1, 256, 100, 2.0)
    with pytest.raises(UsageError, match="unknown lr schedule 'exponential'"):
        TrainConfig(lr_schedule="exponential")
    assert BEST_METRICS == {"loss": "lower", "bleu": "higher", "chrf": "higher"}
    for metric, direction in BEST_METRICS.items():
        tracker = BestTracker(metric)
        assert tracker.observe({metric: 10.0}, 1)
        assert tracker.observe({metric: 9.0 if direction == "lower" else 11.0}, 2)
        assert not tracker.observe({metric: 12.0 if direction == "lower" else 8.0}, 3)
        assert (tracker.best_step, tracker.stale) == (2, 1)


# ----- the budgeted schedules (linear, cosine, wsd) against their formulas -----

def _budgeted(shape: str, warmup: int = 10, final: float = 0.0, decay_fraction: float = 0.2,
              d_model: int = 256, lr_scale: float = 2.0):
    from nmt.train.schedule import BudgetSchedule

    param = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([param], TrainConfig(), torch.device("cpu"))
    return BudgetSchedule(opt, shape, d_model, warmup, lr_scale, final, decay_fraction), opt


def _expected(shape: str, q: float, final: float, decay_fraction: float = 0.2) -> float:
    """The schedules' formulas written out independently of the library."""
    if shape == "linear":
        left = 1 - q
    elif shape == "cosine":
        left = (1 + math.cos(math.pi * q)) / 2
    else:  # wsd: the peak, then linear over the last decay_fraction
        left = 1.0 if q <= 1 - decay_fraction else (1 - q) / decay_fraction
    return final + (1 - final) * left


@pytest.mark.parametrize("shape", ["linear", "cosine", "wsd"])
@pytest.mark.parametrize("final", [0.0, 0.1])
def test_budgeted_schedules_follow_their_formulas(shape, final):
    """Warm-up rises linearly to the inverse-sqrt peak at update `warmup`; after it the lr
    is peak x formula(q), q the share of the budget after warm-up, rebased at the progress
    warm-up ended at (0.2 here), reaching final x peak at progress 1 and staying there."""
    sched, opt = _budgeted(shape, warmup=10, final=final)
    peak = 2.0 * 256 ** -0.5 * 10 ** -0.5
    assert math.isclose(peak, inverse_sqrt_lr(10, 256, 10, 2.0))
    assert math.isclose(sched.lr, peak / 10) and opt.param_groups[0]["lr"] == sched.lr
    for update in range(1, 10):  # warm-up: progress does not matter yet
        sched.step(progress=update * 0.02)
        assert math.isclose(sched.lr, peak * (update + 1) / 10)
    sched.step(progress=0.2)  # update 10 ends warm-up at progress 0.2
    assert math.isclose(sched.lr, peak)
    for progress in (0.3, 0.5, 0.84, 0.9, 0.99, 1.0):
        sched.step(progress=progress)
        q = (progress - 0.2) / 0.8
        assert math.isclose(sched.lr, peak * _expected(shape, q, final), abs_tol=1e-15)
        assert opt.param_groups[0]["lr"] == sched.lr
    sched.step(progress=1.7)  # past the budget (the last update in flight): stays final
    assert math.isclose(sched.lr, final * peak, abs_tol=1e-15)


def test_budgeted_schedule_resumes_exactly_and_never_goes_back():
    sched, _ = _budgeted("cosine", warmup=4)
    for update in range(1, 8):
        sched.step(progress=update / 20)
    other, _ = _budgeted("cosine", warmup=4)
    other.load_state_dict(sched.state_dict())
    assert other.lr == sched.lr and other.warmup_progress == sched.warmup_progress == 0.2
    sched.step(progress=0.5)
    other.step(progress=0.5)
    assert other.lr == sched.lr
    before = sched.lr
    sched.step(progress=0.1)  # a smaller progress (another rank's clock) never raises the lr
    assert sched.lr == before
    # A run saved by the inverse-sqrt schedule past its warm-up goes on from the update count.
    inverse = InverseSqrtSchedule(build_optimizer([torch.nn.Parameter(torch.zeros(1))],
                                                  TrainConfig(), torch.device("cpu")), 256, 4)
    for _ in range(6):
        inverse.step()
    switched, _ = _budgeted("linear", warmup=4)
    switched.load_state_dict(inverse.state_dict())
    assert switched.step_count == 6 and switched.warmup_progress == 0.0


def test_schedule_line_names_the_schedule_and_its_budget():
    from nmt.train.schedule import describe_schedule

    line = describe_schedule(TrainConfig(lr_schedule="linear", warmup=400, lr_scale=0.4,
                                         max_minutes=15), 256)
    assert line == ("lr schedule linear: warm-up 400 updates to 0.00125, then down to 0 at "
                    "the end of the budget (15 minutes or 100000 updates, whichever comes "
                    "first)")
    line = describe_schedule(TrainConfig(lr_schedule="wsd", warmup=400, lr_final=0.1,
                                         max_updates=3000), 256)
    assert "held until the last 0.2 of the budget" in line and "down to 0.000313" in line
    assert line.endswith("(3000 updates)")
    assert describe_schedule(TrainConfig(warmup=4000), 512).startswith(
        "lr schedule inverse_sqrt: warm-up 4000 updates to 0.000699, then 1/sqrt(update)")


@pytest.mark.parametrize("field, value", [("lr_final", 1.0), ("lr_final", -0.1),
                                          ("decay_fraction", 0.0), ("decay_fraction", 1.5)])
def test_budget_settings_out_of_range_are_usage_errors(field, value):
    from nmt.errors import UsageError

    with pytest.raises(UsageError, match=field.replace("_", "-")):
        TrainConfig(**{field: value})


def test_budget_progress_is_the_largest_share_of_the_limits_set():
    """Updates, minutes and epochs each give a share of the budget; the schedules follow
    the largest, at most 1; an epoch's share counts the batches done within it."""
    from nmt.train.schedule import budget_progress

    def size(epoch):
        return 10

    assert budget_progress(TrainConfig(max_updates=100), 25, 9e9, 1, 0, size) == 0.25
    cfg = TrainConfig(max_updates=100, max_minutes=10, max_epochs=4)
    assert budget_progress(cfg, 10, 180.0, 1, 5, size) == pytest.approx(0.3)  # minutes
    assert budget_progress(cfg, 10, 60.0, 2, 5, size) == pytest.approx(1.5 / 4)  # epochs
    assert budget_progress(cfg, 300, 60.0, 1, 0, size) == 1.0


def test_dropout_schedules_follow_the_budget():
    """constant keeps the set rates; linear scales them by the budget's progress (0 at the
    start, the set rates at the end, clamped); unknown names and linear with --compile are
    usage errors; the start-up line names the non-zero rates."""
    from nmt.config import DROPOUT_SCHEDULES
    from nmt.errors import UsageError
    from nmt.train.schedule import describe_dropout, dropout_factor

    assert DROPOUT_SCHEDULES == ("constant", "linear")
    for progress in (0.0, 0.25, 1.0):
        assert dropout_factor("constant", progress) == 1.0
        assert dropout_factor("linear", progress) == progress
    assert dropout_factor("linear", 1.5) == 1.0 and dropout_factor("linear", -0.1) == 0.0
    # --dropout-epochs: the smaller of the progress and the epochs seen / full epochs
    assert dropout_factor("linear", 0.5, epochs=3.0, full_epochs=12.0) == 0.25
    assert dropout_factor("linear", 0.5, epochs=9.0, full_epochs=12.0) == 0.5
    assert dropout_factor("linear", 1.0, epochs=30.0, full_epochs=12.0) == 1.0
    assert dropout_factor("linear", 0.5, epochs=3.0) == 0.5  # 0: progress alone
    assert dropout_factor("constant", 0.5, epochs=1.0, full_epochs=12.0) == 1.0
    assert describe_dropout(TrainConfig(dropout_epochs=12.0), {"dropout": 0.3}) is None
    with pytest.raises(UsageError, match="dropout-epochs must be >= 0"):
        TrainConfig(dropout_schedule="linear", dropout_epochs=-1.0)
    with pytest.raises(ValueError):
        dropout_factor("cosine", 0.5)
    with pytest.raises(UsageError, match="unknown dropout schedule 'cosine'"):
        TrainConfig(dropout_schedule="cosine")
    with pytest.raises(UsageError, match="--no-compile"):
        TrainConfig(dropout_schedule="linear", compile=True)
    rates = {"dropout": 0.3, "attention dropout": 0.0, "activation dropout": 0.1}
    assert describe_dropout(TrainConfig(), rates) is None
    assert describe_dropout(TrainConfig(dropout_schedule="linear"), rates) == (
        "dropout schedule linear: rates rise from 0 to dropout 0.3, activation dropout "
        "0.1 at the end of the budget")
    assert describe_dropout(TrainConfig(dropout_schedule="linear", dropout_epochs=16), rates) \
        == ("dropout schedule linear: rates rise from 0 to dropout 0.3, activation dropout "
            "0.1 at the end of the budget, if it holds 16 epochs (else in proportion to the "
            "epochs seen)")


def test_inverse_sqrt_keeps_the_progress_it_is_told():
    """The paper's schedule ignores the budget's progress for its lr but keeps it (never
    backwards) and restores it, as --dropout-schedule reads it; a checkpoint without it
    restores 0."""
    param = torch.nn.Parameter(torch.zeros(3))
    cfg = TrainConfig()
    sched = InverseSqrtSchedule(build_optimizer([param], cfg, torch.device("cpu")), 512, 4000)
    sched.step(0.4)
    sched.step(0.3)
    assert sched.progress == 0.4 and sched.lr == inverse_sqrt_lr(3, 512, 4000)
    other = InverseSqrtSchedule(build_optimizer([param], cfg, torch.device("cpu")), 512, 4000)
    other.load_state_dict(sched.state_dict())
    assert other.progress == 0.4
    old = {k: v for k, v in sched.state_dict().items() if k != "progress"}
    other.load_state_dict(old)
    assert other.progress == 0.0 and other.lr == sched.lr
