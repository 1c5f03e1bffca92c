"""Read-only, memory-mapped access to what `nmt bpe DATA` wrote under DATA/bin, and the
training split's corpora (line ranges and sampling weights) from DATA/manifest.json.

Nothing is loaded into memory up front: a corpus of any size opens at once, and every
training process shares the same pages. Files are checked on open (shapes, dtypes,
offsets start at 0, never decrease, end at the token count; both sides have as many lines).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nmt.data.binarize import side_paths
from nmt.data.vocab import Vocab
from nmt.errors import DataError

BIN_DIR = "bin"
META_FILE = "meta.json"
SPM_MODEL = "spm.model"
MANIFEST_FILE = "manifest.json"  # written by `nmt prep`
_CHECK_CHUNK = 1 << 22  # offsets checked this many at a time (bounded temporaries)


def _hint(data_dir: Path | str) -> str:
    return f"run `nmt bpe {data_dir}` first"


def _load_npy(path: Path, data_dir: Path | str) -> np.ndarray:
    """Memory-map a 1-D .npy file (an empty array cannot be mapped and is read instead)."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; {_hint(data_dir)}")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as err:
        if "empty" not in str(err).lower():
            raise DataError(f"{path}: not a valid .npy array ({err}); {_hint(data_dir)}") \
                from err
        array = np.load(path, allow_pickle=False)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err}); {_hint(data_dir)}") \
            from err
    if array.ndim != 1:
        raise DataError(f"{path}: expected a 1-D array, found shape {array.shape}; "
                        f"{_hint(data_dir)}")
    return array


def _check_offsets(offsets: np.ndarray, n_tokens: int, path: Path) -> None:
    """Offsets start at 0, never decrease and end at the token count."""
    if offsets.dtype != np.int64 or len(offsets) == 0:
        raise DataError(f"{path}: offsets must be a non-empty int64 array, found "
                        f"{offsets.dtype} of length {len(offsets)}")
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise DataError(f"{path}: offsets run from {offsets[0]} to {offsets[-1]} but the "
                        f"tokens file holds {n_tokens} ids; rebuild with `nmt bpe`")
    for start in range(0, len(offsets) - 1, _CHECK_CHUNK):
        window = np.asarray(offsets[start:start + _CHECK_CHUNK + 1])
        bad = np.flatnonzero(np.diff(window) < 0)
        if len(bad):
            raise DataError(f"{path}: offsets decrease at line {start + int(bad[0])}; "
                            "rebuild with `nmt bpe`")


class TokenArray:
    """One side of one split: `arr[i]` is line i's ids (no EOS), `arr.lengths` all lengths."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, name: str = "<memory>") -> None:
        self.tokens = tokens  # (total_tokens,) uint16 or int32
        self.offsets = offsets  # (lines + 1,) int64
        self.name = name
        self._lengths: np.ndarray | None = None

    @classmethod
    def open(cls, prefix: Path) -> TokenArray:
        """Memory-map PREFIX.tokens.npy and PREFIX.offsets.npy (e.g. DATA/bin/train.src)."""
        prefix = Path(prefix)
        data_dir = prefix.parent.parent
        tokens_path, offsets_path = side_paths(prefix)
        tokens = _load_npy(tokens_path, data_dir)
        if tokens.dtype not in (np.uint16, np.int32):
            raise DataError(f"{tokens_path}: token ids must be uint16 or int32, found "
                            f"{tokens.dtype}; {_hint(data_dir)}")
        offsets = _load_npy(offsets_path, data_dir)
        _check_offsets(offsets, len(tokens), offsets_path)
        return cls(tokens, offsets, str(prefix))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"line {index} out of range for {self.name} ({n} lines)")
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every line, without EOS: int64 of shape (lines,)."""
        if self._lengths is None:
            self._lengths = np.diff(self.offsets).astype(np.int64)  # (lines,)
        return self._lengths

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype of the ids."""
        return self.tokens.dtype


def read_meta(data_dir: Path) -> dict[str, Any]:
    """DATA/bin/meta.json as written by `nmt bpe`."""
    path = Path(data_dir) / BIN_DIR / META_FILE
    if not path.is_file():
        raise DataError(f"{path}: no such file; {_hint(data_dir)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err}); {_hint(data_dir)}") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict):
        raise DataError(f"{path}: not an `nmt bpe` metadata file; {_hint(data_dir)}")
    return meta


class ParallelData:
    """A split's aligned source and target arrays: pair i is (src[i], tgt[i])."""

    def __init__(self, src: TokenArray, tgt: TokenArray, split: str = "") -> None:
        if len(src) != len(tgt):
            raise DataError(f"{src.name} has {len(src)} lines but {tgt.name} has "
                            f"{len(tgt)}; rebuild with `nmt bpe`")
        self.src = src
        self.tgt = tgt
        self.split = split

    @classmethod
    def open(cls, data_dir: Path, split: str) -> ParallelData:
        """Open DATA/bin/{split}.src and .tgt, checked against DATA/bin/meta.json."""
        data_dir = Path(data_dir)
        meta = read_meta(data_dir)
        if split not in meta["splits"]:
            have = ", ".join(sorted(meta["splits"])) or "none"
            raise DataError(f"{data_dir / BIN_DIR / META_FILE}: no binarized split "
                            f"{split!r} (have: {have}); {_hint(data_dir)}")
        src = TokenArray.open(data_dir / BIN_DIR / f"{split}.src")
        tgt = TokenArray.open(data_dir / BIN_DIR / f"{split}.tgt")
        info = meta["splits"][split]
        for side, arr in (("src", src), ("tgt", tgt)):
            expected = (info.get("lines"), info.get(f"{side}_tokens"))
            if expected != (len(arr), len(arr.tokens)):
                raise DataError(f"{arr.name}: holds {len(arr)} lines / {len(arr.tokens)} ids "
                                f"but meta.json says {expected[0]} / {expected[1]}; "
                                f"{_hint(data_dir)}")
        return cls(src, tgt, split)

    def __len__(self) -> int:
        return len(self.src)


def load_vocab(data_dir: Path) -> Vocab:
    """DATA/spm.model, checked against the hash the binarized data was made with."""
    data_dir = Path(data_dir)
    path = data_dir / SPM_MODEL
    if not path.is_file():
        raise DataError(f"{path}: no such file; {_hint(data_dir)}")
    proto = path.read_bytes()
    meta_path = data_dir / BIN_DIR / META_FILE
    if meta_path.is_file():
        expected = read_meta(data_dir).get("spm_sha256")
        if expected and hashlib.sha256(proto).hexdigest() != expected:
            raise DataError(f"{path}: differs from the model {meta_path} was built with; "
                            f"{_hint(data_dir)} again")
    return Vocab(proto)


class CorpusRange(NamedTuple):
    """Training lines [start, stop) came from corpus `name`. `weight`: the recipe's sampling
    weight, or None when the recipe gives none (see `corpus_ranges`)."""

    name: str
    start: int
    stop: int
    weight: float | None


def corpus_ranges(data_dir: Path) -> list[CorpusRange]:
    """The training split's corpora, in line order, covering lines 0..N-1 exactly.

    From the `splits.train.corpora` entries `nmt prep` writes into DATA/manifest.json;
    `nmt bpe` keeps one binarized line per text line, so the ranges index
    ParallelData.open(DATA, "train") directly. A DATA dir without such entries (made by hand
    or by an older nmt) is one unweighted corpus spanning the whole binarized split.

    Sampling contract for the trainer: with no weights (all None) an epoch visits every
    pair once, as without this function. With weights, an epoch has as many pairs as the
    training split (N), and corpus i supplies a share w_i / sum(w) of them (fairseq's
    sampling ratios; 0.5/0.25/0.25 equals 2/1/1): a corpus whose share exceeds its size
    is repeated, a smaller share is a sample of it. `epoch_shares` gives the shares.
    DataError when the manifest and DATA/bin disagree (re-run `nmt prep` / `nmt bpe`).
    """
    data_dir = Path(data_dir)
    train = _manifest_train(data_dir)
    meta_lines, meta_bytes = _binarized_train(data_dir)
    entries = train.get("corpora") if train else None
    if not entries or not all(isinstance(e, dict) and "lines" in e for e in entries):
        if meta_lines is None:
            raise DataError(f"{data_dir / BIN_DIR / META_FILE}: no binarized training "
                            f"split; {_hint(data_dir)}")
        return [CorpusRange("train", 0, meta_lines, None)]
    path = data_dir / MANIFEST_FILE
    ranges, start = [], 0
    for entry in entries:
        name, lines, weight = entry.get("name"), entry.get("lines"), entry.get("weight")
        if not isinstance(name, str) or not isinstance(lines, int) or lines < 0 or \
                entry.get("start", start) != start or not (
                    weight is None or (isinstance(weight, (int, float)) and weight > 0)):
            raise DataError(f"{path}: malformed training corpus entry {entry!r}; re-run "
                            "`nmt prep`")
        ranges.append(CorpusRange(name, start, start + lines, weight))
        start += lines
    if start != train.get("lines"):
        raise DataError(f"{path}: training corpora add up to {start} lines but the split "
                        f"has {train.get('lines')}; re-run `nmt prep`")
    if len({r.weight is None for r in ranges}) > 1:
        raise DataError(f"{path}: some training corpora have a weight and some not; re-run "
                        "`nmt prep`")
    text_bytes = train.get("src", {}).get("bytes")
    if (meta_lines is not None and meta_lines != start) or (
            meta_bytes is not None and text_bytes is not None and meta_bytes != text_bytes):
        raise DataError(f"{data_dir / BIN_DIR / META_FILE}: the binarized training split was "
                        f"made from other text than {path} describes; run `nmt bpe "
                        f"{data_dir}` again")
    return ranges


def epoch_shares(ranges: list[CorpusRange]) -> list[float]:
    """The fraction of an epoch's pairs each corpus supplies: the normalised weights, or
    each corpus's own share of the lines when unweighted."""
    if any(r.weight is None for r in ranges):
        total = sum(r.stop - r.start for r in ranges)
        return [(r.stop - r.start) / total if total else 0.0 for r in ranges]
    weight_sum = sum(float(r.weight or 0.0) for r in ranges)
    return [float(r.weight or 0.0) / weight_sum for r in ranges]


def language_pair(data_dir: Path) -> tuple[str, str]:
    """(source, target) language codes `nmt prep` recorded in DATA/manifest.json, ("", "")
    when there is no manifest or it names none; checkpoints carry them so that a server
    can route requests by language pair."""
    path = data_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""
    if not isinstance(manifest, dict):
        return "", ""
    return str(manifest.get("src_lang") or ""), str(manifest.get("tgt_lang") or "")


def _manifest_train(data_dir: Path) -> dict[str, Any] | None:
    """DATA/manifest.json's `splits.train` entry (None without a manifest)."""
    path = data_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err}); re-run `nmt prep`") from err
    train = manifest.get("splits", {}).get("train") if isinstance(manifest, dict) else None
    return train if isinstance(train, dict) else None


def _binarized_train(data_dir: Path) -> tuple[int | None, int | None]:
    """(lines, bytes of the train.src it was encoded from) of DATA/bin's training split per
    meta.json; None for what is not known (before `nmt bpe`)."""
    if not (data_dir / BIN_DIR / META_FILE).is_file():
        return None, None
    train = read_meta(data_dir)["splits"].get("train")
    if not isinstance(train, dict):
        return None, None
    size = train.get("inputs", {}).get("train.src", {}).get("size")
    return train.get("lines"), size
