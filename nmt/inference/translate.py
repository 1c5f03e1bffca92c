"""The streaming translation pipeline: bytes in, one line out per line in, order kept.

Reads ahead `buffer_size` lines (one at a time when interactive), sorts them by length,
batches them by padded source tokens, runs the search and writes the buffer's output in
input order, then flushes so a pipeline streams. A line ends at `\\n` only (a lone `\\r` is
part of it); empty lines give empty lines without a model call; over-long lines are
truncated with a warning, never dropped; invalid UTF-8 is replaced or, with
errors="strict", a DataError naming the line. Nothing here prints: warnings go to the
caller's `warn` callback.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import select
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from nmt.checkpoint import load_model
from nmt.config import DecodeConfig, RuntimeConfig, max_tokens_for
from nmt.data.batching import batch_by_tokens
from nmt.data.shortlist import Shortlist
from nmt.data.vocab import Vocab
from nmt.device import resolve_device
from nmt.errors import CheckpointError, DataError, UsageError
from nmt.host_memory import INFERENCE_ONEDNN_CACHE, keep_freed_memory, size_onednn_cache
from nmt.inference import add_norm, backends, fused_attention, step_topk
from nmt.inference.decoding import DecodingWorkspace
from nmt.inference.search import (
    EnsembleStepDecoder,
    Hypothesis,
    beam_search,
    max_output_lengths,
    prefix_tensor,
    sample_decode,
)
from nmt.inference.workers import WorkerPool, check_workers, fork_safe_threads
from nmt.precision import resolve_precision
from nmt.special_ids import EOS_ID, PAD_ID

_R = RuntimeConfig()
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "int8": torch.float32}
# (1-based line number, source ids as translated, best hypothesis) -> anything
Observer = Callable[[int, list[int], Hypothesis], object]


@dataclass
class TranslateStats:
    """Counters for `--stats`: input lines, source/target tokens (incl. EOS), seconds."""

    sentences: int = 0
    src_tokens: int = 0
    tgt_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """One human line: sentences/s and target tokens/s."""
        secs = max(self.seconds, 1e-9)
        return (f"{self.sentences} sentences, {self.tgt_tokens} target tokens in "
                f"{self.seconds:.2f} s: {self.sentences / secs:.1f} sentences/s, "
                f"{self.tgt_tokens / secs:.1f} target tokens/s")


class Engine:
    """The translation engine (the API's `Translator`, nmt/api.py, wraps one): one model
    or an ensemble sharing a vocabulary, with the search settings."""

    def __init__(self, models: Sequence[torch.nn.Module], vocab: Vocab, cfg: DecodeConfig,
                 device: torch.device, max_src_len: int | None = None, seed: int = 1,
                 projections: Sequence[torch.nn.Module | None] | None = None,
                 precision: str | None = None, parameters: int | None = None) -> None:
        """`projections`: per model, a replacement for its vocabulary projection (int8
        models' int8 one), None for the default; `precision` the resolved one the models
        were cast to (reported, not applied here; None: named after their dtype);
        `parameters` the first model's, counted before its linears were packed or
        quantized (they then hold no parameters; None: count them now)."""
        self.models = list(models)
        self.parameters = parameters if parameters is not None else sum(
            p.numel() for p in self.models[0].parameters())
        dtype = next(self.models[0].parameters()).dtype
        self.precision = precision or next(
            (name for name, d in _DTYPES.items() if d == dtype), str(dtype))
        self.vocab = vocab
        self.device = device
        self.decode_cfg = self._resolved(cfg)
        # Decoder positions 0..max_len are used (BOS + max_len pieces), the encoder's
        # 0..len (pieces + EOS): both must stay below every model's max_positions.
        self.max_positions = min(m.config.max_positions for m in self.models)
        self.max_src_len = self.source_limit(max_src_len)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeds = SeedSequence(seed)  # per-batch sampling seeds, shared by configured copies
        self.pool: WorkerPool | None = None  # worker processes (`load(..., workers=N)`)
        self.shortlist: Shortlist | None = None  # candidates scored (`load(..., shortlist=)`)
        # One per model, for as long as this translator lives: each batch's decoder reuses
        # the memory the previous batch's left (and the packed output projection).
        projections = list(projections) if projections else [None] * len(self.models)
        self.workspaces = [DecodingWorkspace(m, p)
                           for m, p in zip(self.models, projections, strict=True)]

    def source_limit(self, max_src_len: int | None, name: str = "--max-src-len") -> int:
        """Source pieces kept per line: `max_src_len`, checked against the models'
        positions (UsageError naming the option `name`), or the most they take."""
        limit = self.max_positions - 1
        if max_src_len is not None and not 0 < max_src_len <= limit:
            raise UsageError(f"{name} must be in 1..{limit} (the model's positions minus "
                             f"EOS), got {max_src_len}")
        return max_src_len if max_src_len is not None else limit

    def configured(self, cfg: DecodeConfig, max_src_len: int | None = None,
                   name: str = "--max-src-len") -> Engine:
        """This translator with other search settings: a shallow copy sharing the models,
        their workspaces and the sampling generator, so use one of the two at a time."""
        other = copy.copy(self)
        other.decode_cfg = self._resolved(cfg)
        other.max_src_len = self.source_limit(max_src_len, name)
        return other

    def _resolved(self, cfg: DecodeConfig) -> DecodeConfig:
        """`cfg` with its batch size chosen for this device when it leaves it open."""
        if cfg.max_tokens is not None:
            return cfg
        return dataclasses.replace(cfg, max_tokens=max_tokens_for(self.device.type))

    @property
    def max_tokens(self) -> int:
        """Source tokens per batch (resolved: never None)."""
        assert self.decode_cfg.max_tokens is not None
        return self.decode_cfg.max_tokens

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes, if any (idempotent); the translator then decodes in
        this process."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def terminate(self) -> None:
        """Stop the worker processes at once (Ctrl-C, SIGTERM): running batches fail."""
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None

    @property
    def workers(self) -> int:
        """Processes decoding in parallel (1: this one)."""
        return 1 if self.pool is None else self.pool.workers

    def submit(self, sources: Sequence[Sequence[int]],
               prefixes: Sequence[Sequence[int]] | None = None, seed: int | None = None
               ) -> Future:
        """`translate_ids` as a future: run by a free worker process, or here and now
        when there are none (the future is then already done)."""
        if self.pool is not None:
            return self.pool.submit(self.decode_cfg, sources, prefixes, seed)
        future: Future = Future()
        try:
            future.set_result(self.translate_ids(sources, prefixes, seed=seed))
        except Exception as err:  # delivered by result(), as from a worker
            future.set_exception(err)
        return future

    @classmethod
    def load(cls, paths: Sequence[Path], cfg: DecodeConfig, device: str = _R.device,
             precision: str = _R.precision, max_src_len: int | None = None,
             seed: int = _R.seed, weights: str = _R.weights, workers: int = 1,
             threads: int = 1, shortlist: Path | None = None) -> Engine:
        """Load checkpoints safely (weights_only); an ensemble must share one vocabulary.
        `weights`: auto (a checkpoint's EMA weights where it has them), raw or ema (the
        choices and defaults: nmt.config.RuntimeConfig, which checks them).

        `workers` > 1 (CPU only) forks that many worker processes of `threads` torch
        threads each, sharing the loaded weights (nmt/inference/workers.py); close the
        translator (or use it as a context manager) to stop them. `shortlist`: a file of
        `nmt shortlist` (nmt/data/shortlist.py) made with the model's vocabulary."""
        if not paths:
            raise UsageError("no model given; pass -m MODEL (repeat it for an ensemble)")
        RuntimeConfig(device=device, precision=precision, weights=weights, seed=seed)
        dev = resolve_device(device)
        check_workers(workers, threads, dev.type)  # before the model is loaded
        with fork_safe_threads() if workers > 1 else nullcontext():
            engine = cls._load(paths, cfg, dev, precision, max_src_len, seed, weights)
            if shortlist is not None:
                engine.shortlist = Shortlist.load(shortlist, len(engine.vocab))
            if workers > 1:
                engine.pool = WorkerPool(engine, workers, threads)
        return engine

    @classmethod
    def _load(cls, paths: Sequence[Path], cfg: DecodeConfig, dev: torch.device,
              precision: str, max_src_len: int | None, seed: int, weights: str
              ) -> Engine:
        """`load` in this process (see there)."""
        if dev.type == "cpu":
            size_onednn_cache(INFERENCE_ONEDNN_CACHE)  # before the first oneDNN primitive
            keep_freed_memory()  # per-step activations reuse pages instead of re-faulting
            fused_attention.enabled()  # build or load the C kernels once, before forks
            step_topk.enabled()
            add_norm.enabled()
        precision = resolve_precision(precision, dev)  # auto -> bf16 / fp16 / fp32
        models, projections, vocab = [], [], None
        parameters = None
        for path in paths:
            model, model_vocab, _ = load_model(Path(path), dev, weights)
            if parameters is None:  # before packing or quantizing takes the weights out
                parameters = sum(p.numel() for p in model.parameters())
            if vocab is not None and model_vocab.proto != vocab.proto:
                raise CheckpointError(f"{path}: vocabulary differs from {paths[0]}; an "
                                      "ensemble needs models trained on one vocabulary")
            vocab = model_vocab
            model = model.to(_DTYPES[precision])
            models.append(model)
            projections.append(backends.prepare(model, precision))  # CPU: faster linears
        assert vocab is not None
        return cls(models, vocab, cfg, dev, max_src_len, seed, projections, precision,
                   parameters)

    def translate_ids(self, sources: Sequence[Sequence[int]],
                      prefixes: Sequence[Sequence[int]] | None = None, *,
                      seed: int | None = None) -> list[list[Hypothesis]]:
        """Search for each source (piece ids without EOS); one list of hypotheses each.
        `prefixes`, one per source (empty: none), are piece ids each output must start
        with (teacher-forced, counted in the scores); the length limit grows to fit them.
        `seed` restarts the sampling generator first (None: it goes on). With a shortlist
        only its candidates for these sources (and the prefixes' pieces) are scored."""
        if seed is not None:
            self.generator.manual_seed(seed)
        if self.shortlist is None:
            return self._search(sources, prefixes, None)
        wanted = self.shortlist.candidates([*sources, *(prefixes or [])])
        columns = torch.from_numpy(wanted).to(self.device)  # (V',) the specials first
        # prefixes as columns: each prefix piece is a candidate, found by bisection
        as_columns = (None if prefixes is None else
                      [np.searchsorted(wanted, np.asarray(p, dtype=np.int64)).tolist()
                       for p in prefixes])
        found = self._search(sources, as_columns, columns)
        return [[dataclasses.replace(h, tokens=wanted[h.tokens].tolist()) for h in hyps]
                for hyps in found]

    def _search(self, sources: Sequence[Sequence[int]],
                prefixes: Sequence[Sequence[int]] | None, columns: Tensor | None
                ) -> list[list[Hypothesis]]:
        """`translate_ids` over the vocabulary, or over `columns` (V',) of it: the
        hypotheses' tokens are then columns."""
        width = max(len(s) for s in sources) + 1
        src = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
        for row, ids in enumerate(sources):
            src[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            src[row, len(ids)] = EOS_ID
        src = src.to(self.device)  # (batch, src_len)
        cfg = self.decode_cfg
        cap = self.max_positions - 1
        max_lens = max_output_lengths(src, cfg.max_len_a, cfg.max_len_b, cap=cap)
        prefix = prefix_tensor(prefixes, self.device)  # (batch, P) or None
        if prefix is not None:
            if prefix.size(1) > cap:
                raise UsageError(f"a target prefix of {prefix.size(1)} pieces leaves no room "
                                 f"in the model's {cap} output positions; shorten it")
            room = (prefix != PAD_ID).sum(dim=1)  # (batch,) prefix lengths
            max_lens = torch.maximum(max_lens, room)
        with torch.inference_mode(), ExitStack() as members:  # closing them pools memory
            decoder = EnsembleStepDecoder([members.enter_context(w.decoder(src, columns))
                                           for w in self.workspaces])
            if not cfg.sampling:
                return beam_search(decoder, max_lens, beam=cfg.beam, alpha=cfg.alpha,
                                   nbest=cfg.nbest, min_len=cfg.min_len, prefix=prefix,
                                   early_stop=cfg.early_stop)
            rows = torch.arange(len(sources), device=self.device).repeat_interleave(cfg.nbest)
            # (batch * nbest,): independent samples, each sentence's nbest rows one group
            decoder.regroup(rows, cfg.nbest, None)  # the layout told: the cache reads none
            flat = sample_decode(decoder, max_lens[rows], temperature=cfg.temperature,
                                 top_k=cfg.top_k, top_p=cfg.top_p, alpha=cfg.alpha,
                                 min_len=cfg.min_len, generator=self.generator,
                                 prefix=None if prefix is None else prefix[rows])
        return [sorted(flat[i * cfg.nbest:(i + 1) * cfg.nbest], key=lambda h: -h.score)
                for i in range(len(sources))]


class SeedSequence:
    """The sampling seed of each batch, in the order batches are formed: batch k of a
    sequence started with seed s samples from a generator seeded with a number made of
    (s, k). Where a batch runs (which worker, in which order) then changes nothing."""

    def __init__(self, seed: int) -> None:
        self.restart(seed)

    def restart(self, seed: int) -> None:
        """Start again from batch 0 of `seed`."""
        self._seed, self._count = seed, itertools.count()

    def next(self) -> int:
        """The next batch's seed (a non-negative 63-bit number)."""
        return (self._seed * 1_000_003 + next(self._count)) % (1 << 63)


def read_lines(source: BinaryIO) -> Iterator[bytes]:
    """Raw lines split on b"\\n" only (the newline removed); a last line without a final
    newline is still a line. Reads as it goes, so a terminal gets line-by-line service."""
    return iter(LineReader(source))


class LineReader:
    """The lines of `read_lines`, and whether the next one is there already (`ready`),
    so that a translator with workers runs ahead while input keeps coming and answers
    before it would wait for more (a program that writes a line and reads its translation
    must get it). Reads with `read1` (what is there, up to 64 KiB) and checks the file
    descriptor with select(); a source without one (BytesIO) is always ready."""

    CHUNK = 1 << 16

    def __init__(self, source: BinaryIO) -> None:
        self._read = getattr(source, "read1", None) or source.read
        try:
            self._fd: int | None = source.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation included
            self._fd = None
        self._buffer = bytearray()
        self._start = 0  # the next line begins here; what is before was handed out
        self._eof = False

    def ready(self) -> bool:
        """Whether reading the next line would not wait for input (at the end: True)."""
        if self._eof or self._fd is None or self._buffer.find(b"\n", self._start) >= 0:
            return True
        try:
            return bool(select.select([self._fd], [], [], 0)[0])
        except (OSError, ValueError):  # not selectable: do not run ahead of it
            return False

    def __iter__(self) -> Iterator[bytes]:
        scan = 0  # no newline in the buffer between _start and here
        while True:
            end = self._buffer.find(b"\n", max(scan, self._start))
            if end < 0 and not self._eof:
                scan = len(self._buffer)
                if self._start:  # drop what was handed out before reading more
                    del self._buffer[:self._start]
                    scan -= self._start
                    self._start = 0
                chunk = self._read(self.CHUNK)
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True
                continue
            if end < 0:  # the end: a last line without a newline is still a line
                if self._start < len(self._buffer):
                    yield bytes(self._buffer[self._start:])
                self._buffer.clear()
                self._start = 0
                return
            line = bytes(self._buffer[self._start:end])
            self._start = end + 1
            yield line


def decode_line(raw: bytes, line_no: int, errors: str, source_name: str) -> str:
    """UTF-8 text of one line; strict mode names the line and byte offset."""
    try:
        return raw.decode("utf-8", errors="strict" if errors == "strict" else "replace")
    except UnicodeDecodeError as err:
        raise DataError(f"{source_name}: line {line_no}: invalid UTF-8 at byte {err.start} "
                        "(use --errors replace to substitute U+FFFD)") from err


def source_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Line indices (pieces per line in `lengths`) sorted by length and cut into batches of
    at most `max_tokens` padded source tokens, EOS included: training's `batch_by_tokens`
    with no target side, every line kept (an over-long one alone)."""
    src = np.asarray(lengths, dtype=np.int64)
    batches = batch_by_tokens(src, np.zeros_like(src), max_tokens, max_len=2 ** 62,
                              oversize_alone=True).batches
    return [b.tolist() for b in batches]


# Every character Python's str.splitlines() (and so many readers of our output) breaks a
# line at: \n \r \v \f, the file/group/record separators, NEL, LINE/PARAGRAPH SEPARATOR.
_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def sanitize(text: str) -> str:
    """Output text on one line for any reader: every line-break character becomes a space
    (a model can generate one from a piece holding it, or a sampled byte piece)."""
    return text.translate(_LINE_BREAKS)


def translate_stream(source: BinaryIO, sink: BinaryIO, translator: Engine, *,
                     buffer_size: int | None = None, interactive: bool = False,
                     errors: str = _R.errors, source_name: str = "<stdin>",
                     warn: Callable[[str], None] = lambda _msg: None,
                     observe: Observer | None = None, prefix_source: BinaryIO | None = None,
                     prefix_name: str = "<prefixes>") -> TranslateStats:
    """Translate every line of `source` into `sink`, one output line (or nbest lines) per
    input line, in order, flushing after each buffer; returns counters for --stats.

    `prefix_source` gives one target prefix per input line (`--prefix-file`; an empty line:
    none); it must have exactly as many lines as `source` (DataError naming it otherwise).

    `observe`, when given, is called for each translated (non-empty) line with its 1-based
    number, the source ids as translated (after truncation) and the best hypothesis, before
    that buffer's output is written (`--attention` draws its maps from it).

    With worker processes (`translator.pool`), the next buffer is read and its batches are
    queued while the workers finish the current one, so they never wait for the reader;
    the output is the same, written buffer by buffer in input order. If the translation
    stops (an error, Ctrl-C, SIGTERM), every buffer finished before is written first."""
    RuntimeConfig(errors=errors)  # a known mode, or UsageError
    size = 1 if interactive else (buffer_size or translator.decode_cfg.buffer_size)
    # Buffers in flight beyond the one being written: one when workers can run ahead.
    ahead = 0 if interactive or translator.pool is None else 1
    stats = TranslateStats()
    start = time.perf_counter()
    buffer: list[tuple[int, bytes]] = []
    pending: collections.deque[_PendingBuffer] = collections.deque()
    reader = LineReader(source)
    prefix_lines = None if prefix_source is None else read_lines(prefix_source)
    prefixes: list[str | None] | None = None if prefix_lines is None else []
    line_no = 0

    broken = False  # a buffer's batch failed: nothing after it may be written

    def write_next() -> None:
        nonlocal broken
        head = pending.popleft()
        try:
            head.write(sink, translator.decode_cfg.nbest, stats, observe)
        except BaseException:
            broken = True
            raise

    def start_buffer() -> None:
        texts = [decode_line(raw, n, errors, source_name) for n, raw in buffer]
        numbers = [n for n, _ in buffer]
        pending.append(_PendingBuffer(numbers, start_texts(
            translator, texts, prefixes=prefixes, line_numbers=numbers,
            source_name=source_name, warn=warn)))
        while len(pending) > ahead or (pending and not reader.ready()):
            write_next()  # before waiting for input, answer what came in

    try:
        for line_no, raw in enumerate(reader, start=1):
            buffer.append((line_no, raw))
            if prefix_lines is not None and prefixes is not None:
                prefix = next(prefix_lines, None)
                if prefix is None:
                    raise DataError(f"{prefix_name}: has {line_no - 1} lines, fewer than "
                                    f"{source_name}; give one prefix line per input line")
                prefixes.append(decode_line(prefix, line_no, errors, prefix_name))
            if len(buffer) >= size:
                start_buffer()
                buffer, prefixes = [], None if prefixes is None else []
        if buffer:
            start_buffer()
        if prefix_lines is not None and next(prefix_lines, None) is not None:
            raise DataError(f"{prefix_name}: has more lines than the {line_no} of "
                            f"{source_name}; give one prefix line per input line")
        while pending:
            write_next()
    except BaseException as err:
        # What was translated before the stop is not lost: an error of the input waits
        # for the buffers before it (as one process would have written them already); an
        # interrupt writes those already finished.
        finish = isinstance(err, Exception)
        while not broken and pending and (finish or pending[0].done()):
            try:
                write_next()
            except BaseException:
                break
        raise
    stats.seconds = time.perf_counter() - start
    return stats


@dataclass
class Translation:
    """One input line's result: hypotheses best first, their output texts (detokenized,
    on one line each: `sanitize`d) and the source piece ids as translated (after
    truncation; empty for an empty or whitespace-only line, which gets no hypothesis)."""

    hypotheses: list[Hypothesis]
    texts: list[str]
    source_ids: list[int]


def translate_texts(translator: Engine, texts: Sequence[str], *,
                    prefixes: Sequence[str | None] | None = None,
                    line_numbers: Sequence[int] | None = None, source_name: str = "<input>",
                    warn: Callable[[str], None] = lambda _msg: None) -> list[Translation]:
    """Translate `texts` (one sentence each) as one buffer: encode, truncate over-long
    sources (with a warning naming the line), sort and batch by length, search, detokenize.
    What `nmt translate` does to each buffer of its input, and what the Python API calls,
    so both give the same output for the same buffer.

    `prefixes`, one per text (None or "" for none): the output must start with that text
    (see `Engine.translate_ids`). `line_numbers` (1-based) name lines in warnings.
    """
    return start_texts(translator, texts, prefixes=prefixes, line_numbers=line_numbers,
                       source_name=source_name, warn=warn).result()


class PendingTexts:
    """The batches of one buffer of texts, queued (`start_texts`); `result()` waits for
    them and detokenizes."""

    def __init__(self, translator: Engine, count: int, sources: list[list[int]],
                 owners: list[int], futures: list[tuple[list[int], Future]]) -> None:
        self._translator, self._count = translator, count
        self._sources, self._owners, self._futures = sources, owners, futures

    def done(self) -> bool:
        """Whether every batch has finished (successfully or not)."""
        return all(future.done() for _, future in self._futures)

    def result(self) -> list[Translation]:
        """The translations, one per text, in order (waits for the batches; re-raises the
        first batch's error, in batch order)."""
        results: list[list[Hypothesis]] = [[] for _ in range(self._count)]
        for batch, future in self._futures:
            for j, sent_hyps in zip(batch, future.result(), strict=True):
                results[self._owners[j]] = sent_hyps
        # One sentencepiece call for the whole buffer, on this thread (its thread pool
        # costs about a millisecond per call: more than decoding a sentence).
        outputs = iter(self._translator.vocab.decode(
            [h.tokens for hyps in results for h in hyps], num_threads=1))
        source_of = dict(zip(self._owners, self._sources, strict=True))
        return [Translation(hyps, [sanitize(next(outputs)) for _ in hyps], source_of.get(i, []))
                for i, hyps in enumerate(results)]


def start_texts(translator: Engine, texts: Sequence[str], *,
                prefixes: Sequence[str | None] | None = None,
                line_numbers: Sequence[int] | None = None, source_name: str = "<input>",
                warn: Callable[[str], None] = lambda _msg: None) -> PendingTexts:
    """`translate_texts` up to the search: encode, truncate, batch, and hand the batches to
    the translator (its workers, or here and now); the longest sentences' batches go
    first, so the last to finish are short. Sampling seeds follow the batches' order by
    length (see `SeedSequence`), so no result depends on where or when a batch ran."""
    numbers = list(line_numbers) if line_numbers is not None else range(1, len(texts) + 1)
    nonempty = [i for i, text in enumerate(texts) if text]
    encoded = translator.vocab.encode([texts[i] for i in nonempty]) if nonempty else []
    prefix_ids: dict[int, list[int]] = {}  # position in `texts` -> prefix pieces
    if prefixes is not None:
        wanted = [i for i in nonempty if prefixes[i]]
        if wanted:
            prefix_ids = dict(zip(wanted, translator.vocab.encode(
                [str(prefixes[i]) for i in wanted]), strict=True))
    limit = translator.max_src_len
    sources: list[list[int]] = []
    owners: list[int] = []  # position in `texts` of each source
    for i, ids in zip(nonempty, encoded, strict=True):
        if not ids:
            continue  # whitespace only: nothing to translate
        if len(ids) > limit:
            warn(f"{source_name}: line {numbers[i]}: {len(ids)} source tokens exceed "
                 f"--max-src-len {limit}; truncated to the first {limit}")
            ids = ids[:limit]
        sources.append(ids)
        owners.append(i)
    batches = source_batches([len(s) for s in sources], translator.max_tokens)
    seeds = [translator.seeds.next() if translator.decode_cfg.sampling else None for _ in batches]
    futures: list[tuple[list[int], Future]] = []
    for batch, seed in reversed(list(zip(batches, seeds, strict=True))):  # longest first
        batch_prefixes = ([prefix_ids.get(owners[j], []) for j in batch] if prefix_ids
                          else None)
        future = translator.submit([sources[j] for j in batch], batch_prefixes, seed)
        futures.append((batch, future))
    futures.reverse()  # batch order: the first error raised is the first batch's
    return PendingTexts(translator, len(texts), sources, owners, futures)


@dataclass
class _PendingBuffer:
    """One buffer of `nmt translate`'s input on its way: its line numbers and batches."""

    numbers: list[int]
    texts: PendingTexts

    def done(self) -> bool:
        return self.texts.done()

    def write(self, sink: BinaryIO, nbest: int, stats: TranslateStats,
              observe: Observer | None) -> None:
        """Wait for the buffer, then write its lines in input order and flush."""
        results = self.texts.result()
        if observe is not None:
            for line_no, result in zip(self.numbers, results, strict=True):
                if result.hypotheses:
                    observe(line_no, result.source_ids, result.hypotheses[0])
        lines = [_format(line_no - 1, r.hypotheses, r.texts, nbest)
                 for line_no, r in zip(self.numbers, results, strict=True)]
        sink.write("".join(lines).encode("utf-8", errors="replace"))
        sink.flush()
        stats.sentences += len(self.numbers)
        stats.src_tokens += sum(len(r.source_ids) + 1 for r in results if r.source_ids)
        stats.tgt_tokens += sum(len(r.hypotheses[0].tokens) + 1 for r in results
                                if r.hypotheses)


def _format(index: int, hyps: list[Hypothesis], texts: list[str], nbest: int) -> str:
    """The output line (or nbest `index<TAB>score<TAB>text` lines) of one input line, from
    its hypotheses and their decoded `texts`."""
    if nbest == 1:
        return (texts[0] if texts else "") + "\n"
    out = []
    for k in range(nbest):
        if k < len(hyps):
            out.append(f"{index}\t{hyps[k].score:.4f}\t{texts[k]}\n")
        else:  # empty input line, or fewer hypotheses than asked
            out.append(f"{index}\t{0.0 if not hyps else float('-inf'):.4f}\t\n")
    return "".join(out)
