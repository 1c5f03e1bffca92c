"""Search on a fake step decoder with hand-written probabilities (the same invariants on a
real model: tests/inference/test_decoding.py)."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
import torch

from nmt.config import DecodeConfig
from nmt.inference.search import (
    EnsembleStepDecoder,
    FullStepDecoder,
    Hypothesis,
    beam_search,
    filter_log_probs,
    greedy_decode,
    length_penalty,
    max_output_lengths,
    sample_decode,
)
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

pytestmark = pytest.mark.usefixtures("one_thread")

A, B = 4, 5  # two real pieces after the specials 0..3
VOCAB = 6
DEFAULTS = DecodeConfig()  # what `nmt translate` passes when a flag is not given


def run_beam(decoder, max_lens: torch.Tensor, **settings) -> list[list[Hypothesis]]:
    """beam_search with DecodeConfig's defaults for the settings a test leaves out."""
    return beam_search(decoder, max_lens, **{"beam": DEFAULTS.beam, "alpha": DEFAULTS.alpha,
                                             "nbest": DEFAULTS.nbest,
                                             "min_len": DEFAULTS.min_len, **settings})


def run_greedy(decoder, max_lens: torch.Tensor, **settings) -> list[Hypothesis]:
    """greedy_decode with alpha 0 (raw log-probs) and DecodeConfig's min_len by default."""
    return greedy_decode(decoder, max_lens, **{"alpha": 0.0, "min_len": DEFAULTS.min_len,
                                               **settings})


def run_sampling(decoder, max_lens: torch.Tensor, **settings) -> list[Hypothesis]:
    """sample_decode with DecodeConfig's defaults for the settings a test leaves out."""
    return sample_decode(decoder, max_lens, **{
        "temperature": DEFAULTS.temperature, "top_k": DEFAULTS.top_k, "top_p": DEFAULTS.top_p,
        "alpha": 0.0, "min_len": DEFAULTS.min_len, **settings})


class TableDecoder(FullStepDecoder):
    """Fake StepDecoder: p(next | sentence, prefix) from a function; tracks each row's
    prefix and reorders it exactly as a model's cache would be reordered."""

    def __init__(self, dist, sentences: int = 1) -> None:
        self.dist = dist  # (sentence id, prefix tuple) -> {token: prob}
        self.sent = list(range(sentences))
        self.prefix: list[tuple[int, ...]] = [() for _ in range(sentences)]
        self.calls = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert tokens.shape == (len(self.prefix),)
        rows = []
        for i, tok in enumerate(tokens.tolist()):
            if tok != BOS_ID:
                self.prefix[i] = self.prefix[i] + (tok,)
            probs = torch.zeros(VOCAB, dtype=torch.float64)
            for k, v in self.dist(self.sent[i], self.prefix[i]).items():
                probs[k] = v
            rows.append(probs.log().float())
        return torch.stack(rows)  # (N, V)

    def reorder(self, new_order: torch.Tensor) -> None:
        order = new_order.tolist()
        self.sent = [self.sent[i] for i in order]
        self.prefix = [self.prefix[i] for i in order]


# Hand-written table (token -> probability); unspecified prefixes use DEFAULT.
TABLE = {
    (): {A: 0.5, B: 0.4, EOS_ID: 0.1},
    (A,): {EOS_ID: 0.7, A: 0.2, B: 0.1},
    (B,): {A: 0.9, EOS_ID: 0.05, B: 0.05},
    (B, A): {EOS_ID: 0.9, A: 0.05, B: 0.05},
}
DEFAULT = {EOS_ID: 0.7, A: 0.2, B: 0.1}


def table(_sent: int, prefix: tuple[int, ...]) -> dict[int, float]:
    return TABLE.get(prefix, DEFAULT)


def lp(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


def test_table_alpha0_prefers_short_hypothesis() -> None:
    # By hand, beam 2: step 0 keeps A (.5), B (.4); EOS (.1) ranks 3rd, not finished.
    # Step 1: B A .36, A EOS .35 (finished), A A .10 -> alive B A, A A. .36 > .35 go on.
    # Step 2: B A EOS = .4*.9*.9 = .324 finishes, but A EOS = .35 is still best; the best
    # alive (B A A, .018) cannot beat it: stop.
    hyps = run_beam(TableDecoder(table), torch.tensor([3]), beam=2, alpha=0.0, nbest=2)
    assert [h.tokens for h in hyps[0]] == [[A], [B, A]]
    assert hyps[0][0].score == pytest.approx(math.log(0.5 * 0.7), abs=1e-6)
    assert hyps[0][1].score == pytest.approx(math.log(0.4 * 0.9 * 0.9), abs=1e-6)


def test_table_alpha06_prefers_longer_hypothesis() -> None:
    # |Y| counts EOS: "A EOS" has |Y| = 2, "B A EOS" |Y| = 3.
    short = math.log(0.35) / lp(2, 0.6)  # -0.957
    long = math.log(0.324) / lp(3, 0.6)  # -0.948: wins with alpha 0.6
    hyps = run_beam(TableDecoder(table), torch.tensor([3]), beam=2, alpha=0.6, nbest=2)
    assert [h.tokens for h in hyps[0]] == [[B, A], [A]]
    assert hyps[0][0].score == pytest.approx(long, abs=1e-6)
    assert hyps[0][1].score == pytest.approx(short, abs=1e-6)
    assert hyps[0][0].log_prob == pytest.approx(math.log(0.324), abs=1e-6)


def test_early_termination_stops_before_max_length() -> None:
    dec = TableDecoder(table)
    run_beam(dec, torch.tensor([40]), beam=2, alpha=0.0)
    assert dec.calls == 3  # steps 0, 1, 2 as in the hand trace, not 41


def test_max_length_forces_eos() -> None:
    always_a = lambda _s, _p: {A: 0.99, EOS_ID: 0.01}  # noqa: E731
    hyps = run_beam(TableDecoder(always_a), torch.tensor([5]), beam=2, alpha=1.0)
    assert hyps[0][0].tokens == [A] * 5
    expected = (5 * math.log(0.99) + math.log(0.01)) / lp(6, 1.0)
    assert hyps[0][0].score == pytest.approx(expected, abs=1e-5)
    greedy = run_greedy(TableDecoder(always_a), torch.tensor([5]))
    assert greedy[0].tokens == [A] * 5


def test_zero_budget_gives_empty_output() -> None:
    hyps = run_beam(TableDecoder(table), torch.tensor([0]), beam=2, alpha=0.6)
    assert hyps[0][0].tokens == []
    assert hyps[0][0].log_prob == pytest.approx(math.log(0.1), abs=1e-6)


# EOS is the most likely first token: a lone EOS (|Y| = 1, lp = 1) scores log 0.9 = -0.105,
# "A EOS" log(0.1 * 0.5) / lp(2) = -2.43 at alpha 0.6.
EOS_FIRST = {(): {EOS_ID: 0.9, A: 0.1}, (A,): {EOS_ID: 0.5, A: 0.3, B: 0.2}}


def eos_first(_sent: int, prefix: tuple[int, ...]) -> dict[int, float]:
    return EOS_FIRST.get(prefix, DEFAULT)


def test_min_len_forbids_the_empty_translation() -> None:
    empty = run_beam(TableDecoder(eos_first), torch.tensor([5]), beam=2, alpha=0.6,
                        min_len=0)
    assert empty[0][0].tokens == []
    assert empty[0][0].score == pytest.approx(math.log(0.9), abs=1e-6)
    hyps = run_beam(TableDecoder(eos_first), torch.tensor([5]), beam=2, alpha=0.6)
    assert hyps[0][0].tokens == [A]  # DecodeConfig's min_len is 1
    assert hyps[0][0].score == pytest.approx(math.log(0.1 * 0.5) / lp(2, 0.6), abs=1e-6)
    assert run_greedy(TableDecoder(eos_first), torch.tensor([5]), min_len=0)[0].tokens == []
    assert run_greedy(TableDecoder(eos_first), torch.tensor([5]))[0].tokens == [A]
    sampled = run_sampling(TableDecoder(eos_first, 50), torch.full((50,), 5),
                            generator=torch.Generator().manual_seed(0))
    assert all(h.tokens for h in sampled)


def test_min_len_counts_pieces_and_yields_to_max_len() -> None:
    hyps = run_beam(TableDecoder(eos_first), torch.tensor([5]), beam=2, alpha=0.0,
                       min_len=3)
    assert all(len(h.tokens) >= 3 for h in hyps[0])
    # A budget below min_len: EOS is forced at the budget as always.
    short = run_beam(TableDecoder(eos_first), torch.tensor([1]), beam=2, alpha=0.0,
                        min_len=3, nbest=2)
    assert sorted(h.tokens for h in short[0]) == [[A]]
    assert run_greedy(TableDecoder(eos_first), torch.tensor([2]), min_len=3)[0].tokens \
        == [A, A]
    zero = run_beam(TableDecoder(eos_first), torch.tensor([0]), beam=2, alpha=0.6)
    assert zero[0][0].tokens == []


def test_nothing_finished_returns_best_alive() -> None:
    never_eos = lambda _s, _p: {A: 0.6, B: 0.4}  # noqa: E731  EOS has probability 0
    hyps = run_beam(TableDecoder(never_eos), torch.tensor([3]), beam=2, alpha=0.0)
    assert hyps[0][0].tokens == [A, A, A]
    assert hyps[0][0].log_prob == pytest.approx(3 * math.log(0.6), abs=1e-6)


def random_table(seed: int):
    """A deterministic pseudo-random distribution over {UNK, EOS, A, B} per prefix."""

    def dist(sent: int, prefix: tuple[int, ...]) -> dict[int, float]:
        key = hashlib.sha256(repr((seed, sent, prefix)).encode()).digest()
        rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        probs = rng.dirichlet([0.5] * 4)
        return dict(zip((UNK_ID, EOS_ID, A, B), probs.tolist(), strict=True))

    return dist


def exhaustive_best(dist, sent: int, max_len: int, alpha: float,
                    min_len: int = 0) -> tuple[list[int], float]:
    """Score every sequence of min_len..max_len pieces + EOS; return the best."""
    best: tuple[list[int], float] = ([], -math.inf)
    for n in range(min(min_len, max_len), max_len + 1):
        for seq in itertools.product((UNK_ID, A, B), repeat=n):
            logp = 0.0
            for i in range(n + 1):
                p = dist(sent, tuple(seq[:i])).get(seq[i] if i < n else EOS_ID, 0.0)
                logp += math.log(p) if p > 0 else -math.inf
            # float32 rounding differs by ~1e-6: only strictly better candidates replace.
            score = logp / lp(n + 1, alpha)
            if score > best[1] + 1e-5:
                best = (list(seq), score)
    return best


@pytest.mark.parametrize("min_len", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
@pytest.mark.parametrize("seed", range(4))
def test_wide_beam_finds_exhaustive_optimum(seed: int, alpha: float, min_len: int) -> None:
    max_len = 3
    beam = 3**max_len  # >= |pieces|^L: nothing is ever pruned
    dist = random_table(seed)
    hyps = run_beam(TableDecoder(dist), torch.tensor([max_len]), beam=beam, alpha=alpha,
                       min_len=min_len)
    tokens, score = exhaustive_best(dist, 0, max_len, alpha, min_len)
    assert len(tokens) >= min_len
    assert hyps[0][0].tokens == tokens
    assert hyps[0][0].score == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_beam1_equals_greedy_at_alpha0(seed: int) -> None:
    dist = random_table(seed)
    max_lens = torch.tensor([6, 2, 9, 4])
    beam = run_beam(TableDecoder(dist, 4), max_lens, beam=1, alpha=0.0)
    greedy = run_greedy(TableDecoder(dist, 4), max_lens)
    for b_hyps, g in zip(beam, greedy, strict=True):
        assert b_hyps[0].tokens == g.tokens
        assert b_hyps[0].log_prob == pytest.approx(g.log_prob, abs=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_batch_equals_one_by_one(seed: int) -> None:
    """Sentences with different budgets finish at different steps and leave the batch."""
    dist = random_table(seed)
    max_lens = torch.tensor([1, 7, 3, 5, 0])
    batch = run_beam(TableDecoder(dist, 5), max_lens, beam=3, alpha=0.6, nbest=3)
    for i, budget in enumerate(max_lens.tolist()):
        alone = run_beam(TableDecoder(lambda _s, p, i=i: dist(i, p)),
                            torch.tensor([budget]), beam=3, alpha=0.6, nbest=3)
        assert [h.tokens for h in batch[i]] == [h.tokens for h in alone[0]]
        for x, y in zip(batch[i], alone[0], strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-6)


def test_ensemble_averages_probabilities() -> None:
    one = lambda _s, _p: {A: 0.8, EOS_ID: 0.2}  # noqa: E731
    two = lambda _s, _p: {A: 0.2, B: 0.4, EOS_ID: 0.4}  # noqa: E731
    ens = EnsembleStepDecoder([TableDecoder(one), TableDecoder(two)])
    out = ens.step(torch.tensor([BOS_ID])).exp()[0]
    assert out[A].item() == pytest.approx(0.5)
    assert out[B].item() == pytest.approx(0.2)
    assert out[EOS_ID].item() == pytest.approx(0.3)
    ens.reorder(torch.tensor([0, 0]))
    assert all(len(d.prefix) == 2 for d in ens.decoders)


def test_filter_log_probs_top_k_and_top_p() -> None:
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(filter_log_probs(logp, top_k=2, top_p=1.0)).tolist()
    assert kept == [[True, True, False, False]]
    kept = torch.isfinite(filter_log_probs(logp, top_k=0, top_p=0.8)).tolist()  # .5+.3 = .8
    assert kept == [[True, True, False, False]]
    kept = torch.isfinite(filter_log_probs(logp, top_k=0, top_p=0.81)).tolist()
    assert kept == [[True, True, True, False]]
    kept = torch.isfinite(filter_log_probs(logp, top_k=0, top_p=0.1)).tolist()  # best is kept
    assert kept == [[True, False, False, False]]


def test_sampling_follows_the_distribution_and_seed() -> None:
    dist = lambda _s, _p: {A: 0.7, EOS_ID: 0.3}  # noqa: E731
    max_lens = torch.full((2000,), 1)
    gen = torch.Generator().manual_seed(0)
    hyps = run_sampling(TableDecoder(dist, 2000), max_lens, generator=gen, min_len=0)
    share_a = sum(h.tokens == [A] for h in hyps) / len(hyps)
    assert share_a == pytest.approx(0.7, abs=0.04)
    again = run_sampling(TableDecoder(dist, 2000), max_lens,
                          generator=torch.Generator().manual_seed(0), min_len=0)
    assert [h.tokens for h in again] == [h.tokens for h in hyps]
    # top-k 1 makes sampling greedy.
    top1 = run_sampling(TableDecoder(dist, 50), torch.full((50,), 1), top_k=1)
    assert all(h.tokens == [A] for h in top1)


def test_length_helpers() -> None:
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)
    assert float(length_penalty(7, 0.0)) == 1.0
    src = torch.tensor([[7, 8, EOS_ID, PAD_ID], [7, 8, 9, EOS_ID]])
    assert max_output_lengths(src, 1.0, 50).tolist() == [53, 54]
    assert max_output_lengths(src, 0.0, 50, cap=10).tolist() == [10, 10]


def test_hypothesis_is_plain_data() -> None:
    h = Hypothesis([A], -1.0, -1.0)
    assert h.tokens == [A] and h.score == -1.0


@pytest.mark.parametrize("vocab", [40, 8000, 8037])
def test_row_topk_equals_topk(vocab: int) -> None:
    """The blockwise top-k used by beam search returns torch.topk's values and indices
    (distinct values), also with -inf entries and a vocabulary that fills no whole block."""
    from nmt.inference.search import _row_topk

    gen = torch.Generator().manual_seed(vocab)
    x = torch.log_softmax(torch.randn(6, 3, vocab, generator=gen) * 3, dim=-1)
    x[:, :, [PAD_ID, BOS_ID]] = -math.inf
    x[0, 0, 4:] = -math.inf  # only UNK and EOS finite: ranked first, then -inf fillers
    got, want = _row_topk(x, 8), x.topk(8, dim=-1)
    assert torch.equal(got[0], want[0])
    finite = torch.isfinite(want[0])
    assert torch.equal(got[1][finite], want[1][finite])
    if vocab > 40:
        x[1, 1, -1] = 5.0  # the maximum in the tail / last block is found
        assert _row_topk(x, 8)[1][1, 1, 0] == vocab - 1


def test_early_stop_beam_ends_at_beam_finished_where_bound_searches_on() -> None:
    """"beam" (fairseq's, CTranslate2's rule) stops once `beam` hypotheses have finished;
    "bound" (the paper's code) goes on while an unfinished one could still score better,
    and here finds it: a longer output that the length penalty (alpha 1) favours."""
    table = {(): {EOS_ID: 0.4, A: 0.6}, (A,): {EOS_ID: 0.3, A: 0.7}, (A, A): {A: 1.0},
             (A, A, A): {A: 1.0}, (A, A, A, A): {EOS_ID: 1.0}}

    def dist(_sentence: int, prefix: tuple[int, ...]) -> dict[int, float]:
        return table.get(prefix, {EOS_ID: 1.0})

    found = {}
    for rule in ("bound", "beam"):
        decoder = TableDecoder(dist)
        hyps = run_beam(decoder, torch.tensor([10]), beam=2, alpha=1.0, min_len=0,
                        early_stop=rule)
        found[rule] = (hyps[0][0].tokens, decoder.calls)
    assert found["beam"] == ([], 2)  # EOS at step 0 and (A, EOS) at step 1: two, done
    assert found["bound"] == ([A, A, A, A], 5)  # log(.42) / (10/6) beats log(.4) / 1
    with pytest.raises(ValueError, match="early_stop"):
        run_beam(TableDecoder(dist), torch.tensor([10]), early_stop="soon")


def test_the_stopping_rules_are_named_once_for_the_config() -> None:
    from nmt import config
    from nmt.inference import search

    assert config.EARLY_STOPS == search.EARLY_STOPS
