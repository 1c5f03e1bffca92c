"""bench/race_multi30k.py's fairseq side: the training command each schedule gives fairseq,
checked without fairseq (the race itself needs its venv and half an hour)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def race_fairseq() -> ModuleType:
    """bench/_race_fairseq.py as a module (a script beside the benches, not a package)."""
    spec = importlib.util.spec_from_file_location("_race_fairseq",
                                                  REPO / "bench" / "_race_fairseq.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(cmd: list[str], name: str) -> str:
    """The value after `name` in `cmd` (its last occurrence, as argparse reads it)."""
    at = len(cmd) - 1 - cmd[::-1].index(name)
    return cmd[at + 1]


def test_default_schedule_is_inverse_sqrt_to_its_tuned_peak(race_fairseq):
    cmd = race_fairseq.train_command(Path("bin"), Path("data"), Path("save"), 15.0, 50, [])
    assert _flag(cmd, "--lr-scheduler") == "inverse_sqrt"
    assert float(_flag(cmd, "--lr")) == 1.25e-3
    assert _flag(cmd, "--warmup-updates") == "400"
    assert _flag(cmd, "--warmup-init-lr") == "1e-7"
    assert float(_flag(cmd, "--stop-time-hours")) == pytest.approx(0.25)


def test_linear_schedule_decays_to_zero_at_the_given_update(race_fairseq):
    flags = race_fairseq.schedule_flags("linear", 1.9e-3, 1800)
    cmd = race_fairseq.train_command(Path("bin"), Path("data"), Path("save"), 15.0, 50, [],
                                     flags)
    assert _flag(cmd, "--lr-scheduler") == "polynomial_decay"
    assert _flag(cmd, "--power") == "1" and _flag(cmd, "--end-learning-rate") == "0"
    assert _flag(cmd, "--total-num-update") == "1800"
    assert float(_flag(cmd, "--lr")) == 1.9e-3
    assert "--warmup-init-lr" not in cmd  # polynomial_decay has no such flag: fairseq exits
    assert cmd.count("--lr-scheduler") == 1


def test_linear_schedule_without_its_end_is_refused(race_fairseq):
    with pytest.raises(SystemExit, match="--fairseq-total-updates"):
        race_fairseq.schedule_flags("linear", 1.9e-3, None)
    with pytest.raises(SystemExit, match="unknown fairseq schedule"):
        race_fairseq.schedule_flags("cosine", 1e-3, 100)


def test_race_offers_every_schedule(race_fairseq):
    """The race's --fairseq-schedule choices are the schedules the command knows."""
    text = (REPO / "bench" / "race_multi30k.py").read_text(encoding="utf-8")
    assert "choices=fs.SCHEDULES" in text
    assert set(race_fairseq.SCHEDULES) == {"inverse_sqrt", "linear"}
