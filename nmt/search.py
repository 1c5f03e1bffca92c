"""Greedy, beam and sampling search over a step decoder; no file I/O, no printing.

Everything here works on a `StepDecoder`: something that, given the newest token of every
row, returns next-token log-probabilities, and that can reorder its rows. The model adapter
(`ModelStepDecoder`) encodes the source once and then feeds the incremental decoder (key/value
cache); `EnsembleStepDecoder` averages several of them. Tests drive the same search with a
fake decoder whose probabilities are a hand-written table.

Conventions (documented in `nmt translate --help`):
- A hypothesis is `pieces + [EOS]`; its length |Y| for the length penalty COUNTS the EOS
  (as fairseq does). GNMT penalty lp(Y) = ((5 + |Y|) / 6) ** alpha, score = log P / lp;
  alpha 0 gives the raw log-probability, a larger alpha favours longer output.
- Maximum output length of a sentence = floor(max_len_a * src_len + max_len_b) pieces
  (src_len = its own non-pad source tokens incl. EOS, never the padded batch length),
  capped by what the model's positions allow; at that length EOS is forced.
- Minimum output length `min_len` pieces (default 1, as fairseq's): EOS is forbidden
  before it, so a non-empty source never gets an empty translation (with alpha 0.6 a weak
  model's lone EOS, log P / 1, can outscore every real sentence, whose penalty divides
  a larger log P by lp > 1). The maximum length wins where the two conflict.
- PAD and BOS are never generated.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from nmt.vocab import BOS_ID, EOS_ID, PAD_ID

NEG_INF = float("-inf")
# beam_search compacts the decoder once this fraction of its sentences has finished.
COMPACT_AT = 0.25


@dataclass(frozen=True)
class Hypothesis:
    """One output: piece ids without EOS, its length-normalised score and raw log-prob."""

    tokens: list[int]
    score: float
    log_prob: float


class StepDecoder(Protocol):
    """Incremental next-token scorer over N rows (the search's only view of a model)."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed the newest token of each row, (N,) long -> log-probs (N, V) float32."""
        ...

    def reorder(self, new_order: Tensor) -> None:
        """Keep rows `new_order` (N',) of the cached state, in that order (may repeat)."""
        ...


# Per model: (key/value cache buffers, logits buffer) left by its last ModelStepDecoder.
_POOLS: weakref.WeakKeyDictionary[Any, tuple[list[Tensor], Tensor | None]] = (
    weakref.WeakKeyDictionary())


class ModelStepDecoder:
    """StepDecoder over a `Transformer`: encodes once, then decodes one token at a time.

    The log-probabilities a step returns live in a buffer that the next step overwrites
    (one (rows, V) allocation per search instead of two per step, each big enough to be
    page-faulted in afresh): use them before the next `step`, or copy them. On CPU, when
    the decoder is garbage-collected its logits buffer and key/value cache memory go to a
    per-model pool that the next ModelStepDecoder of the same model takes over (a search
    per batch thus maps that memory once; two live decoders never share it).
    """

    def __init__(self, model: Any, src: Tensor) -> None:
        self.model = model
        self.state = model.init_state(model.encode(src))
        self._pool = _POOLS.pop(model, None) if src.device.type == "cpu" else None
        self._buffer: Tensor | None = None if self._pool is None else self._pool[1]

    def step(self, tokens: Tensor) -> Tensor:
        """Next-token log-probabilities in float32 whatever the model's precision."""
        return self._log_softmax(self.model.decode_step(tokens, self.state,
                                                        out=self._out(tokens.numel())))

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """Like `step` for rows `rows` (m,) of the `n_rows` only, `tokens` (m,) -> log-probs
        (m, V); the other rows are finished for good (see `Transformer.decode_step`)."""
        return self._log_softmax(self.model.decode_step(tokens, self.state, live=rows,
                                                        out=self._out(tokens.numel())))

    def reserve(self, positions: int) -> None:
        """Preallocate the key/value caches for `positions` target tokens (in pooled
        memory when a previous decoder left some)."""
        buffers, self._pool = (None if self._pool is None else self._pool[0]), None
        self.model.reserve_cache(self.state, positions, buffers)

    def __del__(self) -> None:
        """Leave the cache and logits memory to the model's next decoder (CPU only)."""
        state = getattr(self, "state", None)
        if state is None or state.consumed or state.padding_mask.device.type != "cpu":
            return
        buffers = self.model.release_cache(state)
        if self._pool is not None:  # never reserved: keep what it was lent
            buffers = buffers + self._pool[0]
        _POOLS[self.model] = (buffers, self._buffer)

    def _out(self, rows: int) -> Tensor | None:
        """The reused logits buffer, grown to at least `rows` rows (model dtype); None when
        the model's output projection is packed (it allocates its own output)."""
        if getattr(self.model, "output_projection", None) is not None:
            return None
        weight = self.model.output_weight
        if (self._buffer is None or self._buffer.size(0) < rows
                or self._buffer.dtype != weight.dtype):
            self._buffer = weight.new_empty(rows, weight.size(0))  # (rows, V)
        return self._buffer

    @staticmethod
    def _log_softmax(logits: Tensor) -> Tensor:
        """log_softmax over the vocabulary in float32, in place when already float32."""
        logits = logits.float()  # (N, V); a copy only for bf16/fp16 models
        return torch.log_softmax(logits, dim=-1, out=logits)

    def reorder(self, new_order: Tensor) -> None:
        """Select/duplicate rows of the key/value cache and the encoder mask."""
        self.state = self.model.reorder_cache(self.state, new_order)


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
        """Log of the mean probability over members, (N,) -> (N, V)."""
        if len(self.decoders) == 1:
            return self.decoders[0].step(tokens)
        stacked = torch.stack([d.step(tokens) for d in self.decoders])  # (M, N, V)
        return torch.logsumexp(stacked, dim=0) - math.log(len(self.decoders))

    def step_rows(self, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """`step` for rows `rows` (m,) only, `tokens` (m,) -> (m, V) (see `step_rows`)."""
        if len(self.decoders) == 1:
            return step_rows(self.decoders[0], tokens, rows, n_rows)
        stacked = torch.stack([step_rows(d, tokens, rows, n_rows)
                               for d in self.decoders])  # (M, m, V)
        return torch.logsumexp(stacked, dim=0) - math.log(len(self.decoders))

    def reorder(self, new_order: Tensor) -> None:
        """Reorder every member the same way."""
        for decoder in self.decoders:
            decoder.reorder(new_order)


def step_rows(decoder: StepDecoder, tokens: Tensor, rows: Tensor, n_rows: int) -> Tensor:
    """Log-probs (m, V) of rows `rows` (m,) of a decoder holding `n_rows` rows, fed
    `tokens` (m,); its other rows are finished for good and their output unused.

    Uses the decoder's own `step_rows` when it has one (the model skips those rows'
    matmuls); any other StepDecoder steps all its rows (the others fed EOS) and the
    wanted ones are selected.
    """
    own = getattr(decoder, "step_rows", None)
    if own is not None:
        return own(tokens, rows, n_rows)
    full = tokens.new_full((n_rows,), EOS_ID).index_copy_(0, rows, tokens)  # (n_rows,)
    return decoder.step(full).index_select(0, rows)  # (m, V)


def _reserve(decoder: StepDecoder, positions: int) -> None:
    """Tell a decoder (or an ensemble's members) that at most `positions` tokens will be
    fed, when it can use that (ModelStepDecoder preallocates its caches)."""
    members = decoder.decoders if isinstance(decoder, EnsembleStepDecoder) else [decoder]
    for member in members:
        reserve = getattr(member, "reserve", None)
        if reserve is not None:
            reserve(positions)


def length_penalty(length: Tensor | float, alpha: float) -> Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (1 when alpha is 0)."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


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
    """
    log_probs[:, [PAD_ID, BOS_ID]] = NEG_INF
    if ban_eos:
        eos = log_probs[:, EOS_ID]  # (N,) view
        if at_max is None:
            eos.fill_(NEG_INF)
        else:
            eos.masked_fill_(~at_max, NEG_INF)
    if at_max is not None:
        not_eos = torch.ones(log_probs.size(-1), dtype=torch.bool, device=log_probs.device)
        not_eos[EOS_ID] = False
        log_probs.masked_fill_(at_max.unsqueeze(1) & not_eos.unsqueeze(0), NEG_INF)  # (N, V)
    return log_probs


def beam_search(decoder: StepDecoder, max_lens: Tensor, beam: int = 4, alpha: float = 0.6,
                nbest: int = 1, min_len: int = 1) -> list[list[Hypothesis]]:
    """Batched beam search over B sentences x `beam`; returns up to `nbest` per sentence.

    `decoder` holds B rows on entry (one per sentence); it is expanded to B * beam here.
    Each step ranks 2 * beam candidates so that hypotheses ending in EOS never starve the
    beam: EOS candidates among the top `beam` are finished, the best `beam` others go on.
    A sentence stops when its nbest-th finished score is at least the best any alive
    hypothesis could still reach, log P_alive / lp(max length) (tensor2tensor's rule; log P
    only falls and lp only rises), or at its maximum length. Finished sentences leave the
    batch. If nothing finished (all EOS scores -inf) the best alive hypothesis is returned.
    EOS is forbidden before `min_len` pieces (unless a sentence's maximum is lower).
    """
    if beam < 1 or nbest < 1 or nbest > beam:
        raise ValueError(f"need 1 <= nbest ({nbest}) <= beam ({beam})")
    device = max_lens.device
    n_sent = max_lens.numel()
    if n_sent == 0:
        return []
    width = int(max_lens.max().item()) + 2  # BOS + pieces + EOS
    _reserve(decoder, width)
    # The decoder keeps one row per sentence for step 0 (all beams hold the same BOS
    # prefix, so it is computed once) and is expanded to B * beam by step 0's reorder.

    tokens = torch.full((n_sent, beam, width), PAD_ID, dtype=torch.long, device=device)
    tokens[:, :, 0] = BOS_ID
    scores = torch.full((n_sent, beam), NEG_INF, device=device)  # alive cumulative log P
    scores[:, 0] = 0.0  # all beams start identical: expand only the first at step 0
    fin = _Finished.empty(n_sent, nbest, width, device)
    fallback = _Finished.empty(n_sent, 1, width, device)  # best alive so far
    out = _Finished.empty(n_sent, nbest, width, device)
    active = torch.arange(n_sent, device=device)  # original index of each current row
    lens = max_lens.clone()
    lens_host = set(max_lens.tolist())  # budgets of the rows still in the batch
    # Finished sentences stay in the decoder (as dead groups of `beam` rows it skips) until
    # a fraction COMPACT_AT of its groups is dead: then one compaction copies the caches,
    # instead of one copy of every cache each step some sentence finishes.
    n_groups = n_sent  # sentence groups the decoder holds, dead ones included
    group = None  # (rows,) decoder group of each current row; None: row i is group i
    slots = torch.arange(beam, device=device)  # (beam,)

    for t in range(width - 1):
        n_rows = active.numel()
        if t == 0:
            log_probs = decoder.step(tokens[:, 0, 0])  # (rows, V): one row per sentence
            log_probs = log_probs.repeat_interleave(beam, dim=0)  # (rows * beam, V)
        elif group is None:
            log_probs = decoder.step(tokens[:, :, t].reshape(-1))  # (rows * beam, V)
        else:
            live = (group.unsqueeze(1) * beam + slots).view(-1)  # (rows * beam,)
            log_probs = step_rows(decoder, tokens[:, :, t].reshape(-1), live,
                                  n_groups * beam)  # (rows * beam, V)
        vocab = log_probs.size(-1)
        at_max = (lens == t).repeat_interleave(beam) if t in lens_host else None  # (rows*beam,)
        log_probs = _restrict(log_probs, at_max, t < min_len).view(n_rows, beam, vocab)
        # The best 2*beam of a sentence's beam*V candidates are among the best 2*beam of
        # each row (a row's cumulative score shifts all its candidates equally), so rank
        # per row first and add the beam scores to those few only: no (rows, beam*V) pass.
        k = min(2 * beam, vocab)
        row_top, row_tok = _row_topk(log_probs, k)  # (rows, beam, k)
        cand = (scores.unsqueeze(-1) + row_top).view(n_rows, beam * k)  # (rows, beam*k)
        top_scores, top_idx = cand.topk(min(2 * beam, beam * k), dim=1)  # (rows, 2beam)
        src_beam = torch.div(top_idx, k, rounding_mode="floor")
        top_tok = row_tok.view(n_rows, beam * k).gather(1, top_idx)  # (rows, 2beam)
        is_eos = top_tok == EOS_ID

        # Finish EOS candidates ranked within the top `beam` (|Y| = t pieces + EOS).
        fin_ok = is_eos[:, :beam] & torch.isfinite(top_scores[:, :beam])  # (rows, beam)
        new_tokens = _gather_rows(tokens, src_beam[:, :beam])  # (rows, beam, width)
        new_tokens[:, :, t + 1] = EOS_ID
        new_logp = top_scores[:, :beam].masked_fill(~fin_ok, NEG_INF)
        new_score = new_logp / length_penalty(t + 1, alpha).to(device)
        fin = fin.merge(new_tokens, new_score, new_logp)

        # The best `beam` non-EOS candidates stay alive.
        scores, pick = top_scores.masked_fill(is_eos, NEG_INF).topk(beam, dim=1)  # (rows, beam)
        keep_beam = src_beam.gather(1, pick)  # (rows, beam)
        tokens = _gather_rows(tokens, keep_beam)
        tokens[:, :, t + 1] = top_tok.gather(1, pick)
        if t == 0:  # expand B -> B * beam: every beam's state is the BOS one
            decoder.reorder(torch.arange(n_rows, device=device).repeat_interleave(beam))
        elif group is None:
            row_base = torch.arange(n_rows, device=device).unsqueeze(1) * beam  # (rows, 1)
            decoder.reorder((row_base + keep_beam).view(-1))  # (rows * beam,)
        else:  # dead groups keep their rows in place
            order = torch.arange(n_groups * beam, device=device)  # (groups * beam,)
            order[live] = (group.unsqueeze(1) * beam + keep_beam).view(-1)
            decoder.reorder(order)
        alive_ok = torch.isfinite(scores[:, :1])  # (rows, 1)
        fallback = fallback.where(~alive_ok, tokens[:, :1], scores[:, :1], scores[:, :1])

        bound = scores[:, 0] / length_penalty(lens + 1, alpha)  # (rows,)
        done = (fin.score[:, -1] >= bound) | ~alive_ok.squeeze(1) | (lens <= t)
        if bool(done.any()):  # the one host sync per step
            idx = done.nonzero().squeeze(1)
            out.store(active[idx], fin.select(idx), fallback.select(idx))
            if bool(done.all()):
                return out.to_hypotheses(alpha)
            keep = (~done).nonzero().squeeze(1)
            active, lens, scores = active[keep], lens[keep], scores[keep]
            lens_host = set(lens.tolist())
            tokens, fin, fallback = tokens[keep], fin.select(keep), fallback.select(keep)
            group = keep if group is None else group[keep]  # (kept,)
            if keep.numel() <= (1.0 - COMPACT_AT) * n_groups:  # compact: drop dead groups
                decoder.reorder((group.unsqueeze(1) * beam + slots).view(-1))  # (kept * beam,)
                n_groups, group = keep.numel(), None
    if active.numel():
        out.store(active, fin, fallback)
    return out.to_hypotheses(alpha)


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
        """Move to the host once and cut each row at its EOS."""
        tokens, score, log_prob = (self.tokens.cpu().tolist(), self.score.cpu().tolist(),
                                   self.log_prob.cpu().tolist())
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


def greedy_decode(decoder: StepDecoder, max_lens: Tensor, alpha: float = 0.0,
                  min_len: int = 1) -> list[Hypothesis]:
    """Pick the most probable token at each step until EOS or the maximum length."""
    return _sample_like(decoder, max_lens, alpha, lambda lp: lp.argmax(dim=-1), min_len)


def sample_decode(decoder: StepDecoder, max_lens: Tensor, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, alpha: float = 0.0,
                  generator: torch.Generator | None = None, min_len: int = 1
                  ) -> list[Hypothesis]:
    """Sample each token from the temperature-scaled, top-k / top-p filtered distribution.

    The reported log-prob is the model's own (unscaled, unfiltered) one.
    """

    def choose(log_probs: Tensor) -> Tensor:
        filtered = filter_log_probs(log_probs / temperature, top_k, top_p)
        probs = torch.softmax(filtered, dim=-1)  # (N, V)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return _sample_like(decoder, max_lens, alpha, choose, min_len)


def filter_log_probs(log_probs: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
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
                 choose: Any, min_len: int) -> list[Hypothesis]:
    """Shared loop of greedy and sampling: one token per row per step, no beam."""
    device = max_lens.device
    rows = max_lens.numel()
    if rows == 0:
        return []
    width = int(max_lens.max().item()) + 1
    out = torch.full((rows, width), PAD_ID, dtype=torch.long, device=device)
    log_prob = torch.zeros(rows, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    last = torch.full((rows,), BOS_ID, dtype=torch.long, device=device)
    budgets = set(max_lens.tolist())
    for t in range(width):
        at_max = (max_lens == t) if t in budgets else None
        log_probs = _restrict(decoder.step(last), at_max, t < min_len)  # (rows, V)
        chosen = choose(log_probs)  # (rows,)
        step_lp = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        chosen = chosen.masked_fill(finished, EOS_ID)
        log_prob += step_lp.masked_fill(finished, 0.0)
        out[:, t] = chosen.masked_fill(finished, PAD_ID)
        finished |= chosen == EOS_ID
        last = chosen
        if bool(finished.all()):
            break
    hyps = []
    for seq, lp in zip(out.cpu().tolist(), log_prob.cpu().tolist(), strict=True):
        pieces = _cut(seq)
        length = len(pieces) + 1  # |Y| counts EOS
        hyps.append(Hypothesis(pieces, lp / float(length_penalty(length, alpha)), lp))
    return hyps


@torch.no_grad()
def greedy_search(model: Any, src: Tensor, max_len_a: float = 1.0, max_len_b: int = 50
                  ) -> list[list[int]]:
    """Greedy piece ids (without EOS) for a padded source batch (B, S); for validation BLEU.

    The caller puts the model in eval mode (dropout off) and back; gradients are off here.
    """
    cap = model.cfg.max_positions - 1
    max_lens = max_output_lengths(src, max_len_a, max_len_b, cap)
    hyps = greedy_decode(ModelStepDecoder(model, src), max_lens)
    return [h.tokens for h in hyps]
