"""`nmt bpe DATA`: learn the joint BPE vocabulary, then binarize every split.

Steps, each skipped when DATA/bin/meta.json shows it done for the same inputs and settings:
1. check every split's source and target have as many lines;
2. train DATA/spm.model over train.src + train.tgt (sampled for big corpora), or, with
   `spm_from`, copy the sentencepiece model stored in an nmt checkpoint (or a .model file)
   so that data for fine-tuning gets the parent model's ids;
3. encode each split present (train, valid, test; both sides) into DATA/bin/*.npy, one
   token line per text line (prep's per-corpus line ranges stay valid).
meta.json is rewritten (atomically) after each step, so an interrupted run resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.cores import available_cores
from nmt.data.binarize import CHUNK_LINES, binarize_file, side_paths, token_dtype
from nmt.data.dataset import BIN_DIR, META_FILE, SPM_MODEL
from nmt.data.vocab import NORMALIZATION, Vocab, train_vocab
from nmt.errors import CheckpointError, DataError, UsageError
from nmt.fileio import atomic_write_bytes, count_lines, sha256_file

META_FORMAT = "nmt-bin-v1"
SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")


@dataclass(frozen=True)
class BpeConfig:
    """Settings of `nmt bpe`; the defaults the CLI shows."""

    vocab_size: int | None = None  # None: DATA/manifest.json's (the recipe's)
    sample: int = 2_000_000  # lines (both sides together) sentencepiece trains on; 0 = all
    threads: int = 0  # 0 = every core this process may use
    seed: int = 1  # sentencepiece's sampling seed
    chunk_lines: int = CHUNK_LINES
    spm_from: Path | None = None  # a checkpoint (or .model) whose vocabulary to reuse

    def __post_init__(self) -> None:
        if self.spm_from is not None and self.vocab_size is not None:
            raise UsageError("--vocab-size and --spm-from exclude each other: the model's "
                             "vocabulary is used as it is")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise UsageError(f"--vocab-size must be positive, got {self.vocab_size}")
        if self.sample < 0:
            raise UsageError(f"--sample must be >= 0 (0 = every line), got {self.sample}")
        if self.threads < 0:
            raise UsageError(f"--threads must be >= 0 (0 = all cores), got {self.threads}")
        if self.chunk_lines < 1:
            raise UsageError(f"chunk_lines must be positive, got {self.chunk_lines}")


def _fingerprint(path: Path) -> dict[str, int]:
    """Cheap identity of an input file: size and modification time."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _manifest_vocab_size(data_dir: Path) -> int | None:
    path = data_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"{path}: unreadable manifest ({err}); re-run `nmt prep` or pass "
                        "--vocab-size") from err
    if value is not None and (not isinstance(value, int) or value < 1):
        raise DataError(f"{path}: vocab_size must be a positive integer, found {value!r}")
    return value


def _present_splits(data_dir: Path) -> list[str]:
    """Splits with both text files; one side alone is an error."""
    present = []
    for split in SPLITS:
        files = [data_dir / f"{split}.{side}" for side in SIDES]
        exists = [f.is_file() for f in files]
        if any(exists) and not all(exists):
            missing = files[exists.index(False)]
            raise DataError(f"{missing}: no such file, but {files[exists.index(True)].name} "
                            "exists; re-run `nmt prep`")
        if all(exists):
            present.append(split)
    if "train" not in present:
        raise DataError(f"{data_dir / 'train.src'}: no such file; run `nmt prep` first "
                        "(DATA must hold train.src and train.tgt)")
    return present


def _check_line_counts(data_dir: Path, splits: list[str]) -> dict[str, int]:
    counts = {}
    for split in splits:
        src, tgt = (data_dir / f"{split}.{side}" for side in SIDES)
        n_src, n_tgt = count_lines(src), count_lines(tgt)
        if n_src != n_tgt:
            raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt} lines; the sides "
                            "of a split must be line-aligned (re-run `nmt prep`)")
        counts[split] = n_src
    return counts


def _read_old_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else {}


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(path, lambda handle: handle.write(text.encode("utf-8")))


def spm_model_from(path: Path) -> bytes:
    """The sentencepiece model (serialized proto) of an nmt checkpoint, read safely (no
    pickled code runs), or of a `.model` file. CheckpointError (exit 6) for a checkpoint
    that is unreadable, unsafe or carries no valid model; DataError for a bad .model."""
    path = Path(path)
    if path.suffix == ".model":
        try:
            proto = path.read_bytes()
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err.strerror or err})") from err
        try:
            Vocab(proto)
        except DataError as err:
            raise DataError(f"{path}: {err}") from err
        return proto
    from nmt.checkpoint import load_checkpoint  # torch only when a checkpoint is read

    proto = load_checkpoint(path, mmap=True).get("vocab")
    if not isinstance(proto, (bytes, bytearray)):
        raise CheckpointError(f"{path}: its vocab is not a sentencepiece model "
                              f"(found {type(proto).__name__}); not an nmt checkpoint")
    try:
        Vocab(bytes(proto))
    except DataError as err:
        raise CheckpointError(f"{path}: {err}") from err
    return bytes(proto)


def _adopt_vocab(data_dir: Path, source: Path, old: dict[str, Any],
                 report: Callable[[str], None]) -> tuple[Vocab, dict]:
    """DATA/spm.model := the model inside `source` (a checkpoint or .model); also writes
    the human-readable spm.vocab beside it, as training does."""
    import sentencepiece as spm

    proto = spm_model_from(source)
    settings = {"spm_from": str(source.resolve()),
                "spm_sha256": hashlib.sha256(proto).hexdigest()}
    model_path = data_dir / SPM_MODEL
    vocab = Vocab(proto)
    if old.get("vocab_settings") == settings and model_path.is_file() \
            and sha256_file(model_path) == settings["spm_sha256"]:
        report(f"{model_path}: up to date ({len(vocab)} pieces, from {source})")
        return vocab, settings
    processor = spm.SentencePieceProcessor(model_proto=proto)
    listing = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
                      for i in range(len(vocab)))
    atomic_write_bytes(model_path.with_suffix(".vocab"), lambda f: f.write(listing.encode()))
    atomic_write_bytes(model_path, lambda f: f.write(proto))
    report(f"{model_path}: the {len(vocab)}-piece model of {source}, not trained")
    return vocab, settings


def _ensure_vocab(data_dir: Path, cfg: BpeConfig, vocab_size: int | None, threads: int,
                  old: dict[str, Any], report: Callable[[str], None]) -> tuple[Vocab, dict]:
    """The current DATA/spm.model if `old` meta shows it made from these inputs and
    settings, else a newly trained one. Returns (vocab, settings to record)."""
    if cfg.spm_from is not None:
        return _adopt_vocab(data_dir, Path(cfg.spm_from), old, report)
    assert vocab_size is not None, "run_bpe resolves the size before training"
    model_path = data_dir / SPM_MODEL
    train_inputs = [data_dir / f"train.{side}" for side in SIDES]
    settings = {"vocab_size": vocab_size, "sample": cfg.sample, "seed": cfg.seed,
                "model_type": "bpe", "normalization": NORMALIZATION, "byte_fallback": True,
                "inputs": {p.name: _fingerprint(p) for p in train_inputs}}
    if (old.get("vocab_settings") == settings and model_path.is_file()
            and sha256_file(model_path) == old.get("spm_sha256")):
        vocab = Vocab.from_file(model_path)
        report(f"{model_path}: up to date ({len(vocab)} pieces), not retrained")
        return vocab, settings
    report(f"training joint BPE ({vocab_size} pieces, sample {cfg.sample or 'all'} lines, "
           f"{threads} threads) on {', '.join(p.name for p in train_inputs)}")
    start = time.perf_counter()
    vocab = train_vocab(train_inputs, model_path, vocab_size, sample=cfg.sample,
                        threads=threads, seed=cfg.seed)
    report(f"{model_path}: {len(vocab)} pieces trained in {time.perf_counter() - start:.0f} s; "
           "encoding")
    return vocab, settings


def _binarize_split(data_dir: Path, split: str, lines: int, vocab: Vocab, threads: int,
                    chunk_lines: int) -> dict[str, Any]:
    """Encode both sides of `split` into DATA/bin; returns its meta.json entry."""
    entry: dict[str, Any] = {"lines": lines, "inputs": _split_inputs(data_dir, split)}
    for side in SIDES:
        text = data_dir / f"{split}.{side}"
        stats = binarize_file(vocab, text, data_dir / BIN_DIR / f"{split}.{side}",
                              threads=threads, chunk_lines=chunk_lines)
        if stats.lines != lines:
            raise DataError(f"{text}: changed while being encoded ({lines} lines, then "
                            f"{stats.lines}); run `nmt bpe` again")
        entry[f"{side}_tokens"] = stats.tokens
    return entry


def _split_inputs(data_dir: Path, split: str) -> dict[str, dict[str, int]]:
    return {f"{split}.{side}": _fingerprint(data_dir / f"{split}.{side}") for side in SIDES}


def run_bpe(data_dir: Path, cfg: BpeConfig = BpeConfig(),
            report: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Learn DATA/spm.model and write DATA/bin; returns the metadata written to meta.json.

    `report` receives one-line progress messages (the CLI prints them on stderr). Inputs
    are recognised as unchanged by size and modification time.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: no such directory; run `nmt prep` first")
    vocab_size = None if cfg.spm_from else cfg.vocab_size or _manifest_vocab_size(data_dir)
    if vocab_size is None and cfg.spm_from is None:
        raise UsageError(f"{data_dir / 'manifest.json'} gives no vocab_size; pass "
                         "--vocab-size N")
    threads = cfg.threads or available_cores()
    splits = _present_splits(data_dir)
    line_counts = _check_line_counts(data_dir, splits)

    bin_dir = data_dir / BIN_DIR
    bin_dir.mkdir(exist_ok=True)
    meta_path = bin_dir / META_FILE
    old = _read_old_meta(meta_path)
    vocab, settings = _ensure_vocab(data_dir, cfg, vocab_size, threads, old, report)
    spm_sha = hashlib.sha256(vocab.proto).hexdigest()
    if old.get("spm_sha256") != spm_sha:
        old = {}  # a new model invalidates every binarized split
    meta: dict[str, Any] = {
        "format": META_FORMAT, "spm_model": SPM_MODEL, "spm_sha256": spm_sha,
        "vocab_size": len(vocab), "dtype": token_dtype(len(vocab)).name,
        "vocab_settings": settings, "splits": {},
    }
    _write_meta(meta_path, meta)

    for split in splits:
        done = old.get("splits", {}).get(split)
        outputs = [p for side in SIDES for p in side_paths(bin_dir / f"{split}.{side}")]
        if (done and done.get("inputs") == _split_inputs(data_dir, split)
                and all(p.is_file() for p in outputs)):
            meta["splits"][split] = done
            report(f"{split}: up to date ({done['lines']} lines), skipped")
        else:
            meta["splits"][split] = _binarize_split(data_dir, split, line_counts[split],
                                                    vocab, threads, cfg.chunk_lines)
            entry = meta["splits"][split]
            report(f"{split}: {entry['lines']} lines, {entry['src_tokens']} source and "
                   f"{entry['tgt_tokens']} target tokens")
        _write_meta(meta_path, meta)
    return meta
