"""Joint sentencepiece BPE training on the real Multi30k text: ids, round trip, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab
from nmt.errors import DataError, UsageError


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Vocab, Path]:
    from conftest import shared_data_path

    data = shared_data_path("multi30k")
    out = tmp_path_factory.mktemp("vocab") / "spm.model"
    vocab = train_vocab([data / "train.en", data / "train.de"], out, 2000, threads=2)
    return vocab, out


def test_special_ids_size_and_files(trained):
    vocab, path = trained
    assert len(vocab) == 2000
    assert vocab.pieces([PAD_ID, UNK_ID, BOS_ID, EOS_ID]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert path.is_file() and path.with_suffix(".vocab").is_file()
    assert Vocab.from_file(path).proto == vocab.proto
    # No temp directory or temp file is left beside the model.
    assert sorted(p.name for p in path.parent.iterdir()) == ["spm.model", "spm.vocab"]


def test_joint_vocabulary_covers_both_languages(trained):
    vocab, _ = trained
    en, de = vocab.encode(["A man is riding a bicycle.", "Ein Mann fährt Fahrrad."])
    assert UNK_ID not in en + de
    assert all(i > EOS_ID for i in en + de)  # no special id inside an encoded line


def test_round_trip_is_exact_on_real_val(trained, multi30k_dir):
    vocab, _ = trained
    for name in ("val.en", "val.de"):
        lines = _lines(multi30k_dir / name)
        assert vocab.decode(vocab.encode(lines)) == lines


def test_identity_normalization_and_byte_fallback(trained):
    vocab, _ = trained
    # NFKC would turn the ligature, the full-width letters and the superscript into plain
    # ASCII; characters never seen in training come back through byte fallback, not UNK.
    lines = ["ﬁsh ＡＢＣ x² café", "雪だるま ☃ ok", "tab\tinside"]
    ids = vocab.encode(lines)
    assert all(UNK_ID not in seq for seq in ids)
    assert vocab.decode(ids) == lines


def test_vocab_too_large_is_a_usage_error(tmp_path, multi30k_dir):
    with pytest.raises(UsageError, match=r"--vocab-size 100000 .*<= \d+"):
        train_vocab([multi30k_dir / "val.en"], tmp_path / "spm.model", 100000)
    assert not (tmp_path / "spm.model").exists()
    assert list(tmp_path.iterdir()) == []


def test_vocab_too_small_is_a_usage_error(tmp_path, multi30k_dir):
    with pytest.raises(UsageError, match="--vocab-size 50 .*required_chars"):
        train_vocab([multi30k_dir / "val.en"], tmp_path / "spm.model", 50)


def test_missing_input_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        train_vocab([tmp_path / "nope.txt"], tmp_path / "spm.model", 100)


def test_garbage_model_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="invalid sentencepiece model"):
        Vocab(b"not a model")
    with pytest.raises(DataError, match="run `nmt bpe` first"):
        Vocab.from_file(tmp_path / "missing.model")


def test_sampled_training_is_reproducible(tmp_path, multi30k_dir):
    inputs = [multi30k_dir / "train.en", multi30k_dir / "train.de"]
    first = train_vocab(inputs, tmp_path / "a.model", 1000, sample=3000, seed=7)
    again = train_vocab(inputs, tmp_path / "b.model", 1000, sample=3000, seed=7)
    full = train_vocab(inputs, tmp_path / "c.model", 1000, sample=0, seed=7)
    assert _pieces(first) == _pieces(again)  # same seed, same sample, same model
    assert _pieces(first) != _pieces(full)  # the sample really is a subset


def _pieces(vocab: Vocab) -> list[tuple[str, float]]:
    """Pieces and scores: the model itself (the proto also records training paths)."""
    return [(vocab._sp.id_to_piece(i), vocab._sp.get_score(i)) for i in range(len(vocab))]


def test_sample_is_an_ordered_subset_of_all_inputs(tmp_path, multi30k_dir):
    from nmt.data.vocab import _sample_lines

    inputs = [multi30k_dir / "val.en", multi30k_dir / "val.de"]
    corpus = _lines(inputs[0]) + _lines(inputs[1])
    assert _sample_lines(inputs, 500, 3, tmp_path / "s.txt")
    drawn = _lines(tmp_path / "s.txt")
    assert len(drawn) == 500
    remaining = iter(corpus)  # a subsequence: every drawn line appears, in corpus order
    assert all(any(line == other for other in remaining) for line in drawn)
    assert any(line in _lines(inputs[0]) for line in drawn)
    assert any(line in _lines(inputs[1]) for line in drawn)
    assert not _sample_lines(inputs, len(corpus), 3, tmp_path / "t.txt")
    assert not (tmp_path / "t.txt").exists()
