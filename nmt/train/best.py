"""The best validation score so far and early stopping (`--best-metric`, `--patience`).

Each validation either improves on the best score of `--best-metric` (which direction is
better comes from nmt.config.BEST_METRICS: loss lower, bleu and chrf higher) or counts as
one more validation without improvement; with `--patience N` training stops after N of
those in a row (fairseq's `--patience`, Marian's `--early-stopping`). The tracker's state
is saved in every checkpoint, so a run killed and resumed stops at the same update, with
the same best model, as one never killed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nmt.config import BEST_METRICS


@dataclass
class BestTracker:
    """Best score of `metric`, the update it was reached at, and validations since."""

    metric: str = "loss"
    patience: int = 0  # 0: never stop early
    best: float | None = None
    best_step: int = 0
    stale: int = 0  # validations in a row without improvement

    def observe(self, metrics: dict[str, float], step: int) -> bool:
        """Record a validation; True when it improves on the best so far."""
        score = metrics[self.metric]
        higher = BEST_METRICS[self.metric] == "higher"
        better = self.best is None or (score > self.best if higher else score < self.best)
        if better:
            self.best, self.best_step, self.stale = score, step, 0
        else:
            self.stale += 1
        return better

    @property
    def exhausted(self) -> bool:
        """Patience used up: stop training."""
        return self.patience > 0 and self.stale >= self.patience

    def stop_note(self, step: int, before: bool = False) -> str:
        """What to say when patience runs out at update `step`, or (`before`) ran out in
        the run this one resumes."""
        if before:
            return (f"early stop at update {step} reached before (--patience "
                    f"{self.patience}: best {self.metric} at update {self.best_step}); "
                    "nothing to train")
        return (f"early stop at update {step}: {self.stale} validations without a better "
                f"{self.metric} (best {self.best:.4f} at update {self.best_step}; "
                f"--patience {self.patience})")

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Continue a saved tracker of the same metric (True), or keep this fresh one when
        the saved one tracked another metric (False: the caller says so)."""
        if state.get("metric") != self.metric:
            return False
        self.best = state.get("best")
        self.best_step = int(state.get("best_step", 0))
        self.stale = int(state.get("stale", 0))
        return True
