"""Budgeted schedules in real `nmt train` runs: a time budget's learning rate follows the
clock and reaches its final value at the budget's end within one update, also when the run
is killed with SIGKILL and resumed (the budget counts training time saved in the
checkpoint, so a resumed run ends where an uninterrupted one would)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
from helpers.data import MODEL_FLAGS, multi30k_data
from test_faults_train import _run_and_kill

from nmt.checkpoint import load_checkpoint
from nmt.train.log import read_jsonl
from nmt.train.schedule import budget_factor

BUDGET_MINUTES = 0.12  # 7.2 s of training: ~100-300 tiny updates on one thread
WARMUP = 10
LR_SCALE = 2.0
FLAGS = ["--max-tokens", "512", "--warmup", str(WARMUP), "--lr-scale", str(LR_SCALE),
         "--seed", "7", "--log-interval", "1", "--valid-interval", "100000",
         "--save-interval-minutes", "0", "--save-interval-updates", "5", "--keep-last", "2",
         "--max-minutes", str(BUDGET_MINUTES)]


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> Path:
    """300 real Multi30k pairs (+20 valid), joint BPE 400."""
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=300, n_valid=20,
                         vocab_size=400)


def _updates(run: Path) -> list[dict]:
    """The train records of the run's log, one per update: where a killed run's updates
    after its last save were done again, the resumed run's record."""
    by_step = {r["step"]: r for r in read_jsonl(run / "train_log.jsonl")
               if r.get("kind") == "train"}
    return [by_step[step] for step in sorted(by_step)]


def _check_follows_the_clock(records: list[dict], shape: str) -> None:
    """Every update's lr is the schedule's formula at the progress the previous update
    left, that progress is the elapsed share of the budget, and the last update's lr is
    within one update of the final value (0)."""
    budget = BUDGET_MINUTES
    peak = LR_SCALE * 64 ** -0.5 * WARMUP ** -0.5  # tiny: d_model 64
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert len(records) > 3 * WARMUP, f"too few updates in the budget: {len(records)}"
    warm_progress = records[WARMUP - 1]["progress"]
    for before, record in itertools.pairwise(records):
        k = record["step"]
        if k <= WARMUP:
            assert math.isclose(record["lr"], peak * k / WARMUP, rel_tol=1e-9)
            continue
        q = (before["progress"] - warm_progress) / (1 - warm_progress)
        assert math.isclose(record["lr"], peak * budget_factor(shape, q, 0.0),
                            rel_tol=1e-6, abs_tol=1e-12), record
    for before, record in itertools.pairwise(records):
        # the clock never restarts (a resumed run goes on from its saved training time)
        assert record["elapsed_minutes"] >= before["elapsed_minutes"], record
        # update k is launched after update k-1 was logged and logged after its launch
        assert min(before["elapsed_minutes"] / budget, 1.0) - 1e-6 <= record["progress"] \
            <= record["elapsed_minutes"] / budget + 1e-6, record
    last, one_update = records[-1], max(
        b["elapsed_minutes"] - a["elapsed_minutes"] for a, b in itertools.pairwise(records))
    assert last["elapsed_minutes"] >= budget
    assert last["progress"] == 1.0
    # the last update's lr was set from the progress one update before the end
    assert records[-2]["progress"] >= 1 - 2 * one_update / budget, (records[-2], one_update)
    assert last["lr"] <= peak * 2 * one_update / budget / (1 - warm_progress) + 1e-12
    assert last["lr"] < records[len(records) // 2]["lr"] / 4


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_time_budget_decays_to_its_end(m30k, tmp_path, one_thread, nmt_cli, shape):
    run = tmp_path / "run"
    result = nmt_cli.run("train", str(m30k), "-o", str(run), *MODEL_FLAGS, *FLAGS,
                         "--lr-schedule", shape)
    assert result.returncode == 0, result.err
    assert (f"lr schedule {shape}: warm-up {WARMUP} updates to " in result.err
            and f"at the end of the budget ({BUDGET_MINUTES:g} minutes or 100000 updates, "
            "whichever comes first)" in result.err), result.err
    _check_follows_the_clock(_updates(run), shape)


def test_a_spent_time_budget_makes_no_update(m30k, tmp_path, one_thread, nmt_cli):
    """The same command again after a time budget ran out (what re-running `make demo`
    does) makes no update and writes nothing: no checkpoint that `nmt average --last N`
    would take in place of an older one, no log record; it says why and exits 0. In this
    process, with a budget of 0.6 s: the fast loop's test of the module."""
    run = tmp_path / "run"
    args = ["train", str(m30k), "-o", str(run), *MODEL_FLAGS, *FLAGS, "--lr-schedule",
            "linear", "--max-minutes", "0.01"]
    first = nmt_cli.invoke(*args)
    assert first.returncode == 0, first.err
    files = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
    again = nmt_cli.invoke(*args)
    assert again.returncode == 0, again.err
    assert "the budget of 0.01 minutes is spent" in again.err, again.err
    last = _updates(run)[-1]["step"]
    assert f"stopped at update {last} " in again.err, again.err
    after = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
    assert after.keys() == files.keys()
    changed = [name for name in files if files[name] != after[name]]
    assert changed == [], changed
    assert _updates(run)[-1]["step"] == last


def _check_dropout_follows(records: list[dict], rate: float, full_epochs: float = 0.0
                           ) -> None:
    """--dropout-schedule linear: the first update ran without dropout and every later
    one at `rate` times the progress the update before it left, up to `rate` at the end;
    with --dropout-epochs `full_epochs`, at `rate` times the smaller of that progress and
    the epochs seen by then / `full_epochs`."""
    assert records[0]["dropout"] == 0.0
    for before, record in itertools.pairwise(records):
        share = before["progress"]
        if full_epochs:
            share = min(share, before["epochs"] / full_epochs)
        assert math.isclose(record["dropout"], rate * share, rel_tol=1e-9,
                            abs_tol=1e-12), (before, record)
    if not full_epochs:
        assert records[-1]["dropout"] >= rate * (1 - 0.1)
        return
    # the epochs held the rate down: fewer epochs seen than `full_epochs`
    seen = records[-1]["epochs"]
    assert 1.0 < seen < full_epochs, seen
    assert records[-1]["dropout"] <= rate * seen / full_epochs + 1e-12


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
def test_dropout_rises_with_the_epochs_seen(m30k, tmp_path, one_thread, nmt_cli):
    """--dropout-epochs: where the budget holds fewer epochs than it names, the rising
    dropout follows the epochs seen instead of the budget's progress, and ends below the
    set rate in proportion; the start-up line says so."""
    run = tmp_path / "run"
    result = nmt_cli.run("train", str(m30k), "-o", str(run), *MODEL_FLAGS, *FLAGS,
                         "--lr-schedule", "linear", "--dropout", "0.3",
                         "--dropout-schedule", "linear", "--dropout-epochs", "200")
    assert result.returncode == 0, result.err
    assert ("dropout schedule linear: rates rise from 0 to dropout 0.3 at the end of the "
            "budget, if it holds 200 epochs (else in proportion to the epochs seen)"
            in result.err), result.err
    _check_dropout_follows(_updates(run), 0.3, full_epochs=200)


@pytest.mark.slow
@pytest.mark.parametrize("full_epochs", [0, 200])
def test_time_budget_survives_kill_9_and_resume(m30k, tmp_path, one_thread, nmt_cli,
                                                full_epochs):
    """Killed after its first saves and resumed twice: the log of the updates that count
    follows the clock of the whole budget, and the training time saved in the checkpoint
    carries over (the resumed run does not start the budget again). The run's dropout
    rises with the same progress (--dropout-schedule linear), or with the epochs seen
    where --dropout-epochs holds it lower, across the kills too."""
    run = tmp_path / "run"
    args = ["train", str(m30k), "-o", str(run), *MODEL_FLAGS, *FLAGS, "--lr-schedule",
            "linear", "--dropout", "0.3", "--dropout-schedule", "linear",
            "--dropout-epochs", str(full_epochs)]
    rng = random.Random(5)
    saved_progress = []
    for attempt in range(2):
        killed, stderr = _run_and_kill(nmt_cli, args, tmp_path / f"stderr_{attempt}.txt", rng,
                                       at_start=False)
        assert killed, stderr
        payload = load_checkpoint(run / "checkpoint_last.pt")
        saved_progress.append(payload["scheduler"]["progress"])
        assert 0 < payload["elapsed_seconds"] < BUDGET_MINUTES * 60
    assert saved_progress[0] <= saved_progress[1] < 1.0
    final = nmt_cli.run(*args)
    assert final.returncode == 0, final.err
    assert "resuming from update" in final.err
    assert "dropout schedule linear: rates rise from 0 to dropout 0.3 at the end of the " \
        "budget" in final.err
    _check_follows_the_clock(_updates(run), "linear")
    _check_dropout_follows(_updates(run), 0.3, full_epochs)
    assert load_checkpoint(run / "checkpoint_last.pt")["model_config"]["dropout"] == 0.3
