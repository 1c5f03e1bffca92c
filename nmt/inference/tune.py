"""Decoding settings chosen on a dev set by a rule that transfers to data it has not seen
(`nmt tune`), and kept in the run directory (`decoding.json`, tuned.py beside this).

A sweep translates the dev sources once per setting (length penalty alpha, beam) and
scores each output: BLEU, chrF, its length against the references' and the sources', and
how much it repeats itself. The arg-max of dev BLEU fits the brevity penalty to the dev
set's own references, whose length differs from split to split (Multi30k: target/source
1.061 in pieces on valid, 1.035 on train, 1.008 on test2016): on valid it rewards the
alpha at which an under-trained model starts to ramble, which then loses up to a BLEU
point on test2016. The default rule (`no-ramble`) takes valid's arg-max among the alphas
whose outputs do not repeat themselves more than the paper's alpha's; rules that judge
length by the training corpus's ratio instead did worse on data they had not seen
(`RULES`; docs/translating.md has the evidence).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nmt.config import DecodeConfig
from nmt.errors import DataError, UsageError

if TYPE_CHECKING:  # torch-free at import time
    from nmt.inference.translate import Engine

PAPER_ALPHA = 0.6  # section 6.1: beam 4, alpha 0.6
ALPHAS = (0.6, 0.8, 1.0, 1.2, 1.4)
# Lines of the training corpus read for its length ratio: spread over the whole file, so
# WMT's 4.5M pairs cost seconds; the ratio of 29,000 Multi30k pairs moves in the third
# decimal between halves.
RATIO_LINES = 200_000
# A setting other than the paper's is chosen only when it beats the paper's on the rule's
# criterion by more than this (BLEU points): on flat scores the paper's alpha stays.
FLAT_BLEU = 0.2
# An output rambles when its share of repeated bigrams (%) exceeds the paper's alpha's by
# more than this many points: under-trained Multi30k models rose 2.2-7.7 points at alpha
# 1.4, trained ones 0.3-0.5 (docs/translating.md).
RAMBLE_POINTS = 1.0


@dataclass(frozen=True)
class Trial:
    """One setting's dev output, scored. Lengths are sacreBLEU's 13a tokens (BLEU's own
    length): `hyp_len`, `ref_len`, `src_len` summed over the set."""

    alpha: float
    beam: int
    bleu: float
    chrf: float
    brevity: float  # BLEU's brevity penalty against the dev references
    hyp_len: int
    ref_len: int
    src_len: int
    counts: tuple[int, ...]  # matched n-grams, n = 1..4
    totals: tuple[int, ...]  # hypothesis n-grams, n = 1..4
    repeats: float = 0.0  # % of the output's bigrams that repeat one before in their line

    @property
    def ratio(self) -> float:
        """Output length over the references'."""
        return self.hyp_len / max(self.ref_len, 1)

    @property
    def src_ratio(self) -> float:
        """Output length over the sources'."""
        return self.hyp_len / max(self.src_len, 1)

    def bleu_at_length(self, ref_len: float) -> float:
        """BLEU of this output with the brevity penalty taken against `ref_len` instead
        of the references' own length (the n-gram precisions unchanged)."""
        if min(self.counts) == 0:
            return 0.0
        log_p = sum(math.log(c / t) for c, t in zip(self.counts, self.totals, strict=True))
        brevity = 1.0 if self.hyp_len >= ref_len else math.exp(1 - ref_len / self.hyp_len)
        return 100.0 * brevity * math.exp(log_p / len(self.counts))

    def to_dict(self) -> dict[str, object]:
        """Plain dict (decoding.json's table), with the two ratios."""
        out = asdict(self)
        out["counts"], out["totals"] = list(self.counts), list(self.totals)
        out["ratio"], out["src_ratio"] = round(self.ratio, 4), round(self.src_ratio, 4)
        return out


def score_trial(alpha: float, beam: int, hyps: Sequence[str], refs: Sequence[str],
                sources: Sequence[str]) -> Trial:
    """Score one setting's output `hyps` against `refs` (sacreBLEU BLEU 13a and chrF)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu = BLEU().corpus_score(list(hyps), [list(refs)])
    chrf = CHRF().corpus_score(list(hyps), [list(refs)])
    return Trial(alpha=alpha, beam=beam, bleu=round(float(bleu.score), 4),
                 chrf=round(float(chrf.score), 4), brevity=round(float(bleu.bp), 6),
                 hyp_len=int(bleu.sys_len), ref_len=int(bleu.ref_len),
                 src_len=token_count(sources), counts=tuple(int(c) for c in bleu.counts),
                 totals=tuple(int(t) for t in bleu.totals), repeats=round(repeats(hyps), 4))


def repeats(lines: Sequence[str]) -> float:
    """% of the bigrams of `lines` (13a tokens) that repeat a bigram earlier in the same
    line: how much an output rambles ("a man in a blue shirt in a blue shirt")."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    again = total = 0
    for line in lines:
        words = tokenize(line.strip()).split()
        bigrams = list(zip(words, words[1:], strict=False))
        again += len(bigrams) - len(set(bigrams))
        total += len(bigrams)
    return 100.0 * again / max(total, 1)


def token_count(lines: Sequence[str]) -> int:
    """Tokens of `lines` as BLEU counts them (sacreBLEU's 13a tokenizer)."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    return sum(len(tokenize(line.strip()).split()) for line in lines)


def corpus_ratio(src: Path, tgt: Path, max_lines: int = RATIO_LINES) -> float:
    """Target over source length (13a tokens) of a parallel corpus, from at most
    `max_lines` pairs spread evenly over it; DataError when the files are missing, differ
    in lines or are empty."""
    texts = []
    for path in (src, tgt):
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace").split("\n"))
        except OSError as err:
            raise DataError(f"{path}: cannot read the training corpus ({err.strerror}); "
                            "pass --data DIR (with train.src and train.tgt) or "
                            "--ratio R") from err
    src_lines, tgt_lines = (t[:-1] if t and t[-1] == "" else t for t in texts)
    if len(src_lines) != len(tgt_lines) or not src_lines:
        raise DataError(f"{src}, {tgt}: {len(src_lines)} and {len(tgt_lines)} lines; a "
                        "training corpus needs as many target lines as source lines")
    step = max(1, len(src_lines) // max_lines)
    picked = range(0, len(src_lines), step)
    src_len = token_count([src_lines[i] for i in picked])
    tgt_len = token_count([tgt_lines[i] for i in picked])
    if src_len == 0:
        raise DataError(f"{src}: no tokens in the training sources")
    return tgt_len / src_len


@dataclass(frozen=True)
class Choice:
    """What a rule chose and why (one line a person reads)."""

    alpha: float
    beam: int
    rule: str
    why: str


Rule = Callable[[Sequence[Trial], float], Choice]


def _best(trials: Sequence[Trial], key: Callable[[Trial], float]) -> Trial:
    """The trial with the highest `key`; ties go to the smaller beam, then the alpha
    nearest the paper's."""
    return max(trials, key=lambda t: (key(t), -t.beam, -abs(t.alpha - PAPER_ALPHA)))


def _paper(trials: Sequence[Trial], beam: int) -> Trial | None:
    """The trial at the paper's alpha and `beam`, if swept."""
    return next((t for t in trials if t.alpha == PAPER_ALPHA and t.beam == beam), None)


def _keep_paper_if_flat(trials: Sequence[Trial], best: Trial, key: Callable[[Trial], float],
                        rule: str, what: str) -> Choice:
    """`best`, unless the paper's alpha (same beam) is within FLAT_BLEU of it on `key`."""
    paper = _paper(trials, best.beam)
    if paper is not None and paper is not best and key(best) - key(paper) <= FLAT_BLEU:
        return Choice(PAPER_ALPHA, best.beam, rule,
                      f"{what}: {key(paper):.2f} at the paper's alpha {PAPER_ALPHA}, "
                      f"{key(best):.2f} at {best.alpha} (within {FLAT_BLEU}: kept "
                      f"{PAPER_ALPHA})")
    return Choice(best.alpha, best.beam, rule, f"{what}: {key(best):.2f} at alpha "
                  f"{best.alpha}, beam {best.beam} (the highest)")


def rule_corpus_length(trials: Sequence[Trial], ratio: float) -> Choice:
    """BLEU with its brevity penalty against the length the training corpus's ratio
    expects of these sources (ratio x source tokens), not against the dev references':
    the n-gram precisions judge quality, the language pair judges length."""
    def key(t: Trial) -> float:
        return t.bleu_at_length(ratio * t.src_len)

    return _keep_paper_if_flat(trials, _best(trials, key), key, "corpus-length",
                               f"BLEU at the corpus's length ratio {ratio:.3f}")


def rule_length(trials: Sequence[Trial], ratio: float) -> Choice:
    """The output whose length over its sources is nearest the training corpus's ratio."""
    best = _best(trials, lambda t: -abs(t.src_ratio - ratio))
    return Choice(best.alpha, best.beam, "length",
                  f"output/source {best.src_ratio:.3f} nearest the corpus's {ratio:.3f}")


def rule_dev_bleu(trials: Sequence[Trial], ratio: float) -> Choice:
    """The arg-max of dev BLEU (what `make demo` did): fits the dev references' length."""
    return _keep_paper_if_flat(trials, _best(trials, lambda t: t.bleu), lambda t: t.bleu,
                               "dev-bleu", "dev BLEU")


def rule_chrf(trials: Sequence[Trial], ratio: float) -> Choice:
    """The arg-max of dev chrF."""
    return _keep_paper_if_flat(trials, _best(trials, lambda t: t.chrf), lambda t: t.chrf,
                               "chrf", "dev chrF")


def rule_precision(trials: Sequence[Trial], ratio: float) -> Choice:
    """The arg-max of BLEU before its brevity penalty (the n-gram precisions alone)."""
    def key(t: Trial) -> float:
        return t.bleu_at_length(0.0)

    return _keep_paper_if_flat(trials, _best(trials, key), key, "precision",
                               "BLEU before the brevity penalty")


def _not_rambling(trials: Sequence[Trial]) -> list[Trial]:
    """The trials whose outputs do not ramble: at most RAMBLE_POINTS more repeated bigrams
    (%) than the paper's alpha's at the same beam (all of them where it was not swept)."""
    out = []
    for t in trials:
        paper = _paper(trials, t.beam)
        if paper is None or t.repeats <= paper.repeats + RAMBLE_POINTS:
            out.append(t)
    return out


def rule_no_ramble(trials: Sequence[Trial], ratio: float) -> Choice:
    """The arg-max of dev BLEU among the settings whose outputs do not ramble: a length
    penalty large enough for a model to start repeating itself wins BLEU's brevity penalty
    on dev references longer than the test's, and loses it on data it has not seen."""
    calm = _not_rambling(trials)
    choice = _keep_paper_if_flat(calm, _best(calm, lambda t: t.bleu), lambda t: t.bleu,
                                 "no-ramble", "dev BLEU")
    out = [t.alpha for t in trials if t not in calm]
    return choice if not out else Choice(
        choice.alpha, choice.beam, choice.rule, f"{choice.why}; rambling at alpha "
        f"{', '.join(map(str, out))} (repeated bigrams > {RAMBLE_POINTS} points above "
        f"alpha {PAPER_ALPHA}'s): left out")


def rule_no_ramble_corpus(trials: Sequence[Trial], ratio: float) -> Choice:
    """`rule_corpus_length` among the settings whose outputs do not ramble."""
    calm = _not_rambling(trials)
    choice = rule_corpus_length(calm, ratio)
    return Choice(choice.alpha, choice.beam, "no-ramble-corpus", choice.why)


RULES: dict[str, Rule] = {"no-ramble": rule_no_ramble, "no-ramble-corpus": rule_no_ramble_corpus,
                          "dev-bleu": rule_dev_bleu, "corpus-length": rule_corpus_length,
                          "length": rule_length, "chrf": rule_chrf,
                          "precision": rule_precision}
DEFAULT_RULE = "no-ramble"


def choose(trials: Sequence[Trial], ratio: float, rule: str = DEFAULT_RULE) -> Choice:
    """The setting `rule` picks among `trials` (training corpus target/source `ratio`)."""
    if rule not in RULES:
        raise UsageError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if not trials:
        raise UsageError("no settings to choose among")
    return RULES[rule](trials, ratio)


def parse_values(text: str, kind: type, name: str) -> list:
    """"0.6,0.8,1.0" -> [0.6, 0.8, 1.0] of `kind`; UsageError naming `name` otherwise."""
    try:
        values = [kind(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as err:
        raise UsageError(f"{name}: {text!r} is not a comma-separated list of "
                         f"{kind.__name__}s") from err
    if not values or any(v < 0 for v in values) or (kind is int and min(values) < 1):
        raise UsageError(f"{name}: give at least one value, each "
                         f"{'>= 1' if kind is int else '>= 0'} (got {text!r})")
    return sorted(set(values))


def translations(engine: Engine, sources: Sequence[str], cfg: DecodeConfig) -> list[str]:
    """The best translation of each of `sources` with `engine` under search settings `cfg`
    ("" for an empty line), as `nmt translate` writes them."""
    from nmt.inference.translate import translate_texts

    results = translate_texts(engine.configured(cfg, engine.max_src_len), sources)
    return [r.texts[0] if r.texts else "" for r in results]


def sweep(engine: Engine, sources: Sequence[str], refs: Sequence[str],
          alphas: Sequence[float], beams: Sequence[int], base: DecodeConfig,
          say: Callable[[Trial], object] = lambda _t: None) -> list[Trial]:
    """Translate `sources` once per (alpha, beam) with `engine` (the other settings
    `base`'s) and score each output against `refs`. `say(trial)` is called as each one is
    scored."""
    import dataclasses

    trials = []
    for beam in beams:
        for alpha in alphas:
            cfg = dataclasses.replace(base, alpha=alpha, beam=beam, nbest=1)
            trial = score_trial(alpha, beam, translations(engine, sources, cfg), refs, sources)
            trials.append(trial)
            say(trial)
    return trials
