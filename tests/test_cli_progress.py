"""The CLI's rich reporter: drives the library's Reporter protocol, silent off a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from nmt.cli.progress import RichReporter


def test_rich_reporter_draws_nothing_into_a_pipe():
    sink = io.StringIO()
    with RichReporter(Console(file=sink, force_terminal=False)) as reporter:
        reporter.start("download x.tgz", 100)
        reporter.advance(60)
        reporter.done()
        reporter.advance(5)  # after done: ignored, no error
    assert sink.getvalue() == ""


def _record(step: int) -> dict:
    return {"step": step, "epoch": 1, "loss": 5.0, "ppl": 150.0, "lr": 1e-3,
            "tokens_per_s": 1234.0, "elapsed_minutes": 0.1}


def test_time_left_is_whichever_limit_ends_first():
    from nmt.train.log import time_left

    assert time_left(150, 0, 0, 0.0, 0.0, 0.0) is None  # no rate yet, no budget
    assert time_left(150, 0, 10, 0.0, 0.0, 20.0) == 280.0  # 140 updates at 2 s each
    assert time_left(150, 0, 10, 100.0, 0.0, 20.0) == 80.0  # --max-minutes ends first
    assert time_left(150, 100, 110, 0.0, 600.0, 610.0) == 40.0  # resumed: rate since 100
    assert time_left(150, 0, 0, 60.0, 0.0, 5.0) == 55.0  # budget alone, before a rate


def test_training_bar_moves_every_update_and_shows_time_left():
    """On a terminal the bar advances at every update (not only at log lines) and its
    time column counts down (it stayed at -:--:-- before)."""
    from nmt.cli.progress import RichTrainProgress

    sink = io.StringIO()
    progress = RichTrainProgress(Console(file=sink, force_terminal=True, width=150))
    progress.start(150, 0, 0.0, 0.0)
    for step in range(1, 8):
        progress._last = 0.0  # let every update redraw
        progress.advance(step, step * 2.0)
    out = sink.getvalue()
    assert "update 7/150" in out and "0:04:46 left" in out  # 143 updates x 2 s
    progress.update(_record(7))
    progress.message("saved x.pt")
    progress.close()
    assert "loss 5.000" in sink.getvalue() and "saved x.pt" in sink.getvalue()


def test_training_progress_off_a_terminal_is_plain_lines():
    from nmt.cli.progress import RichTrainProgress

    sink = io.StringIO()
    progress = RichTrainProgress(Console(file=sink, force_terminal=False))
    progress.start(150, 0, 0.0, 0.0)
    progress.advance(1, 1.0)
    progress.update(_record(50))
    progress.message("valid at update 50: loss 4.0")
    progress.close()
    assert sink.getvalue().splitlines() == [
        "update 50 | epoch 1 | loss 5.000 | ppl 150.00 | lr 0.001 | tok/s 1234 | 0.1 min",
        "valid at update 50: loss 4.0"]
    assert "\x1b" not in sink.getvalue()
