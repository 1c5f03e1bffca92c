"""Greedy, beam and sampling search over a step decoder; no file I/O, no printing.

Everything here works on a `StepDecoder`: something that, given the newest token of every row,
returns next-token logits (log-probabilities up to a constant per row: the search normalises
them), and that can reorder its rows. The model adapter (`ModelStepDecoder`,
nmt/inference/decoding.py) encodes the source once and then feeds the incremental decoder;
`EnsembleStepDecoder` averages several step decoders. Tests drive the same search with a
fake decoder whose probabilities are a hand-written table. Imports torch and the special
ids only, and on a CPU the C kernel that ranks a beam search step's candidates
(nmt/inference/step_topk.py; PyTorch's ops elsewhere): the settings (beam, alpha,
lengths) come from the caller, whose defaults live in `nmt.config.DecodeConfig`.

Conventions (documented in `nmt translate --help`):
- A hypothesis is `pieces + [EOS]`; its length |Y| for the length penalty COUNTS the EOS
  (as fairseq does). GNMT penalty lp(Y) = ((5 + |Y|) / 6) ** alpha, score = log P / lp;
  alpha 0 gives the raw log-probability, a larger alpha favours longer output.
- Maximum output length of a sentence = floor(max_len_a * src_len + max_len_b) pieces
  (src_len = its own non-pad source tokens incl. EOS, never the padded batch length),
  capped by what the model's positions allow; at that length EOS is forced.
- Minimum output length `min_len` pieces (1 by default, as fairseq's): EOS is forbidden
  before it, so a non-empty source never gets an empty translation (with alpha 0.6 a weak
  model's lone EOS, log P / 1, can outscore every real sentence, whose penalty divides
  a larger log P by lp > 1). The maximum length wins where the two conflict.
- PAD and BOS are never generated.

Host syncs: on a GPU every read of a device value by the host (`.item()`, `.tolist()`,
`bool(t)`, `nonzero`, `torch.equal`, a copy from the host) waits for all queued work. A
search reads its device state once per step, one small `.tolist()` or `bool`, which it
cannot do without (it must learn which sentences are done), plus a few reads per search
(the length budgets at the start, the results at the end). Everything else it decides on
the host from what it already knows (step number, budgets, which rows are left), and it
tells the decoder the layout of each reorder (`regroup`) so the cache need not read it
back. tests/inference/test_search_syncs.py counts them.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from nmt.inference.step_topk import FREE, NONE, kernel_for, row_topk
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

NEG_INF = float("-inf")
# beam_search compacts the decoder once this fraction of its sentences has finished: each
# compaction copies the caches of the groups that stay, while until then the finished ones
# cost only bookkeeping where the step feeds the live rows alone (a CPU with the attention
# kernel; docs/performance.md).
COMPACT_AT = 0.5


@dataclass(frozen=True)
class Hypothesis:
    """One output: piece ids without EOS, its length-normalised score and raw log-prob."""

    tokens: list[int]
    score: float
    log_prob: float


class StepDecoder(Protocol):
    """Incremental next-token scorer over N rows: the search's only view of a model, every
    method required (`FullStepDecoder` derives the last three for a decoder that can only
    step all its rows and reorder them).

    A step returns logits: log-probabilities up to a constant per row (a decoder that has
    log-probabilities returns them as they are), float32 or the model's float type, in a
    buffer the search may overwrite and the next step may reuse. The search normalises
    them (`normalised`, or fused with the beam's top-k), so a model never writes out a
    (N, V) log-softmax that the search would only rank."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed the newest token of each row, (N,) long -> logits (N, V)."""
        ...

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """Logits (m, V) of rows `rows` (m,) of the `n_rows` held, fed `tokens` (m,);
        the other rows are finished for good (the model skips their matmuls)."""
        ...

    def reorder(self, new_order: Tensor) -> None:
        """Keep rows `new_order` (N',) of the cached state, in that order (may repeat)."""
        ...

    def regroup(self, new_order: Tensor, group_size: int, source: Tensor | None) -> None:
        """`reorder(new_order)` for an order whose layout the caller knows, so the model's
        cache need not read it back (two host syncs a reorder on a GPU): the rows form
        groups (a sentence's rows: one before beam search's expansion, `beam` after), and
        every `group_size` consecutive new rows come from one old group, new group i from
        old group `source[i]` ((groups',) long), or from old group i when `source` is None
        (every group kept, in place)."""
        ...

    def reserve(self, positions: int) -> None:
        """At most `positions` tokens will be fed (the model preallocates its caches)."""
        ...


class FullStepDecoder(ABC):
    """A StepDecoder from `step` and `reorder` alone (scripted tables, wrappers): rows left
    out are fed EOS and their output dropped, a layout is not needed, nothing reserved."""

    @abstractmethod
    def step(self, tokens: Tensor) -> Tensor:
        """Feed the newest token of each row, (N,) long -> logits (N, V)."""

    @abstractmethod
    def reorder(self, new_order: Tensor) -> None:
        """Keep rows `new_order` (N',) of the cached state, in that order (may repeat)."""

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """`step` of all `n_rows` rows (the others fed EOS), rows `rows` (m,) selected."""
        full = tokens.new_full((n_rows,), EOS_ID).index_copy_(0, rows, tokens)  # (n_rows,)
        return self.step(full).index_select(0, rows)  # (m, V)

    def regroup(self, new_order: Tensor, group_size: int, source: Tensor | None) -> None:
        """`reorder`: the layout is not needed."""
        self.reorder(new_order)

    def reserve(self, positions: int) -> None:  # noqa: B027 (a no-op on purpose)
        """Nothing to preallocate."""


class EnsembleStepDecoder:
    """Average of several decoders' distributions: log(mean_m p_m), as fairseq does.

    Averaging probabilities (not log-probabilities) is computed in log space as
    logsumexp_m(log p_m) - log(M), which stays exact and never underflows.
    """

    def __init__(self, decoders: Sequence[StepDecoder]) -> None:
        if not decoders:
            raise ValueError("an ensemble needs at least one decoder")
        self.decoders = list(decoders)

    def step(self, tokens: Tensor) -> Tensor:
        """Log of the mean probability over members, (N,) -> (N, V); one member's logits
        as they are."""
        return self._mean([d.step(tokens) for d in self.decoders])

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """`step` for rows `rows` (m,) only, `tokens` (m,) -> (m, V)."""
        return self._mean([d.step_rows(tokens, rows, n_rows) for d in self.decoders])

    def _mean(self, logits: list[Tensor]) -> Tensor:
        """log(mean of the members' probabilities) of their (rows, V) logits."""
        if len(logits) == 1:
            return logits[0]
        stacked = torch.stack([normalised(x) for x in logits])  # (M, rows, V)
        return torch.logsumexp(stacked, dim=0) - math.log(len(logits))

    def reorder(self, new_order: Tensor) -> None:
        """Reorder every member the same way."""
        for decoder in self.decoders:
            decoder.reorder(new_order)

    def regroup(self, new_order: Tensor, group_size: int, source: Tensor | None) -> None:
        """Reorder every member the same way, telling each the layout."""
        for decoder in self.decoders:
            decoder.regroup(new_order, group_size, source)

    def reserve(self, positions: int) -> None:
        """Pass the length limit on to every member."""
        for decoder in self.decoders:
            decoder.reserve(positions)


def normalised(logits: Tensor) -> Tensor:
    """A step's logits (N, V) as float32 log-probabilities: log_softmax, in place when they
    are float32 already."""
    logits = logits.float()  # a copy only for bf16/fp16 models
    return torch.log_softmax(logits, dim=-1, out=logits)


def length_penalty(length: Tensor | float, alpha: float) -> Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (1 when alpha is 0)."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


@functools.lru_cache(maxsize=32)
def penalty_table(alpha: float, size: int, device: torch.device) -> Tensor:
    """(size,) float32 on `device`: entry n is `length_penalty(n, alpha)`, bit for bit.

    A search divides by it every step: one table on the device spares a host-to-device
    copy (a host sync on a GPU) per step. Built one length at a time on the host, not by
    one vectorised call: torch's vectorised pow can differ from its scalar pow in the last
    bit, and the scores must not change. Cached (never written to), and a normal tensor
    even under inference_mode (see `_later_keys` in nmt/model/attention.py)."""
    with torch.inference_mode(False):
        return torch.stack([length_penalty(n, alpha) for n in range(size)]).to(device)


def _penalties(alpha: float, size: int, device: torch.device) -> Tensor:
    """`penalty_table` with at least `size` entries, from a cache bucketed by powers of
    two so that batches of other lengths share it."""
    return penalty_table(alpha, 1 << max(size - 1, 1).bit_length(), device)


def max_output_lengths(src: Tensor, max_len_a: float, max_len_b: int,
                       cap: int | None = None) -> Tensor:
    """Per-sentence piece budget floor(a * own_len + b) from a padded source batch (B, S)."""
    src_len = (src != PAD_ID).sum(dim=1).to(torch.float32)  # (B,)
    lengths = torch.floor(src_len * max_len_a + max_len_b).to(torch.long)
    lengths = lengths.clamp(min=0)
    return lengths if cap is None else lengths.clamp(max=cap)


def _restrict(log_probs: Tensor, at_max: Tensor | None, ban_eos: bool = False) -> Tensor:
    """Forbid PAD and BOS everywhere, EOS when `ban_eos` (below the minimum length) except
    on rows at their max length, and everything but EOS on rows at their max length.

    log_probs (N, V) float32, modified in place and returned; at_max (N,) bool, or None
    when no row is at its maximum (the common case, known on the host: no (N, V) mask).
    Column views and device-built masks only: no index list or value copied from the host.
    """
    log_probs[:, PAD_ID].fill_(NEG_INF)
    log_probs[:, BOS_ID].fill_(NEG_INF)
    if ban_eos:
        eos = log_probs[:, EOS_ID]  # (N,) view
        if at_max is None:
            eos.fill_(NEG_INF)
        else:
            eos.masked_fill_(~at_max, NEG_INF)
    if at_max is not None:
        not_eos = torch.arange(log_probs.size(-1), device=log_probs.device) != EOS_ID  # (V,)
        log_probs.masked_fill_(at_max.unsqueeze(1) & not_eos.unsqueeze(0), NEG_INF)  # (N, V)
    return log_probs


def _force(log_probs: Tensor, forced: Tensor) -> Tensor:
    """Target prefixes: on rows whose `forced` (N,) token is not PAD, every token but that
    one gets -inf (its own log-prob is kept, so it counts in the score); PAD rows are free.
    log_probs (N, V), modified in place and returned.

    Masks rather than the forced rows' indices (`nonzero`: a host sync per step on a GPU).
    A free row "keeps" its PAD column: it reads that log-prob and writes it back."""
    index = forced.unsqueeze(1)  # (N, 1)
    kept = log_probs.gather(1, index)  # (N, 1) a copy
    log_probs.masked_fill_((forced != PAD_ID).unsqueeze(1), NEG_INF)  # (N, V)
    return log_probs.scatter_(1, index, kept)


def prefix_tensor(prefixes: Sequence[Sequence[int]] | None, device: torch.device
                  ) -> Tensor | None:
    """(B, P) PAD-padded piece ids of per-sentence target prefixes, or None when no
    sentence has one."""
    if not prefixes or not any(prefixes):
        return None
    out = torch.full((len(prefixes), max(map(len, prefixes))), PAD_ID, dtype=torch.long)
    for i, ids in enumerate(prefixes):
        out[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return out.to(device)


EARLY_STOPS = ("bound", "beam")  # beam_search's stopping rules (see there)


def beam_search(decoder: StepDecoder, max_lens: Tensor, *, beam: int, alpha: float,
                nbest: int, min_len: int, prefix: Tensor | None = None,
                early_stop: str = "bound") -> list[list[Hypothesis]]:
    """Batched beam search over B sentences x `beam`; returns up to `nbest` per sentence.

    `decoder` holds B rows on entry (one per sentence); it is expanded to B * beam here.
    Each step ranks 2 * beam candidates so that hypotheses ending in EOS never starve the
    beam: EOS candidates among the top `beam` are finished, the best `beam` others go on.
    A sentence stops at its maximum length, or earlier by `early_stop`:
    - "bound": when its nbest-th finished score is at least the best any alive hypothesis
      could still reach, log P_alive / lp(max length) (tensor2tensor's rule, the paper's
      code; log P only falls and lp only rises): the search's own best, found for sure;
    - "beam": once `beam` hypotheses have finished (fairseq's, CTranslate2's and Marian's
      rule): fewer steps, and a longer hypothesis that would have scored better is missed.
    Finished sentences leave the batch. If nothing finished (all EOS scores -inf) the best
    alive hypothesis is returned. EOS is forbidden before `min_len` pieces (unless a
    sentence's maximum is lower).
    `prefix` (B, P), PAD-padded piece ids: each sentence's output starts with its prefix
    (teacher-forced, its log-probs counted in the score; see `prefix_tensor`); a sentence's
    `max_lens` must leave room for it.
    """
    if beam < 1 or nbest < 1 or nbest > beam:
        raise ValueError(f"need 1 <= nbest ({nbest}) <= beam ({beam})")
    if early_stop not in EARLY_STOPS:
        raise ValueError(f"early_stop must be one of {EARLY_STOPS}, got {early_stop!r}")
    n_sent = max_lens.numel()
    if n_sent == 0:
        return []
    budgets = max_lens.tolist()  # the one host read before the steps
    width = max(budgets) + 2  # BOS + pieces + EOS
    decoder.reserve(width)
    # The decoder keeps one row per sentence for step 0 (all beams hold the same BOS
    # prefix, so it is computed once) and is expanded to B * beam by step 0's reorder.
    beams = _Beams.start(max_lens, budgets, beam, nbest, width, alpha, prefix,
                         count_finished=early_stop == "beam")
    out = _Finished.empty(n_sent, nbest, width, max_lens.device)
    for t in range(width - 1):
        cand = _best_candidates(*beams.next_candidates(decoder, t, min_len), beams.scores)
        beams.finish(cand, t)
        keep_beam = beams.extend(cand, t)
        beams.reorder_decoder(decoder, keep_beam, t)
        if beams.retire(decoder, out, t, alpha):  # the one host read of a step
            return out.to_hypotheses(alpha)
    if beams.active.numel():
        out.store(beams.active, beams.fin, beams.fallback)
    return out.to_hypotheses(alpha)


@dataclass
class _Candidates:
    """The best 2 * beam continuations of each sentence, best first, each (rows, 2 * beam)."""

    score: Tensor  # cumulative log P
    parent: Tensor  # the beam each extends
    token: Tensor  # the token it appends
    is_eos: Tensor  # token == EOS


def _best_candidates(row_top: Tensor, row_tok: Tensor, scores: Tensor) -> _Candidates:
    """Rank the continuations of beams scored `scores` (rows, beam) from each beam's best
    k tokens `row_tok` and their log-probs `row_top` (rows, beam, k), k >= 2 * beam or V.

    The best 2*beam of a sentence's beam*V candidates are among the best 2*beam of
    each row (a row's cumulative score shifts all its candidates equally), so the rows are
    ranked first (`_step_topk`) and the beam scores added to those few only: no
    (rows, beam*V) pass.
    """
    n_rows, beam, k = row_top.shape
    cand = (scores.unsqueeze(-1) + row_top).view(n_rows, beam * k)  # (rows, beam*k)
    top_scores, top_idx = cand.topk(min(2 * beam, beam * k), dim=1)  # (rows, 2beam)
    src_beam = torch.div(top_idx, k, rounding_mode="floor")
    top_tok = row_tok.reshape(n_rows, beam * k).gather(1, top_idx)  # (rows, 2beam)
    return _Candidates(top_scores, src_beam, top_tok, top_tok == EOS_ID)


def _step_topk(logits: Tensor, k: int, at_max: Tensor | None, forced: Tensor | None,
               ban_eos: bool) -> tuple[Tensor, Tensor]:
    """The best k allowed tokens of each row of a step's logits (N, V) and their
    log-probabilities, (N, k) each, best first: `_restrict` and `_force`'s rules (at_max,
    forced (N,) or None), normalised over the whole vocabulary. One C call on a CPU
    (nmt/inference/step_topk.py), else log_softmax, the rules' fills and `_row_topk`."""
    lib = kernel_for(logits, k)
    if lib is not None:  # `only` is built only where it is used (not on a GPU)
        return row_topk(lib, logits, k, ban_eos=ban_eos, only=_pinned(at_max, forced, ban_eos))
    log_probs = _restrict(normalised(logits), at_max, ban_eos)
    if forced is not None:
        log_probs = _force(log_probs, forced)
    return _row_topk(log_probs, k)


def _pinned(at_max: Tensor | None, forced: Tensor | None, ban_eos: bool) -> Tensor | None:
    """`row_topk`'s `only` (N,) for rows at their maximum length (`at_max`: EOS
    alone) and rows with a forced prefix piece (`forced`, PAD = free: that piece alone),
    or None when there are neither. A forced piece the rules ban (BOS; EOS below the
    minimum length or another piece at the maximum) leaves the row nothing, as
    `_restrict` then `_force` do. Device ops only."""
    if at_max is None and forced is None:
        return None
    like = at_max if at_max is not None else forced
    assert like is not None
    only = torch.full(like.shape, FREE, dtype=torch.long, device=like.device)
    if forced is not None:
        banned = forced == BOS_ID
        if ban_eos:
            banned |= forced == EOS_ID
        only = torch.where(forced != PAD_ID, forced.masked_fill(banned, NONE), only)
    if at_max is not None:
        eos = torch.full_like(only, EOS_ID)
        if forced is not None:
            eos = eos.masked_fill((forced != PAD_ID) & (forced != EOS_ID), NONE)
        only = torch.where(at_max, eos, only)
    return only


@dataclass
class _Beams:
    """The state of one beam search over the sentences still in the batch (its rows), with
    one method per part of a step.

    Finished sentences stay in the decoder (as dead groups of `beam` rows it skips) until
    a fraction COMPACT_AT of its groups is dead: then one compaction copies the caches,
    instead of one copy of every cache each step some sentence finishes.
    """

    beam: int
    tokens: Tensor  # (rows, beam, width): BOS, pieces, then PAD
    scores: Tensor  # (rows, beam) alive cumulative log P, -inf where none
    fin: _Finished  # (rows, nbest) best finished hypotheses
    fallback: _Finished  # (rows, 1) best alive so far
    active: Tensor  # (rows,) original index of each row's sentence
    lens: Tensor  # (rows,) maximum output lengths
    lens_host: list[int]  # the same on the host
    penalty: Tensor  # (width,) length_penalty(n, alpha) of n = 0..width-1, on the device
    slots: Tensor  # (beam,) arange
    n_groups: int  # sentence groups the decoder holds, dead ones included
    prefix: Tensor | None = None  # (sentences, P) forced first pieces, PAD = free
    group: Tensor | None = None  # (rows,) decoder group of each row; None: row i is group i
    live: Tensor | None = None  # (rows * beam,) decoder rows fed this step (when grouped)
    finished: Tensor | None = None  # (rows,) hypotheses finished so far (early_stop "beam")

    @classmethod
    def start(cls, max_lens: Tensor, budgets: list[int], beam: int, nbest: int, width: int,
              alpha: float, prefix: Tensor | None = None, count_finished: bool = False
              ) -> _Beams:
        """Every sentence at BOS, only its first beam alive (all beams are identical);
        `budgets` is `max_lens` read to the host; `count_finished`: a sentence stops once
        `beam` hypotheses have finished (see `beam_search`)."""
        device, n_sent = max_lens.device, max_lens.numel()
        tokens = torch.full((n_sent, beam, width), PAD_ID, dtype=torch.long, device=device)
        tokens[:, :, 0] = BOS_ID
        scores = torch.full((n_sent, beam), NEG_INF, device=device)
        scores[:, 0] = 0.0  # all beams start identical: expand only the first at step 0
        return cls(beam, tokens, scores, _Finished.empty(n_sent, nbest, width, device),
                   _Finished.empty(n_sent, 1, width, device),
                   torch.arange(n_sent, device=device), max_lens.clone(), list(budgets),
                   _penalties(alpha, width, device), torch.arange(beam, device=device),
                   n_sent, prefix,
                   finished=(torch.zeros(n_sent, dtype=torch.long, device=device)
                             if count_finished else None))

    def next_candidates(self, decoder: StepDecoder, t: int, min_len: int
                        ) -> tuple[Tensor, Tensor]:
        """Feed step t's tokens; each beam's best k = 2 * beam allowed next tokens and
        their log-probs, (rows, beam, k) each (see `_step_topk`)."""
        beam, n_rows = self.beam, self.active.numel()
        if t == 0:
            logits = decoder.step(self.tokens[:, 0, 0])  # (rows, V): one row per sentence
        elif self.group is None:
            logits = decoder.step(self.tokens[:, :, t].reshape(-1))  # (rows * beam, V)
        else:
            self.live = (self.group.unsqueeze(1) * beam + self.slots).view(-1)  # (rows*beam,)
            logits = decoder.step_rows(self.tokens[:, :, t].reshape(-1), self.live,
                                       self.n_groups * beam)  # (rows * beam, V)
        fed = 1 if t == 0 else beam  # rows per sentence in `logits`
        at_max = (self.lens == t) if t in self.lens_host else None  # (rows,)
        forced = None
        if self.prefix is not None and t < self.prefix.size(1):
            forced = self.prefix[self.active, t]  # (rows,)
        if fed > 1:
            at_max = None if at_max is None else at_max.repeat_interleave(fed)  # (rows*beam,)
            forced = None if forced is None else forced.repeat_interleave(fed)
        k = min(2 * beam, logits.size(-1))
        values, tokens = _step_topk(logits, k, at_max, forced, t < min_len)  # (rows*fed, k)
        if fed == 1:  # every beam's state is the BOS one
            values = values.repeat_interleave(beam, dim=0)  # (rows * beam, k)
            tokens = tokens.repeat_interleave(beam, dim=0)
        return values.view(n_rows, beam, k), tokens.view(n_rows, beam, k)

    def finish(self, cand: _Candidates, t: int) -> None:
        """Finish the EOS candidates ranked within the top `beam` (|Y| = t pieces + EOS)."""
        beam = self.beam
        fin_ok = cand.is_eos[:, :beam] & torch.isfinite(cand.score[:, :beam])  # (rows, beam)
        new_tokens = _gather_rows(self.tokens, cand.parent[:, :beam])  # (rows, beam, width)
        new_tokens[:, :, t + 1] = EOS_ID
        new_logp = cand.score[:, :beam].masked_fill(~fin_ok, NEG_INF)
        new_score = new_logp / self.penalty[t + 1]  # a 0-dim view: nothing leaves the device
        self.fin = self.fin.merge(new_tokens, new_score, new_logp)
        if self.finished is not None:
            self.finished += fin_ok.sum(dim=1)

    def extend(self, cand: _Candidates, t: int) -> Tensor:
        """The best `beam` non-EOS candidates stay alive; returns the beam (rows, beam) each
        of them extends."""
        self.scores, pick = cand.score.masked_fill(cand.is_eos, NEG_INF).topk(
            self.beam, dim=1)  # (rows, beam)
        keep_beam = cand.parent.gather(1, pick)  # (rows, beam)
        self.tokens = _gather_rows(self.tokens, keep_beam)
        self.tokens[:, :, t + 1] = cand.token.gather(1, pick)
        return keep_beam

    def reorder_decoder(self, decoder: StepDecoder, keep_beam: Tensor, t: int) -> None:
        """Give the decoder's rows the order of the beams that went on. Every sentence's
        rows stay its group, in place (`regroup`: the cache need not find that out)."""
        beam, n_rows, device = self.beam, self.active.numel(), keep_beam.device
        if t == 0:  # expand B -> B * beam: every beam's state is the BOS one
            order = torch.arange(n_rows, device=device).repeat_interleave(beam)  # (rows*beam,)
        elif self.group is None:
            row_base = torch.arange(n_rows, device=device).unsqueeze(1) * beam  # (rows, 1)
            order = (row_base + keep_beam).view(-1)  # (rows * beam,)
        else:  # dead groups keep their rows in place
            assert self.live is not None
            order = torch.arange(self.n_groups * beam, device=device)  # (groups * beam,)
            order[self.live] = (self.group.unsqueeze(1) * beam + keep_beam).view(-1)
        decoder.regroup(order, beam, None)

    def retire(self, decoder: StepDecoder, out: _Finished, t: int, alpha: float) -> bool:
        """Store the sentences that are done into `out` and drop them from the batch
        (compacting the decoder when enough are gone); True when none is left.

        Reads one (rows,) bool to the host, the step's one host sync; the rows to store
        and to keep are then found on the device with their counts known
        (`nonzero_static`: `nonzero` would read its count back, a sync each)."""
        alive_ok = torch.isfinite(self.scores[:, :1])  # (rows, 1)
        self.fallback = self.fallback.where(~alive_ok, self.tokens[:, :1], self.scores[:, :1],
                                            self.scores[:, :1])
        # Computed on the device each step, not looked up in `penalty`: a vectorised pow
        # over the rows, as ever, so the bounds stay the same to the last bit.
        bound = self.scores[:, 0] / length_penalty(self.lens + 1, alpha)  # (rows,)
        enough = (self.fin.score[:, -1] >= bound if self.finished is None
                  else self.finished >= self.beam)  # (rows,) early_stop's rule
        done = enough | ~alive_ok.squeeze(1) | (self.lens <= t)
        done_host: list[bool] = done.tolist()  # the one host sync per step
        n_done = sum(done_host)
        if not n_done:
            return False
        idx = torch.nonzero_static(done, size=n_done).squeeze(1)  # (n_done,)
        out.store(self.active[idx], self.fin.select(idx), self.fallback.select(idx))
        n_keep = len(done_host) - n_done
        if not n_keep:
            return True
        keep = torch.nonzero_static(~done, size=n_keep).squeeze(1)  # (n_keep,)
        self.active, self.lens, self.scores = self.active[keep], self.lens[keep], self.scores[keep]
        self.lens_host = [n for n, gone in zip(self.lens_host, done_host, strict=True)
                          if not gone]
        self.tokens, self.fin = self.tokens[keep], self.fin.select(keep)
        if self.finished is not None:
            self.finished = self.finished[keep]
        self.fallback = self.fallback.select(keep)
        self.group = keep if self.group is None else self.group[keep]  # (kept,)
        if n_keep <= (1.0 - COMPACT_AT) * self.n_groups:  # compact: drop dead groups
            decoder.regroup((self.group.unsqueeze(1) * self.beam + self.slots).view(-1),
                            self.beam, self.group)  # (kept * beam,)
            self.n_groups, self.group = n_keep, None  # rows above
        return False


TOPK_CHUNK = 64  # _row_topk's block size


def _row_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`x.topk(k, dim=-1)` for a wide last dim, in two cheap passes instead of one heap pass.

    Every one of the top k entries lies in a block (of TOPK_CHUNK entries) whose maximum is
    at least the k-th largest value, and at most k blocks have such a maximum (each is
    itself one of the top k), so the top k of the k best blocks by maximum (plus the tail
    that fills no block) are the top k of the row. Values are exact; only the order of
    exactly tied entries may differ from torch.topk.
    """
    vocab = x.size(-1)
    blocks = vocab // TOPK_CHUNK
    if blocks < 4 * k:  # narrow rows: the plain heap is as cheap
        return x.topk(k, dim=-1)
    whole = blocks * TOPK_CHUNK
    block_max = x[..., :whole].unflatten(-1, (blocks, TOPK_CHUNK)).amax(dim=-1)  # (..., blocks)
    best = block_max.topk(k, dim=-1).indices  # (..., k)
    offsets = torch.arange(TOPK_CHUNK, device=x.device)
    index = (best.unsqueeze(-1) * TOPK_CHUNK + offsets).flatten(-2)  # (..., k * chunk)
    if whole < vocab:
        tail = torch.arange(whole, vocab, device=x.device).expand(*x.shape[:-1], -1)
        index = torch.cat([index, tail], dim=-1)  # (..., k * chunk + tail)
    values, pos = x.gather(-1, index).topk(k, dim=-1)  # (..., k)
    return values, index.gather(-1, pos)


def _gather_rows(tokens: Tensor, beam_idx: Tensor) -> Tensor:
    """tokens (rows, beam, width) indexed by beam_idx (rows, k) -> (rows, k, width)."""
    index = beam_idx.unsqueeze(-1).expand(-1, -1, tokens.size(-1))  # (rows, k, width)
    return tokens.gather(1, index)


@dataclass
class _Finished:
    """Up to k finished hypotheses per row, best first: tokens (rows, k, width), scores."""

    tokens: Tensor
    score: Tensor  # (rows, k) length-normalised, -inf where empty
    log_prob: Tensor  # (rows, k)

    @classmethod
    def empty(cls, rows: int, k: int, width: int, device: torch.device) -> _Finished:
        return cls(torch.full((rows, k, width), PAD_ID, dtype=torch.long, device=device),
                   torch.full((rows, k), NEG_INF, device=device),
                   torch.full((rows, k), NEG_INF, device=device))

    def merge(self, tokens: Tensor, score: Tensor, log_prob: Tensor) -> _Finished:
        """Keep the best k of the current and the new (rows, m) hypotheses."""
        all_score = torch.cat([self.score, score], dim=1)  # (rows, k + m)
        best, idx = all_score.topk(self.score.size(1), dim=1)  # (rows, k)
        all_tokens = torch.cat([self.tokens, tokens], dim=1)  # (rows, k + m, width)
        all_logp = torch.cat([self.log_prob, log_prob], dim=1)
        return _Finished(_gather_rows(all_tokens, idx), best, all_logp.gather(1, idx))

    def where(self, cond: Tensor, tokens: Tensor, score: Tensor, log_prob: Tensor) -> _Finished:
        """Rows where cond (rows, 1) is True keep self, the others take the new values."""
        return _Finished(torch.where(cond.unsqueeze(-1), self.tokens, tokens),
                         torch.where(cond, self.score, score),
                         torch.where(cond, self.log_prob, log_prob))

    def select(self, rows: Tensor) -> _Finished:
        return _Finished(self.tokens[rows], self.score[rows], self.log_prob[rows])

    def store(self, rows: Tensor, fin: _Finished, fallback: _Finished) -> None:
        """Write results of original sentences `rows`; fall back to the best alive one."""
        none = ~torch.isfinite(fin.score[:, :1])  # (n, 1): nothing finished
        tokens = fin.tokens.clone()
        tokens[:, :1] = torch.where(none.unsqueeze(-1), fallback.tokens, fin.tokens[:, :1])
        log_prob = fin.log_prob.clone()
        log_prob[:, :1] = torch.where(none, fallback.log_prob, fin.log_prob[:, :1])
        width = self.tokens.size(-1)
        self.tokens[rows] = tokens[:, :, :width]
        self.score[rows] = fin.score.masked_fill(none & (fin.score == NEG_INF), float("nan"))
        self.log_prob[rows] = log_prob

    def to_hypotheses(self, alpha: float) -> list[list[Hypothesis]]:
        """Move to the host (two reads: the tokens, both scores stacked) and cut each row
        at its EOS."""
        tokens = self.tokens.tolist()
        score, log_prob = torch.stack([self.score, self.log_prob]).tolist()
        results: list[list[Hypothesis]] = []
        for row_tok, row_score, row_logp in zip(tokens, score, log_prob, strict=True):
            hyps = []
            for seq, sc, lp in zip(row_tok, row_score, row_logp, strict=True):
                if lp == NEG_INF:
                    continue
                pieces = _cut(seq[1:])
                if math.isnan(sc):  # fallback (never finished): normalise by its own length
                    sc = lp / float(length_penalty(len(pieces), alpha))
                hyps.append(Hypothesis(pieces, sc, lp))
            results.append(hyps)
        return results


def _cut(ids: list[int]) -> list[int]:
    """Piece ids up to (excluding) the first EOS or PAD."""
    out = []
    for i in ids:
        if i in (EOS_ID, PAD_ID):
            break
        out.append(i)
    return out


def greedy_decode(decoder: StepDecoder, max_lens: Tensor, *, alpha: float, min_len: int,
                  prefix: Tensor | None = None) -> list[Hypothesis]:
    """Pick the most probable token at each step until EOS or the maximum length; `alpha`
    only normalises the reported scores; `prefix` as for `beam_search`."""
    return _sample_like(decoder, max_lens, alpha, lambda lp: lp.argmax(dim=-1), min_len,
                        prefix)


def sample_decode(decoder: StepDecoder, max_lens: Tensor, *, temperature: float, top_k: int,
                  top_p: float, alpha: float, min_len: int,
                  generator: torch.Generator | None = None, prefix: Tensor | None = None
                  ) -> list[Hypothesis]:
    """Sample each token from the temperature-scaled, top-k / top-p filtered distribution
    (`generator` None: torch's global one); `prefix` (rows, P) as for `beam_search`.

    The reported log-prob is the model's own (unscaled, unfiltered) one. NaN log-probs (a
    broken model) raise ValueError, found at the end (one more host read per search).
    """
    nan_seen = torch.zeros((), dtype=torch.bool, device=max_lens.device)

    def choose(log_probs: Tensor) -> Tensor:
        filtered = filter_log_probs(log_probs / temperature, top_k, top_p)
        probs = torch.softmax(filtered, dim=-1)  # (N, V); a row with a NaN is all NaN
        chosen = sample_one(probs, generator)  # (N,)
        nan_seen.logical_or_(probs.gather(1, chosen.unsqueeze(1)).isnan().any())
        return chosen

    hyps = _sample_like(decoder, max_lens, alpha, choose, min_len, prefix)
    if nan_seen.item():
        raise ValueError("sampling met a distribution with NaN probabilities")
    return hyps


def sample_one(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of `probs` (N, V), drawn with probability probs[i] (rows sum to 1):
    `torch.multinomial(probs, 1, generator=generator).squeeze(1)`, the very same draw.

    That is torch's own algorithm for one sample (argmax of p / q, q ~ Exp(1), the same
    random numbers from the same generator), without the validity checks it makes first:
    they read two values back to the host, two syncs a step on a GPU. Our distributions
    are softmaxes, valid unless NaN, which `sample_decode` checks once at the end.
    tests/inference/test_search_syncs.py holds it equal to torch.multinomial."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)  # (N, V)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)  # (N,)


def filter_log_probs(log_probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf all but the top_k tokens and the smallest set with mass >= top_p.

    log_probs (N, V); top_k 0 and top_p 1.0 disable the filters. The best token survives.
    """
    out = log_probs
    if 0 < top_k < out.size(-1):
        kth = out.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
        out = out.masked_fill(out < kth, NEG_INF)
    if top_p < 1.0:
        sorted_lp, order = out.sort(dim=-1, descending=True)  # (N, V)
        probs = torch.softmax(sorted_lp, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, NEG_INF)
    return out


def _sample_like(decoder: StepDecoder, max_lens: Tensor, alpha: float,
                 choose: Callable[[Tensor], Tensor], min_len: int,
                 prefix: Tensor | None = None) -> list[Hypothesis]:
    """Shared loop of greedy and sampling: one token per row per step, no beam."""
    device = max_lens.device
    rows = max_lens.numel()
    if rows == 0:
        return []
    budgets = set(max_lens.tolist())  # the one host read before the steps
    width = max(budgets) + 1
    out = torch.full((rows, width), PAD_ID, dtype=torch.long, device=device)
    log_prob = torch.zeros(rows, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    last = torch.full((rows,), BOS_ID, dtype=torch.long, device=device)
    for t in range(width):
        at_max = (max_lens == t) if t in budgets else None
        log_probs = _restrict(normalised(decoder.step(last)), at_max, t < min_len)  # (rows, V)
        if prefix is not None and t < prefix.size(1):
            log_probs = _force(log_probs, prefix[:, t])
        chosen = choose(log_probs)  # (rows,)
        step_lp = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        chosen = chosen.masked_fill(finished, EOS_ID)
        log_prob += step_lp.masked_fill(finished, 0.0)
        out[:, t] = chosen.masked_fill(finished, PAD_ID)
        finished |= chosen == EOS_ID
        last = chosen
        if bool(finished.all()):  # the one host sync per step
            break
    hyps = []
    for seq, lp in zip(out.tolist(), log_prob.tolist(), strict=True):
        pieces = _cut(seq)
        length = len(pieces) + 1  # |Y| counts EOS
        hyps.append(Hypothesis(pieces, lp / float(length_penalty(length, alpha)), lp))
    return hyps
