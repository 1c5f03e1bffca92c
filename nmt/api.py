"""The Python API: load a model once, then translate and score text from a program.

    from nmt import Translator
    translator = Translator.load("runs/multi30k-en-de")   # a run directory or a checkpoint
    translator.translate(["A man rides a bike.", ""])    # ['Ein Mann fährt Fahrrad.', '']

It is a thin layer over the engine `nmt translate` runs (nmt/inference/translate.py): the
same buffering, batching, search and detokenization, so `translate(lines)` returns exactly
the lines `nmt translate` prints for the same options. Importing this module (and `nmt`)
does not import torch; `Translator.load` does.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nmt.config import DecodeConfig, RuntimeConfig
from nmt.errors import UsageError

if TYPE_CHECKING:  # torch-free at import time
    from nmt.inference.translate import Engine, Translation

_D = DecodeConfig()
_R = RuntimeConfig()


@dataclass(frozen=True)
class ScoredText:
    """One hypothesis: its text, its score (log-probability divided by the GNMT length
    penalty of the call's alpha, as beam search ranks it) and its raw log-probability
    (natural log, EOS included)."""

    text: str
    score: float
    log_prob: float


@dataclass(frozen=True)
class TranslationResult:
    """The hypotheses of one input line, best first (`nbest` of them; none for an empty
    line)."""

    hypotheses: list[ScoredText]

    @property
    def text(self) -> str:
        """The best translation ("" for an empty line)."""
        return self.hypotheses[0].text if self.hypotheses else ""


@dataclass(frozen=True)
class ScoreResult:
    """How probable the model finds a given translation (forced decoding): `log_prob` the
    sum of its pieces' log-probabilities, EOS included (natural log); `tokens` the pieces
    counted (EOS included); `normalized` = log_prob / tokens, comparable across lengths."""

    log_prob: float
    tokens: int
    normalized: float


class Translator:
    """A loaded model (or ensemble) that translates and scores lists of sentences.

    Parallelism: `workers=N` (CPU) decodes in N forked processes that share the loaded
    weights; a call's batches are spread over them, and so are the batches of calls made
    from several threads at once. Without workers one Translator may still be shared by
    threads, but its calls run one at a time (a lock: the decoding buffers are per
    Translator), each on torch's intra-op threads. Close it (or use `with`) to stop the
    workers. `nmt serve` merges concurrent requests into batches and runs them on them.
    """

    def __init__(self, engine: Engine, paths: list[Path],
                 languages: tuple[str, str] = ("", ""),
                 tuned: dict[str, Any] | None = None) -> None:
        """Use `Translator.load`; this wraps an already loaded engine. `tuned`: decoding
        options used where a call gives none of its own (`nmt tune`'s decoding.json)."""
        self._engine = engine
        self.paths = paths
        self._languages = languages
        self.tuned: dict[str, Any] = dict(tuned or {})
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path | Sequence[str | Path], device: str = _R.device,
             precision: str = _R.precision, threads: int | None = None,
             weights: str = _R.weights, quiet: bool = False, workers: int = 1,
             shortlist: str | Path | None = None) -> Translator:
        """Load a checkpoint file, or a run directory (its average.pt, else
        checkpoint_best.pt, else checkpoint_last.pt: the choice is printed on stderr
        unless `quiet`); a list of them is an ensemble. `device`, `precision` and
        `weights` as `nmt translate`'s flags. `workers` > 1 (CPU) forks that many
        decoding processes sharing the weights, `threads` torch threads each (None: 1);
        with one worker `threads` sets torch's intra-op threads for the whole process
        (None: leave torch's setting). `shortlist`: a file of `nmt shortlist` made with
        the model's vocabulary: only each batch's likely target pieces are scored.

        A model in a run directory where `nmt tune` wrote decoding.json decodes with the
        alpha (and beam) it chose wherever a call gives none (said on stderr unless
        `quiet`; `tuned` holds them).

        On a CPU, loading also sets two things for the whole process, for as long as it
        lives: glibc keeps freed memory for reuse instead of unmapping it, and oneDNN
        keeps 4,096 compiled kernels (unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set
        before); see nmt/host_memory.py."""
        import torch

        from nmt.checkpoint import resolve_model_paths
        from nmt.inference.translate import Engine
        from nmt.inference.tuned import describe, tuned_settings

        for name, value in (("threads", threads), ("workers", workers)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if threads is not None and workers == 1:
            torch.set_num_threads(threads)
        given = [path] if isinstance(path, str | Path) else list(path)
        files = resolve_model_paths([Path(p) for p in given], lambda item, file: quiet or print(
            f"nmt: {item}: using {file}", file=sys.stderr))
        tuned, tuned_from = tuned_settings(files)
        if tuned_from is not None and not quiet:
            print(f"nmt: {describe(tuned, tuned_from)}", file=sys.stderr)
        engine = Engine.load(files, _D, device=device, precision=precision,
                             weights=weights, workers=workers, threads=threads or 1,
                             shortlist=None if shortlist is None else Path(shortlist))
        return cls(engine, files, _languages(files[0]), tuned)

    def __enter__(self) -> Translator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes (idempotent); later calls decode in this process."""
        self._engine.close()

    @property
    def workers(self) -> int:
        """Processes decoding in parallel (1: this one)."""
        return self._engine.workers

    @property
    def device(self) -> str:
        """Where the model runs ("cpu", "cuda:0")."""
        return str(self._engine.device)

    @property
    def precision(self) -> str:
        """The precision the model runs in ("auto" resolved: fp32, bf16, fp16 or int8)."""
        return str(self._engine.precision)

    @property
    def parameters(self) -> int:
        """Parameters of the (first) model."""
        return self._engine.parameters

    @property
    def languages(self) -> tuple[str, str]:
        """(source, target) language codes recorded at training (from `nmt prep`'s
        manifest); ("", "") for a model trained without them."""
        return self._languages

    def count_tokens(self, lines: Sequence[str]) -> list[int]:
        """Source pieces of each line, EOS included: what batching counts."""
        texts = _as_lines(lines, "lines")
        return [len(ids) + 1 for ids in self._engine.vocab.encode(texts)] if texts else []

    @property
    def model_config(self) -> dict[str, Any]:
        """The (first) model's architecture, as stored in its checkpoint."""
        return self._engine.models[0].config.to_dict()

    def translate(self, lines: Sequence[str], *,
                  target_prefix: Sequence[str | None] | None = None, seed: int | None = None,
                  max_src_len: int | None = None, **options: Any) -> list[str]:
        """The best translation of each of `lines` (one sentence each), same order; an
        empty line gives "".

        `options` are `DecodeConfig`'s fields (nmt/config.py), which are `nmt translate`'s
        flags of the same names with its defaults: beam (4) and alpha (0.6) as in the
        paper (or those of the run's decoding.json, `tuned`), max_len_a, max_len_b,
        min_len, early_stop, sampling, temperature, top_k, top_p, max_tokens, buffer_size
        (nbest: see `translate_hypotheses`).
        `target_prefix`, one per line (None or "": none): that line's output starts with
        it (teacher-forced, then the search goes on). `seed` makes `sampling`
        reproducible for this call. Over-long lines are truncated to `max_src_len` pieces
        (default: the model's positions - 1), as `nmt translate` does.
        """
        if options.get("nbest", 1) != 1:
            raise UsageError("translate returns the best translation of each line; for "
                             "n-best lists use translate_hypotheses(lines, nbest=N)")
        return [r.texts[0] if r.texts else ""
                for r in self._search(lines, target_prefix, seed, max_src_len, options)]

    def translate_hypotheses(self, lines: Sequence[str], *,
                             target_prefix: Sequence[str | None] | None = None,
                             seed: int | None = None, max_src_len: int | None = None,
                             **options: Any) -> list[TranslationResult]:
        """`translate` with the hypotheses themselves: per line, the `nbest` best (an
        option as for `translate`, default 1) with their scores, best first; none for an
        empty line."""
        return [TranslationResult([ScoredText(text, h.score, h.log_prob)
                                   for h, text in zip(r.hypotheses, r.texts, strict=True)])
                for r in self._search(lines, target_prefix, seed, max_src_len, options)]

    def _search(self, lines: Sequence[str], target_prefix: Sequence[str | None] | None,
                seed: int | None, max_src_len: int | None, options: dict[str, Any]
                ) -> list[Translation]:
        """Translate as `nmt translate` does (its buffering, batching and search), with
        `DecodeConfig(**options)`; one result per line."""
        from nmt.inference.translate import start_texts

        texts = _as_lines(lines, "lines")
        if target_prefix is not None and len(target_prefix) != len(texts):
            raise UsageError(f"target_prefix has {len(target_prefix)} entries for "
                             f"{len(texts)} lines; give one per line (None for none)")
        cfg = decode_config({**self.tuned, **options})
        with self._lock:  # forming batches (and, without workers, decoding them)
            engine = self._engine.configured(cfg, max_src_len, name="max_src_len")
            if seed is not None:
                engine.seeds.restart(seed)
            pending = []
            for start in range(0, len(texts), cfg.buffer_size):  # as nmt translate buffers
                end = start + cfg.buffer_size
                prefixes = None if target_prefix is None else list(target_prefix[start:end])
                pending.append(start_texts(engine, texts[start:end], prefixes=prefixes,
                                           line_numbers=range(start + 1, end + 1),
                                           source_name="lines"))
        return [r for part in pending for r in part.result()]  # workers: no lock held

    def score(self, sources: Sequence[str], targets: Sequence[str], *,
              max_tokens: int | None = _D.max_tokens) -> list[ScoreResult]:
        """The model's log-probability of each `targets[i]` as the translation of
        `sources[i]` (forced decoding, EOS included): per pair, raw and per token. Texts
        are tokenized here, so a translation's score equals the log-probability its search
        reported whenever its pieces re-tokenize to themselves (nearly always for a
        trained model). An empty target scores its EOS alone."""
        from nmt.inference.scoring import score_ids

        src_texts, tgt_texts = _as_lines(sources, "sources"), _as_lines(targets, "targets")
        if len(src_texts) != len(tgt_texts):
            raise UsageError(f"{len(src_texts)} sources but {len(tgt_texts)} targets; "
                             "give one target per source")
        with self._lock:
            engine = self._engine
            src_ids = engine.vocab.encode(src_texts) if src_texts else []
            tgt_ids = engine.vocab.encode(tgt_texts) if tgt_texts else []
            scored = score_ids(engine, src_ids, tgt_ids, max_tokens or engine.max_tokens)
        return [ScoreResult(lp, n, lp / n) for lp, n in scored]


def _languages(path: Path) -> tuple[str, str]:
    """(source, target) codes in a checkpoint's meta, read memory-mapped (weights stay
    on disk); ("", "") when it records none."""
    from nmt.checkpoint import load_checkpoint

    meta = load_checkpoint(path, mmap=True).get("meta") or {}
    return str(meta.get("src_lang") or ""), str(meta.get("tgt_lang") or "")


def decode_config(options: dict[str, Any]) -> DecodeConfig:
    """`DecodeConfig(**options)`, with a UsageError naming the known options for an
    unknown one (the options are the config's fields: one list, nmt/config.py)."""
    known = [f.name for f in fields(DecodeConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are "
                         f"{', '.join(known)}")
    return DecodeConfig(**options)


def _as_lines(lines: Sequence[str], name: str) -> list[str]:
    """`lines` as a list of str; a lone string (a common slip) or a non-str item is a
    UsageError rather than a translation of its characters."""
    if isinstance(lines, str | bytes):
        raise UsageError(f"{name} must be a list of strings, got one {type(lines).__name__}; "
                         f"wrap it: [{name[:-1] if name.endswith('s') else name}]")
    out = list(lines)
    for i, line in enumerate(out):
        if not isinstance(line, str):
            raise UsageError(f"{name}[{i}] is {type(line).__name__}, not str")
    return out


__all__ = ["ScoreResult", "ScoredText", "TranslationResult", "Translator"]
