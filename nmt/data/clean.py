"""Cleaning of training pairs: Moses punctuation normalization, non-printing characters,
the empty / too-long / length-ratio filters of Moses' clean-corpus-n, removal of pairs whose
source is a dev or test source, and of exact duplicates.

Runs on chunks of pairs so that `--workers` processes can share the work; results come back
in input order and at most a few chunks are in flight, so memory stays flat whatever the
corpus size. Every chunk reports how many pairs survived each rule. Duplicates are found in
this process, in input order (the first occurrence stays), from 8-byte digests the workers
compute (nmt.data.dedup), so the output is the same for any number of workers.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import threading
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nmt.data.dedup import DigestSet, pair_digest
from nmt.data.recipes import Cleaning

# sacremoses is imported where it is used: its import takes 0.7 s, which every `nmt`
# command (all of them import this module through cli.prep) would pay otherwise.
if TYPE_CHECKING:
    from sacremoses import MosesPunctNormalizer

Pair = tuple[str, str]
# In the order applied; Counts records the pairs left after each.
RULES: tuple[str, ...] = ("empty", "min_words", "max_words", "max_ratio", "overlap", "dedup")
# Characters Python's str.splitlines (and so many readers) treat as line breaks: a segment
# containing one would become two lines downstream and shift every later pair.
LINE_BREAKS = re.compile("[\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_SPACES = re.compile(r"\s+")


def without_line_breaks(line: str) -> str:
    """`line` with every line-break character but none other replaced by a space (for dev
    and test text, which is otherwise kept exactly as published)."""
    return LINE_BREAKS.sub(" ", line)


@dataclass
class Counts:
    """Pairs seen, and pairs left after each rule (in RULES order)."""

    input: int = 0
    after: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))

    def add(self, other: Counts) -> None:
        """Accumulate another chunk's counts."""
        self.input += other.input
        for rule in RULES:
            self.after[rule] += other.after[rule]

    @property
    def output(self) -> int:
        """Pairs kept."""
        return self.after[RULES[-1]]

    def to_dict(self) -> dict[str, int]:
        """{'input': n, 'after_empty': ..., ..., 'output': n} for the manifest."""
        return {"input": self.input, **{f"after_{r}": n for r, n in self.after.items()},
                "output": self.output}


def punct_normalizer(lang: str) -> MosesPunctNormalizer:
    """sacremoses' port of Moses' normalize-punctuation.perl, run as fairseq's WMT scripts
    run the script: `normalize-punctuation.perl LANG`, without `-penn`.

    Without `-penn` the perl script applies two rules first: ` -> ' and '' -> " (with
    spaces around the quote); sacremoses applies them when `penn=True` (its flag names the
    rules, not the perl option). Two sacremoses choices stay, on purpose, where the perl
    script does otherwise:
    - a right single quote outside a word becomes ' (perl: a double quote, so `players’
      union` would read `players" union`);
    - a sentence-final `."` is left alone in non-English text (perl moves it to `".`: its
      pattern `(\\.+)"(\\s*[^<])` matches the line's own newline, against the script's
      comment "don't fix period at end of sentence").
    Checked against the perl script on Multi30k and newstest2013/2014: those two rules are
    the only differences.
    """
    from sacremoses import MosesPunctNormalizer

    return MosesPunctNormalizer(lang=lang, penn=True)


def _is_printing(char: str) -> bool:
    return not unicodedata.category(char).startswith("C")


class PairCleaner:
    """Normalizes and filters pairs per the recipe's `Cleaning` rules (picklable config).

    `held_out`: the dev and test source sentences, normalized by `normalize(text, 0)`; with
    `rules.remove_overlap` a pair whose normalized source is one of them is dropped.
    """

    def __init__(self, rules: Cleaning, src_lang: str, tgt_lang: str,
                 held_out: frozenset[str] = frozenset()) -> None:
        self.rules = rules
        self.held_out = held_out if rules.remove_overlap else frozenset()
        self._norm = ([punct_normalizer(src_lang), punct_normalizer(tgt_lang)]
                      if rules.normalize_punctuation else None)

    def normalize(self, text: str, side: int) -> str:
        """Punctuation normalization, then every \\p{C} character (controls, format chars,
        private use, unassigned) becomes a space as in Moses' remove-non-printing-char;
        runs of whitespace collapse to one space and the ends are trimmed."""
        if self._norm is not None:
            text = self._norm[side].normalize(text)
        if self.rules.remove_non_printing and not text.isprintable():  # fast path first
            text = "".join(c if _is_printing(c) else " " for c in text)
        return _SPACES.sub(" ", text).strip()

    def keep(self, src: str, tgt: str, counts: Counts) -> bool:
        """Apply the filters in RULES order, counting survivors of each."""
        n_src, n_tgt = len(src.split()), len(tgt.split())
        rules = self.rules
        if n_src == 0 or n_tgt == 0:
            return False
        counts.after["empty"] += 1
        if min(n_src, n_tgt) < rules.min_words:
            return False
        counts.after["min_words"] += 1
        if rules.max_words and max(n_src, n_tgt) > rules.max_words:
            return False
        counts.after["max_words"] += 1
        if rules.max_ratio and max(n_src, n_tgt) / min(n_src, n_tgt) > rules.max_ratio:
            return False
        counts.after["max_ratio"] += 1
        if src in self.held_out:
            return False
        counts.after["overlap"] += 1
        return True

    def clean_chunk(self, pairs: list[Pair]) -> tuple[list[Pair], np.ndarray, Counts]:
        """Normalize and filter one chunk (every rule but dedup); return the kept pairs,
        their digests for dedup (uint64, empty when dedup is off) and the counts."""
        counts = Counts(input=len(pairs))
        kept = []
        for src, tgt in pairs:
            src, tgt = self.normalize(src, 0), self.normalize(tgt, 1)
            if self.keep(src, tgt, counts):
                kept.append((src, tgt))
        digests = np.fromiter((pair_digest(s, t) for s, t in kept), dtype=np.uint64,
                              count=len(kept)) if self.rules.dedup else \
            np.zeros(0, dtype=np.uint64)
        return kept, digests, counts


_WORKER: PairCleaner | None = None


def _init_worker(rules: Cleaning, src_lang: str, tgt_lang: str,
                 held_out: frozenset[str]) -> None:
    global _WORKER
    _WORKER = PairCleaner(rules, src_lang, tgt_lang, held_out)


def _work(pairs: list[Pair]) -> tuple[list[Pair], np.ndarray, Counts]:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER.clean_chunk(pairs)


def chunked(pairs: Iterable[Pair], size: int) -> Iterator[list[Pair]]:
    """Group an iterable of pairs into lists of at most `size`."""
    chunk: list[Pair] = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _start_worker(initializer: Callable[..., None], *initargs: object) -> None:
    """A pool worker's start: SIGTERM as a fresh process has it (a forked worker inherits
    its parent's Python handler, which would raise where Pool.terminate means to end it,
    and the pool's exit would wait for it forever), then `initializer`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    initializer(*initargs)


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int,
                initializer: Callable[..., None], initargs: tuple,
                window: int = 4) -> Iterator[Any]:
    """`map(fn, items)` over `workers` processes, in input order, with at most
    `workers * window` items in flight (Pool.imap would read its input to the end)."""
    if workers <= 1:
        initializer(*initargs)
        yield from map(fn, items)
        return
    # fork is fast, but only safe while this process runs no other thread; else spawn.
    method = ("fork" if threading.active_count() == 1
              and "fork" in multiprocessing.get_all_start_methods() else "spawn")
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(workers, initializer=_start_worker, initargs=(initializer, *initargs)
                  ) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= workers * window:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def clean_pairs(pairs: Iterable[Pair], rules: Cleaning, src_lang: str, tgt_lang: str,
                counts: Counts, workers: int = 1, chunk_size: int = 5000,
                held_out: frozenset[str] = frozenset(), seen: DigestSet | None = None
                ) -> Iterator[Pair]:
    """Yield the cleaned pairs that pass every rule, in order; `counts` is updated as
    chunks complete (complete once the iterator is exhausted).

    `held_out`: normalized dev/test sources (see PairCleaner). `seen`: the pairs already
    written, shared across the corpora of a split so that dedup spans all of them (a new
    set when None).
    """
    seen = DigestSet() if seen is None else seen
    for kept, digests, chunk_counts in ordered_map(
            _work, chunked(pairs, chunk_size), workers, _init_worker,
            (rules, src_lang, tgt_lang, held_out)):
        if rules.dedup:
            fresh = seen.add_new(digests)  # (len(kept),) bool: first occurrences
            kept = [pair for pair, new in zip(kept, fresh.tolist(), strict=True) if new]
        chunk_counts.after["dedup"] = len(kept)
        counts.add(chunk_counts)
        yield from kept
