"""Text file -> memory-mappable token arrays (flat ids + offsets), streamed in chunks.

One side of one split becomes two `.npy` files: `PREFIX.tokens.npy`, every line's piece ids
concatenated (no EOS; uint16 when the vocabulary fits, else int32), and `PREFIX.offsets.npy`,
int64 of length lines + 1 starting at 0, so line i is tokens[offsets[i]:offsets[i + 1]].
Both are written as a stream (header placeholder, chunks, final header), so memory stays
flat whatever the corpus size, and atomically (temp file + rename).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from nmt.data.vocab import Vocab
from nmt.errors import DataError
from nmt.fileio import atomic_write_bytes

UINT16_MAX_PIECES = 65535  # vocabularies up to this size are stored as uint16
CHUNK_LINES = 65536  # lines encoded per sentencepiece call: big enough for its thread pool
_NPY_HEADER_BYTES = 128  # fixed .npy v1.0 header size (multiple of 64, room for any length)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (<= 65535 pieces), else int32."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_MAX_PIECES else np.dtype(np.int32)


def _first_bad_line(path: Path) -> int:
    """1-based number of the first line that is not valid UTF-8 (0 if none)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _strip_line_end(line: str) -> str:
    """Drop one '\n' and then one '\r' (CRLF); nothing else."""
    if line.endswith("\n"):
        line = line[:-1]
    return line[:-1] if line.endswith("\r") else line


def read_line_chunks(path: Path, chunk_lines: int = CHUNK_LINES) -> Iterator[list[str]]:
    """Lists of up to `chunk_lines` lines without their line ends.

    Only '\\n' ends a line (no universal-newline translation, so a stray '\\r' or U+2028
    inside a segment cannot shift the alignment with the other side); a trailing '\\r'
    (CRLF files) is dropped.
    """
    try:
        with open(path, encoding="utf-8", newline="\n") as handle:
            while chunk := list(itertools.islice(handle, chunk_lines)):
                yield [_strip_line_end(line) for line in chunk]
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{_first_bad_line(path)}: not valid UTF-8; "
                        "re-run `nmt prep` or fix the file") from err
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from err


class NpyStreamWriter:
    """Appends 1-D chunks to an open binary file as one `.npy` array of unknown length.

    A fixed-size header is written first and rewritten with the true length by `close()`,
    so no chunk is ever held twice and the result loads with `np.load(mmap_mode="r")`.
    """

    def __init__(self, handle: BinaryIO, dtype: np.dtype) -> None:
        self._handle = handle
        self._dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 \
            else np.dtype(dtype)
        self.length = 0
        handle.write(self._header(0))

    def _header(self, length: int) -> bytes:
        text = repr({"descr": np.lib.format.dtype_to_descr(self._dtype),
                     "fortran_order": False, "shape": (length,)})
        body_len = _NPY_HEADER_BYTES - 10  # magic (6) + version (2) + header length (2)
        body = text.ljust(body_len - 1).encode("latin1") + b"\n"
        assert len(body) == body_len and ast.literal_eval(text)["shape"] == (length,)
        return b"\x93NUMPY\x01\x00" + body_len.to_bytes(2, "little") + body

    def write(self, chunk: np.ndarray) -> None:
        """Append the elements of a 1-D array (cast to the writer's dtype)."""
        self._handle.write(np.ascontiguousarray(chunk, dtype=self._dtype).tobytes())
        self.length += len(chunk)

    def close(self) -> None:
        """Write the final header (true length) over the placeholder."""
        end = self._handle.tell()
        self._handle.seek(0)
        self._handle.write(self._header(self.length))
        self._handle.seek(end)


@dataclass(frozen=True)
class SideStats:
    """What binarizing one text file produced."""

    lines: int
    tokens: int


def encode_chunks(vocab: Vocab, path: Path, dtype: np.dtype, threads: int,
                  chunk_lines: int = CHUNK_LINES) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(flat ids, per-line lengths) for successive chunks of `path`."""
    for lines in read_line_chunks(path, chunk_lines):
        ids = vocab.encode(lines, num_threads=threads)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))  # (lines,)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype,
                           count=int(lengths.sum()))  # (tokens,)
        yield flat, lengths


def side_paths(prefix: Path) -> tuple[Path, Path]:
    """(tokens .npy, offsets .npy) paths of one side, e.g. bin/train.src."""
    return (prefix.with_name(prefix.name + ".tokens.npy"),
            prefix.with_name(prefix.name + ".offsets.npy"))


def binarize_file(vocab: Vocab, text_path: Path, out_prefix: Path, *, threads: int = 1,
                  chunk_lines: int = CHUNK_LINES) -> SideStats:
    """Encode `text_path` into `out_prefix`.tokens.npy / .offsets.npy (atomic, streamed)."""
    dtype = token_dtype(len(vocab))
    tokens_path, offsets_path = side_paths(Path(out_prefix))
    stats: dict[str, int] = {}

    def write_tokens(tokens_handle: BinaryIO) -> None:
        def write_offsets(offsets_handle: BinaryIO) -> None:
            tokens = NpyStreamWriter(tokens_handle, dtype)
            offsets = NpyStreamWriter(offsets_handle, np.dtype(np.int64))
            offsets.write(np.zeros(1, dtype=np.int64))
            for flat, lengths in encode_chunks(vocab, text_path, dtype, threads, chunk_lines):
                offsets.write(tokens.length + np.cumsum(lengths))  # (lines,) end positions
                tokens.write(flat)
            tokens.close()
            offsets.close()
            stats.update(lines=offsets.length - 1, tokens=tokens.length)

        atomic_write_bytes(offsets_path, write_offsets)

    try:
        atomic_write_bytes(tokens_path, write_tokens)
    except OSError as err:
        raise DataError(f"{tokens_path}: cannot write ({err.strerror or err}); "
                        "free disk space or fix permissions") from err
    return SideStats(lines=stats["lines"], tokens=stats["tokens"])
