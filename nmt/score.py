"""Corpus scores: sacreBLEU (BLEU, chrF, TER with signatures) and the paper's tokenized BLEU.

The paper-style score follows tensor2tensor's `get_ende_bleu.sh`: Moses-tokenize hypothesis
and reference (`tokenizer.perl -l LANG`, here sacremoses), split hyphenated compounds as
`a ##AT##-##AT## b` in both, then multi-bleu.perl, which is sacreBLEU's BLEU on the
already-tokenized strings (`tokenize='none'`, `force=True`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nmt.errors import DataError, UsageError

METRICS = ("bleu", "chrf", "ter")
_COMPOUND = re.compile(r"(\S)-(\S)")  # the perl `s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g`


@dataclass(frozen=True)
class Score:
    """One metric's result: its name, value, signature and sacreBLEU's full line."""

    metric: str
    score: float
    signature: str
    text: str

    def to_dict(self) -> dict[str, object]:
        """Plain dict for `--json`."""
        return asdict(self)


def read_lines(path: Path | None, data: bytes | None = None, what: str = "file") -> list[str]:
    """Lines of a UTF-8 text file (or of `data` read from stdin, named by `path` or
    "<stdin>"); split on `\\n` only, as translate writes them. Empty input is an error."""
    name = str(path) if path is not None else "<stdin>"
    if data is None:
        try:
            data = Path(path).read_bytes()  # type: ignore[arg-type]
        except OSError as err:
            raise DataError(f"{name}: cannot read {what} ({err.strerror})") from err
    if not data:
        raise DataError(f"{name}: {what} is empty; nothing to score")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{name}: line {line}: invalid UTF-8 in {what}; "
                        "convert it to UTF-8 first") from err
    lines = text.split("\n")
    if lines[-1] == "":  # the final newline ends the last line, it does not start one
        lines.pop()
    return lines


def check_lengths(hyps: Sequence[str], refs: Sequence[str], hyp_name: str,
                  ref_name: str) -> None:
    """Hypotheses and references must pair up one to one."""
    if len(hyps) != len(refs):
        raise DataError(f"line-count mismatch: {len(hyps)} hypotheses in {hyp_name} but "
                        f"{len(refs)} references in {ref_name}; they must pair up line by line")


def sacrebleu_scores(hyps: Sequence[str], refs: Sequence[str],
                     metrics: Sequence[str] = ("bleu",), tokenize: str | None = None,
                     lowercase: bool = False) -> list[Score]:
    """sacreBLEU corpus scores (BLEU default tokenizer 13a) with their signatures."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise UsageError(f"unknown metric(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(METRICS)}")
    if tokenize is not None and tokenize not in BLEU.TOKENIZERS:
        raise UsageError(f"unknown tokenizer {tokenize!r}; choose one of: "
                         f"{', '.join(BLEU.TOKENIZERS)}")
    results = []
    for name in metrics:
        if name == "bleu":
            metric = BLEU(tokenize=tokenize, lowercase=lowercase)
        elif name == "chrf":
            metric = CHRF(lowercase=lowercase)
        else:
            metric = TER(case_sensitive=not lowercase)
        try:
            result = metric.corpus_score(list(hyps), [list(refs)])
        except Exception as err:  # e.g. a tokenizer whose optional package is missing
            raise UsageError(f"sacrebleu {name} failed: {err}") from err
        signature = str(metric.get_signature())
        results.append(Score(name, float(result.score), signature, str(result)))
    return results


def corpus_scores(hyps: Sequence[str], refs: Sequence[str],
                  metrics: Sequence[str] = ("bleu",), digits: int | None = None
                  ) -> dict[str, float]:
    """Detokenized sacreBLEU corpus scores by metric name (BLEU with its default 13a
    tokenizer, chrF, TER) of `hyps` against the first len(hyps) `refs`, rounded to `digits`
    when given: the one scoring path of validation and the benches (`nmt score` prints the
    same numbers with their signatures)."""
    scores = sacrebleu_scores(hyps, list(refs)[: len(hyps)], metrics)
    return {s.metric: s.score if digits is None else round(s.score, digits) for s in scores}


def paper_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Moses tokenization (escaped, as tokenizer.perl) plus ##AT## compound splitting."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    out = []
    for line in lines:
        tokens = tokenizer.tokenize(line, return_str=True, escape=True)
        out.append(_COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokens))
    return out


def paper_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str) -> Score:
    """The paper's tokenized, compound-split BLEU (tensor2tensor get_ende_bleu.sh)."""
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize="none", force=True)
    result = metric.corpus_score(paper_tokenize(hyps, lang), [paper_tokenize(refs, lang)])
    signature = f"paper-style:moses-{lang}+compound-split+multi-bleu|{metric.get_signature()}"
    return Score("bleu-paper", float(result.score), signature, str(result))


def _moses_languages() -> frozenset[str]:
    """The language codes Moses' tokenizer has rules for (sacremoses' nonbreaking-prefix
    files: de, en, fr, ...)."""
    from sacremoses.corpus import NonbreakingPrefixes

    return frozenset(NonbreakingPrefixes().available_langs.values())


def reference_language(ref: Path) -> str:
    """The language of a reference file for the paper's Moses tokenization: the prepared
    data's own (`nmt prep` writes DATA/test.tgt beside DATA/manifest.json, whose tgt_lang
    says de), else the file's extension where it is a language code Moses knows
    (newstest2014.de). Anything else (out.txt, test.tgt outside prepared data) is a
    UsageError naming --lang: a language guessed from a name that is not one tokenizes
    with the wrong rules, silently."""
    side = {".src": "src_lang", ".tgt": "tgt_lang"}.get(ref.suffix)
    manifest = ref.parent / "manifest.json"
    if side is not None and manifest.is_file():
        try:
            lang = json.loads(manifest.read_text(encoding="utf-8")).get(side)
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(f"{manifest}: unreadable manifest ({err}); pass --lang "
                            "(e.g. --lang de) or re-run `nmt prep`") from err
        if isinstance(lang, str) and re.fullmatch(r"[a-z]{2,3}", lang):
            return lang
        raise DataError(f"{manifest}: names no {side} for {ref.name}; pass --lang "
                        "(e.g. --lang de)")
    extension = ref.suffix.lstrip(".").lower()
    if extension in _moses_languages():
        return extension
    where = (f"{ref.suffix!r} is not a language code Moses knows"
             if ref.suffix else "it has no extension")
    raise UsageError(f"{ref}: cannot tell the target language for --paper ({where}, and "
                     "no `nmt prep` manifest.json beside it names one); pass --lang "
                     "(e.g. --lang de)")


def score_files(ref: Path, hyp: Path | None, hyp_data: bytes | None = None,
                metrics: Sequence[str] = ("bleu",), tokenize: str | None = None,
                lowercase: bool = False, paper: bool = False, lang: str | None = None
                ) -> list[Score]:
    """Read, check and score; `hyp` None means the hypotheses are `hyp_data` (stdin).

    For `paper`, `lang` (the target language for Moses) defaults to `reference_language`'s.
    """
    if paper and lang is None:
        lang = reference_language(Path(ref))
    refs = read_lines(ref, what="reference file")
    hyps = read_lines(hyp, hyp_data, what="hypothesis file")
    check_lengths(hyps, refs, str(hyp) if hyp is not None else "<stdin>", str(ref))
    if paper:
        return [paper_bleu(hyps, refs, lang)]  # type: ignore[arg-type]
    return sacrebleu_scores(hyps, refs, metrics, tokenize, lowercase)
