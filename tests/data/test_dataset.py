"""Binarized arrays: the streamed .npy writer, TokenArray / ParallelData, and their errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from nmt.data.binarize import (
    NpyStreamWriter,
    binarize_file,
    read_line_chunks,
    token_dtype,
)
from nmt.data.dataset import ParallelData, TokenArray, load_vocab
from nmt.data.vocab import Vocab, train_vocab
from nmt.errors import DataError
from nmt.fileio import count_lines


def _write_side(prefix: Path, lines: list[list[int]], dtype=np.uint16) -> None:
    """Write one side the way `nmt bpe` does, from explicit id lists."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    flat = np.array([i for line in lines for i in line], dtype=dtype)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lines])]).astype(np.int64)
    np.save(prefix.with_name(prefix.name + ".tokens.npy"), flat)
    np.save(prefix.with_name(prefix.name + ".offsets.npy"), offsets)


def _write_split(data: Path, split: str, src: list[list[int]], tgt: list[list[int]]) -> None:
    _write_side(data / "bin" / f"{split}.src", src)
    _write_side(data / "bin" / f"{split}.tgt", tgt)
    meta = {"splits": {split: {"lines": len(src), "src_tokens": sum(map(len, src)),
                               "tgt_tokens": sum(map(len, tgt))}}}
    (data / "bin" / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("sizes", [[], [0], [5, 0, 3], [1000, 1]])
def test_npy_stream_writer_matches_np_save(tmp_path, dtype, sizes):
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 60000, size=n).astype(dtype) for n in sizes]
    path = tmp_path / "a.npy"
    with open(path, "wb") as handle:
        writer = NpyStreamWriter(handle, np.dtype(dtype))
        for chunk in chunks:
            writer.write(chunk)
        writer.close()
    expected = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    loaded = np.load(path)
    assert loaded.dtype == np.dtype(dtype) and np.array_equal(loaded, expected)
    if len(expected):
        mapped = np.load(path, mmap_mode="r")
        assert isinstance(mapped, np.memmap) and np.array_equal(mapped, expected)


def test_token_dtype_boundary():
    assert token_dtype(8000) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.int32


def test_count_lines_and_chunks_split_only_on_newline(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("a\rb\nc\u2028d\r\n\nx\r\r\nlast".encode())
    assert count_lines(path) == 5
    chunks = list(read_line_chunks(path, chunk_lines=3))
    assert chunks == [["a\rb", "c\u2028d", ""], ["x\r", "last"]]
    empty = tmp_path / "e.txt"
    empty.write_bytes(b"")
    assert count_lines(empty) == 0 and list(read_line_chunks(empty)) == []


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok\nfine\n\xff\xfe broken\n")
    with pytest.raises(DataError, match=r"bad.txt:3: not valid UTF-8"):
        list(read_line_chunks(path))


@pytest.fixture(scope="module")
def val_vocab(tmp_path_factory) -> Vocab:
    from conftest import shared_data_path

    data = shared_data_path("multi30k")
    out = tmp_path_factory.mktemp("v") / "spm.model"
    return train_vocab([data / "val.en", data / "val.de"], out, 1000, threads=1)


def test_binarize_real_file_matches_direct_encoding(tmp_path, val_vocab, multi30k_dir):
    text = multi30k_dir / "val.de"
    (tmp_path / "bin").mkdir()
    stats = binarize_file(val_vocab, text, tmp_path / "bin" / "x", chunk_lines=100)
    lines = text.read_text(encoding="utf-8").split("\n")[:-1]
    expected = val_vocab.encode(lines)
    arr = TokenArray.open(tmp_path / "bin" / "x")
    assert stats.lines == len(arr) == len(lines) == 1014
    assert stats.tokens == len(arr.tokens) == sum(map(len, expected))
    assert arr.dtype == np.uint16 and isinstance(arr.tokens, np.memmap)
    assert arr.lengths.dtype == np.int64
    assert arr.lengths.tolist() == [len(x) for x in expected]
    assert [arr[i].tolist() for i in (0, 500, -1)] == [expected[0], expected[500], expected[-1]]
    assert val_vocab.decode([arr[i] for i in range(len(arr))]) == lines


def test_token_array_indexing_and_lengths(tmp_path):
    lines = [[5, 6, 7], [], [9], [65534, 4]]
    _write_side(tmp_path / "bin" / "s", lines)
    arr = TokenArray.open(tmp_path / "bin" / "s")
    assert len(arr) == 4
    assert arr.lengths.tolist() == [3, 0, 1, 2]
    assert [arr[i].tolist() for i in range(4)] == lines
    assert arr[-1].tolist() == lines[-1]
    with pytest.raises(IndexError):
        arr[4]
    with pytest.raises(IndexError):
        arr[-5]


def test_int32_tokens_are_accepted_and_other_dtypes_refused(tmp_path):
    _write_side(tmp_path / "bin" / "big", [[70000, 4], [100000]], dtype=np.int32)
    arr = TokenArray.open(tmp_path / "bin" / "big")
    assert arr.dtype == np.int32 and arr[1].tolist() == [100000]
    _write_side(tmp_path / "bin" / "f", [[1.5]], dtype=np.float32)
    with pytest.raises(DataError, match="uint16 or int32"):
        TokenArray.open(tmp_path / "bin" / "f")


def test_empty_side_opens(tmp_path):
    _write_side(tmp_path / "bin" / "e", [])
    arr = TokenArray.open(tmp_path / "bin" / "e")
    assert len(arr) == 0 and arr.lengths.tolist() == []


def test_missing_files_say_run_nmt_bpe(tmp_path):
    with pytest.raises(DataError, match=r"train.src.tokens.npy: no such file; run `nmt bpe"):
        TokenArray.open(tmp_path / "bin" / "train.src")
    with pytest.raises(DataError, match=r"meta.json: no such file; run `nmt bpe"):
        ParallelData.open(tmp_path, "train")
    with pytest.raises(DataError, match=r"spm.model: no such file; run `nmt bpe"):
        load_vocab(tmp_path)


def test_offsets_not_monotonic(tmp_path):
    _write_side(tmp_path / "bin" / "s", [[5, 6], [7]])
    np.save(tmp_path / "bin" / "s.offsets.npy", np.array([0, 2, 1, 3], dtype=np.int64))
    with pytest.raises(DataError, match="offsets decrease at line 1"):
        TokenArray.open(tmp_path / "bin" / "s")


def test_offsets_not_matching_tokens(tmp_path):
    _write_side(tmp_path / "bin" / "s", [[5, 6], [7]])
    np.save(tmp_path / "bin" / "s.offsets.npy", np.array([0, 2, 4], dtype=np.int64))
    with pytest.raises(DataError, match="offsets run from 0 to 4 but the tokens file holds 3"):
        TokenArray.open(tmp_path / "bin" / "s")
    np.save(tmp_path / "bin" / "s.offsets.npy", np.array([0, 2, 3], dtype=np.int32))
    with pytest.raises(DataError, match="int64"):
        TokenArray.open(tmp_path / "bin" / "s")


def test_corrupt_npy(tmp_path):
    _write_side(tmp_path / "bin" / "s", [[5]])
    (tmp_path / "bin" / "s.tokens.npy").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a valid .npy"):
        TokenArray.open(tmp_path / "bin" / "s")


def test_parallel_data_open_and_checks(tmp_path):
    _write_split(tmp_path, "valid", [[4, 5], [6]], [[7], [8, 9, 10]])
    pair = ParallelData.open(tmp_path, "valid")
    assert len(pair) == 2 and pair.tgt[1].tolist() == [8, 9, 10]
    with pytest.raises(DataError, match=r"no binarized split 'test' \(have: valid\)"):
        ParallelData.open(tmp_path, "test")
    # Sides of different lengths.
    _write_side(tmp_path / "bin" / "valid.tgt", [[7]])
    with pytest.raises(DataError, match="meta.json says 2"):
        ParallelData.open(tmp_path, "valid")
    src = TokenArray.open(tmp_path / "bin" / "valid.src")
    tgt = TokenArray.open(tmp_path / "bin" / "valid.tgt")
    with pytest.raises(DataError, match="has 2 lines but .* has 1"):
        ParallelData(src, tgt)


def test_load_vocab_detects_a_replaced_model(tmp_path, val_vocab):
    (tmp_path / "spm.model").write_bytes(val_vocab.proto)
    _write_split(tmp_path, "train", [[4]], [[5]])
    assert load_vocab(tmp_path).proto == val_vocab.proto  # no hash recorded: accepted
    meta = json.loads((tmp_path / "bin" / "meta.json").read_text())
    meta["spm_sha256"] = "0" * 64
    (tmp_path / "bin" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="differs from the model"):
        load_vocab(tmp_path)


def test_writer_header_is_fixed_size():
    handle = io.BytesIO()
    writer = NpyStreamWriter(handle, np.dtype(np.uint16))
    writer.write(np.arange(3, dtype=np.uint16))
    writer.close()
    assert handle.getvalue()[:6] == b"\x93NUMPY" and len(handle.getvalue()) == 128 + 6
