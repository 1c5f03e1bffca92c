"""`nmt bpe` on a DATA dir built from the real Multi30k files (prep's output format)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nmt.data import binarize
from nmt.data.bpe import BpeConfig, run_bpe
from nmt.data.dataset import ParallelData, load_vocab
from nmt.errors import DataError, UsageError

# prep's layout: Multi30k train -> train, val -> valid, test_2016_flickr -> test.
LAYOUT = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


def make_data_dir(out: Path, multi30k: Path, splits: tuple[str, ...] = ("train", "valid",
                                                                        "test"),
                  vocab_size: int | None = 8000) -> Path:
    """A DATA dir as `nmt prep multi30k-en-de` writes it (English source, German target)."""
    out.mkdir(parents=True, exist_ok=True)
    for split in splits:
        shutil.copyfile(multi30k / f"{LAYOUT[split]}.en", out / f"{split}.src")
        shutil.copyfile(multi30k / f"{LAYOUT[split]}.de", out / f"{split}.tgt")
    manifest = {"recipe": "multi30k-en-de", "src_lang": "en", "tgt_lang": "de", "splits": {}}
    if vocab_size is not None:
        manifest["vocab_size"] = vocab_size
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return out


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """Full Multi30k, the recipe's vocabulary size (8000) taken from manifest.json."""
    from conftest import shared_data_path

    data = make_data_dir(tmp_path_factory.mktemp("m30k") / "data", shared_data_path("multi30k"))
    return data, run_bpe(data, BpeConfig(threads=2))


def test_outputs_and_meta(built):
    data, meta = built
    for split in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            for kind in ("tokens", "offsets"):
                assert (data / "bin" / f"{split}.{side}.{kind}.npy").is_file()
    assert (data / "spm.model").is_file() and (data / "spm.vocab").is_file()
    on_disk = json.loads((data / "bin" / "meta.json").read_text())
    assert on_disk == meta
    assert meta["vocab_size"] == 8000 and meta["dtype"] == "uint16"
    assert meta["spm_sha256"] == hashlib.sha256((data / "spm.model").read_bytes()).hexdigest()
    assert {s: meta["splits"][s]["lines"] for s in meta["splits"]} == {
        "train": 29000, "valid": 1014, "test": 1000}
    for split in ("train", "valid", "test"):
        pair = ParallelData.open(data, split)
        assert pair.src.dtype == np.uint16
        assert meta["splits"][split]["src_tokens"] == int(pair.src.lengths.sum())
        assert meta["splits"][split]["tgt_tokens"] == int(pair.tgt.lengths.sum())
    assert len(load_vocab(data)) == 8000
    assert not [p for p in (data / "bin").iterdir() if p.name.startswith(".")]  # no temps


@pytest.mark.parametrize("split", ["valid", "test"])
def test_decoding_binarized_split_gives_back_the_text(built, split):
    data, _ = built
    vocab, pair = load_vocab(data), ParallelData.open(data, split)
    for side, arr in (("src", pair.src), ("tgt", pair.tgt)):
        decoded = vocab.decode([arr[i] for i in range(len(arr))])
        assert decoded == _lines(data / f"{split}.{side}")


def test_train_ids_equal_direct_encoding(built):
    data, _ = built
    vocab, pair = load_vocab(data), ParallelData.open(data, "train")
    lines = _lines(data / "train.tgt")
    picks = [0, 1, 12345, 28999]
    assert [pair.tgt[i].tolist() for i in picks] == vocab.encode([lines[i] for i in picks])
    # Shared vocabulary: no unknown pieces anywhere in the training data.
    assert not np.any(np.asarray(pair.src.tokens) == 1)
    assert not np.any(np.asarray(pair.tgt.tokens) == 1)


def test_second_run_skips_everything_then_redoes_a_changed_split(tmp_path, multi30k_dir):
    data = make_data_dir(tmp_path / "d", multi30k_dir, splits=("train", "valid"),
                         vocab_size=1000)
    shutil.copyfile(multi30k_dir / "val.en", data / "train.src")  # small train: fast
    shutil.copyfile(multi30k_dir / "val.de", data / "train.tgt")
    first = run_bpe(data, BpeConfig(threads=1))
    stamps = {p.name: p.stat().st_mtime_ns for p in (data / "bin").iterdir()}
    model_stamp = (data / "spm.model").stat().st_mtime_ns
    messages: list[str] = []
    second = run_bpe(data, BpeConfig(threads=1), report=messages.append)
    assert second == first
    assert any("not retrained" in m for m in messages)
    assert sum("skipped" in m for m in messages) == 2
    assert (data / "spm.model").stat().st_mtime_ns == model_stamp
    for path in (data / "bin").glob("*.npy"):
        assert path.stat().st_mtime_ns == stamps[path.name]
    # A changed valid split is re-encoded with the same model; train is left alone.
    lines = _lines(data / "valid.src")
    (data / "valid.src").write_text("\n".join(lines[:-1] + ["Hello there."]) + "\n")
    messages.clear()
    third = run_bpe(data, BpeConfig(threads=1), report=messages.append)
    assert any(m.startswith("train: up to date") for m in messages)
    assert (data / "bin" / "train.src.tokens.npy").stat().st_mtime_ns == \
        stamps["train.src.tokens.npy"]
    assert third["spm_sha256"] == first["spm_sha256"]
    vocab, pair = load_vocab(data), ParallelData.open(data, "valid")
    assert vocab.decode([pair.src[-1]]) == ["Hello there."]
    # A different vocabulary size retrains and re-encodes.
    fourth = run_bpe(data, BpeConfig(vocab_size=900, threads=1))
    assert fourth["vocab_size"] == 900 and fourth["spm_sha256"] != first["spm_sha256"]
    assert ParallelData.open(data, "train").src.tokens.max() < 900


def test_line_count_mismatch_names_files_and_counts(tmp_path, multi30k_dir):
    data = make_data_dir(tmp_path / "d", multi30k_dir, splits=("train", "test"))
    with open(data / "test.tgt", "a", encoding="utf-8") as handle:
        handle.write("one extra line\n")
    with pytest.raises(DataError, match=r"test.src has 1000 lines but .*test.tgt has 1001 lines"):
        run_bpe(data)
    assert not (data / "spm.model").exists()  # checked before any training


def test_vocab_size_required_without_manifest_value(tmp_path, multi30k_dir):
    data = make_data_dir(tmp_path / "d", multi30k_dir, splits=("valid",), vocab_size=None)
    with pytest.raises(DataError, match="train.src: no such file"):
        run_bpe(data, BpeConfig(vocab_size=100))
    for side in ("src", "tgt"):
        shutil.copyfile(data / f"valid.{side}", data / f"train.{side}")
    with pytest.raises(UsageError, match="gives no vocab_size; pass --vocab-size"):
        run_bpe(data)
    (data / "valid.tgt").unlink()
    with pytest.raises(DataError, match="valid.tgt: no such file, but valid.src exists"):
        run_bpe(data, BpeConfig(vocab_size=500))


def test_bad_settings_are_usage_errors():
    for kwargs in (dict(vocab_size=0), dict(sample=-1), dict(threads=-2)):
        with pytest.raises(UsageError):
            BpeConfig(**kwargs)


def test_failure_midway_leaves_no_partial_output(tmp_path, multi30k_dir, monkeypatch):
    data = make_data_dir(tmp_path / "d", multi30k_dir, splits=("train",), vocab_size=800)
    shutil.copyfile(multi30k_dir / "val.en", data / "train.src")
    shutil.copyfile(multi30k_dir / "val.de", data / "train.tgt")
    real = binarize.encode_chunks

    def failing(*args, **kwargs):
        for number, chunk in enumerate(real(*args, **kwargs)):
            if number == 2:
                raise OSError(28, "No space left on device")
            yield chunk

    monkeypatch.setattr(binarize, "encode_chunks", failing)
    with pytest.raises(DataError, match="No space left on device"):
        run_bpe(data, BpeConfig(threads=1, chunk_lines=100))
    assert sorted(p.name for p in (data / "bin").iterdir()) == ["meta.json"]
    with pytest.raises(DataError, match="no binarized split 'train'"):
        ParallelData.open(data, "train")
    monkeypatch.setattr(binarize, "encode_chunks", real)
    messages: list[str] = []
    run_bpe(data, BpeConfig(threads=1, chunk_lines=100), report=messages.append)
    assert any("not retrained" in m for m in messages)  # resumes after the finished step
    assert len(ParallelData.open(data, "train")) == 1014


def test_cli_exit_codes(tmp_path, multi30k_dir, nmt_cli):
    data = make_data_dir(tmp_path / "d", multi30k_dir, splits=("valid",), vocab_size=100000)
    for side in ("src", "tgt"):
        shutil.copyfile(data / f"valid.{side}", data / f"train.{side}")
    # Vocabulary too large for a small corpus: usage error, one line, no traceback.
    result = nmt_cli.run("bpe", data)
    assert result.returncode == 2, result.err
    last = result.err.strip().splitlines()[-1]
    assert last.startswith("nmt bpe: error: --vocab-size 100000 does not fit")
    assert "set it to a value <=" in last
    assert "Traceback" not in result.err and result.out == ""
    # Success, with progress on stderr only.
    result = nmt_cli.run("bpe", data, "--vocab-size", "1000", "--sample", "1500", "--threads", "1")
    assert result.returncode == 0, result.err
    assert result.out == "" and "valid: 1014 lines" in result.err
    assert len(ParallelData.open(data, "valid")) == 1014
    # Misaligned sides: data error (exit 3) naming both files.
    (data / "valid.tgt").write_text("just one line\n", encoding="utf-8")
    result = nmt_cli.run("bpe", data, "--vocab-size", "1000")
    assert result.returncode == 3
    assert result.err.startswith("nmt bpe: error: ")  # fails before any progress line
    assert "valid.src has 1014 lines but" in result.err and "has 1 lines" in result.err
    assert len(result.err.strip().splitlines()) == 1
