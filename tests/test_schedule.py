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
    with pytest.raises(UsageError, match="unknown lr schedule 'cosine'"):
        TrainConfig(lr_schedule="cosine")
    assert BEST_METRICS == {"loss": "lower", "bleu": "higher", "chrf": "higher"}
    for metric, direction in BEST_METRICS.items():
        tracker = BestTracker(metric)
        assert tracker.observe({metric: 10.0}, 1)
        assert tracker.observe({metric: 9.0 if direction == "lower" else 11.0}, 2)
        assert not tracker.observe({metric: 12.0 if direction == "lower" else 8.0}, 3)
        assert (tracker.best_step, tracker.stale) == (2, 1)
