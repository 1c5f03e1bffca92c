"""The probability mass a vocabulary shortlist leaves out, estimated per row, so that a
shortlist's log-probabilities are normalised over (about) the whole vocabulary.

A shortlist scores only its candidate pieces; normalising over them alone raises every
log-probability by -log(1 - m), where m is the mass of the pieces left out. m is not small
or constant (a model trained with label smoothing spreads about a tenth of its mass over
the whole vocabulary), so hypotheses with different histories get different shifts and
the beam ranks them differently from the full-vocabulary search.

The estimate: for the n left-out rows w_j of the output matrix, log sum_j exp(h . w_j) ~
log n + h . mu + s/2 with s = sum_i h_i^2 var_i (the second-order cumulant expansion with
the rows' covariance taken diagonal), where mu and var are the left-out rows'
per-dimension mean and variance, found per batch from whole-vocabulary sums minus the
candidates' rows; where s > 2 log n a few of the largest logits dominate the sum and
h . mu + sqrt(2 log n s) replaces it (the random energy model's frozen phase). It costs a
(rows, 2 d_model) dot per step. The estimate goes into the PAD column, which every
search counts in the normaliser and never picks (docs/performance.md, "Measurements
behind the code").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nmt.special_ids import PAD_ID


class VocabularyMoments:
    """Per-dimension sums of the output matrix's rows and of their squares (float64), kept
    once per model so each batch's left-out moments cost only its candidates' rows."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight.detach()  # (V, d_model): the candidates' rows come from it
        w = self.weight.double()
        self.sum = w.sum(0)  # (d_model,)
        self.sum_sq = (w * w).sum(0)  # (d_model,)

    def rest(self, columns: Tensor) -> RestMass | None:
        """The estimator for a shortlist of `columns` (V',) row ids; None where the
        shortlist leaves nothing out."""
        left_out = self.weight.size(0) - columns.numel()
        if left_out <= 0:
            return None
        rows = self.weight.index_select(0, columns).double()  # (V', d_model)
        mean = (self.sum - rows.sum(0)) / left_out  # (d_model,)
        var = ((self.sum_sq - (rows * rows).sum(0)) / left_out - mean * mean).clamp_(min=0)
        return RestMass(mean.float(), (0.5 * var).float(), math.log(left_out))


class RestMass:
    """log of the left-out mass for rows of decoder features (see the module doc)."""

    def __init__(self, mean: Tensor, half_var: Tensor, log_count: float) -> None:
        self.mean, self.half_var, self.log_count = mean, half_var, log_count

    def log_mass(self, features: Tensor) -> Tensor:
        """(rows, d_model) features -> (rows,) float32 log of the estimated left-out mass
        (unnormalised, on the logits' scale)."""
        h = features.float()
        mean = torch.mv(h, self.mean)  # (rows,) mean left-out logit
        half_var = torch.mv(h * h, self.half_var)  # (rows,) half their variance
        # log n + var/2 while var <= 2 log n, else sqrt(2 log n var), the smaller: the
        # largest logits dominate the sum (the random energy model's two phases; the two
        # meet at the boundary)
        spread = torch.where(half_var <= self.log_count, half_var + self.log_count,
                             (4 * self.log_count * half_var).sqrt())
        return mean.add_(spread)

    def fold_into(self, logits: Tensor, features: Tensor) -> Tensor:
        """Add the left-out mass to the PAD column of `logits` (rows, V') in place, so a
        normaliser over the columns counts it; returns `logits`."""
        pad = logits[:, PAD_ID]  # (rows,) a view
        pad.copy_(torch.logaddexp(pad.float(), self.log_mass(features)))
        return logits

