"""Training-data hygiene and corpus weights: duplicates and dev/test sources leave the
training split, counted per rule; per-corpus line ranges and weights reach the trainer
through `corpus_ranges`, unchanged by `nmt bpe`."""

from __future__ import annotations

import json

import pytest
from helpers.wmt import build_wmt14_mirror, make_tgz, recipe_copy

from nmt.data.bpe import BpeConfig, run_bpe
from nmt.data.dataset import CorpusRange, ParallelData, corpus_ranges, epoch_shares, load_vocab
from nmt.data.prep import prepare
from nmt.errors import DataError, UsageError

WEIGHTS = {'name = "europarl-v7"': 'name = "europarl-v7"\nweight = 2',
           'name = "commoncrawl"': 'name = "commoncrawl"\nweight = 1',
           'name = "news-commentary-v9"': 'name = "news-commentary-v9"\nweight = 1'}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    return build_wmt14_mirror(tmp_path_factory.mktemp("wmt14"), n_train=100)


def _lines(path):
    return path.read_text("utf-8").split("\n")[:-1]


def test_weights_ranges_and_dedup_survive_bpe(tmp_path, mirror):
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", mirror, replace=WEIGHTS)
    out = tmp_path / "out"
    manifest = prepare(str(recipe), out, mirror, workers=1)
    train = manifest["splits"]["train"]
    counts = train["cleaning_counts"]
    # GOOD_PAIR ends every corpus: kept in the first, a duplicate in the other two.
    assert [counts[n]["after_overlap"] - counts[n]["after_dedup"] for n in
            ("europarl-v7", "commoncrawl", "news-commentary-v9")] == [0, 1, 1]
    assert counts["total"]["after_dedup"] == counts["total"]["output"] == train["lines"]
    assert _lines(out / "train.src").count('A man rides a "horse" .') == 1
    sizes = [counts[n]["output"] for n in ("europarl-v7", "commoncrawl", "news-commentary-v9")]
    assert train["corpora"] == [
        {"name": "europarl-v7", "start": 0, "lines": sizes[0], "weight": 2.0},
        {"name": "commoncrawl", "start": sizes[0], "lines": sizes[1], "weight": 1.0},
        {"name": "news-commentary-v9", "start": sizes[0] + sizes[1], "lines": sizes[2],
         "weight": 1.0}]
    assert manifest["splits"]["test"]["corpora"] == [
        {"name": "newstest2014-full", "start": 0, "lines": 3003, "weight": None}]

    run_bpe(out, BpeConfig(vocab_size=600, threads=1))
    ranges = corpus_ranges(out)
    assert ranges == [CorpusRange("europarl-v7", 0, sizes[0], 2.0),
                      CorpusRange("commoncrawl", sizes[0], sum(sizes[:2]), 1.0),
                      CorpusRange("news-commentary-v9", sum(sizes[:2]), sum(sizes), 1.0)]
    assert epoch_shares(ranges) == [0.5, 0.25, 0.25]
    # bpe keeps one binarized line per text line: range starts index the same pairs.
    data, vocab = ParallelData.open(out, "train"), load_vocab(out)
    assert len(data) == ranges[-1].stop
    src = _lines(out / "train.src")
    for r in ranges:
        assert vocab.decode([data.src[r.start], data.src[r.stop - 1]]) == \
            [src[r.start], src[r.stop - 1]]

    # New weights only: the text is not rewritten, the manifest and the ranges follow.
    stamp = (out / "train.src").stat().st_mtime_ns
    recipe_copy("wmt14-en-de", recipe, mirror, replace={
        **WEIGHTS, 'name = "commoncrawl"': 'name = "commoncrawl"\nweight = 0.5'})
    prepare(str(recipe), out, mirror, workers=1)
    assert (out / "train.src").stat().st_mtime_ns == stamp
    assert [r.weight for r in corpus_ranges(out)] == [2.0, 0.5, 1.0]

    # Training text prepared again (other cleaning) without `nmt bpe`: the ranges refuse.
    recipe_copy("wmt14-en-de", recipe, mirror, replace={**WEIGHTS,
                                                         "max_words = 250": "max_words = 12"})
    prepare(str(recipe), out, mirror, workers=1)
    with pytest.raises(DataError, match="made from other text .* run `nmt bpe .*` again"):
        corpus_ranges(out)


def test_train_is_redone_when_the_test_set_changes(tmp_path, mirror):
    """Overlap removal makes the training text depend on dev and test."""
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", mirror)
    out = tmp_path / "out"
    first = prepare(str(recipe), out, mirror, workers=1)
    train_src = _lines(out / "train.src")
    # A test set whose first source is a training source: that pair leaves train.
    alt = tmp_path / "alt"
    alt.mkdir()
    for path in mirror.iterdir():
        (alt / path.name).symlink_to(path)
    (alt / "dev.tgz").unlink()
    make_tgz(alt / "dev.tgz", {"dev/newstest2013.en": (train_src[5] + "\n").encode(),
                               "dev/newstest2013.de": b"Irgendwas.\n"})
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", alt)
    second = prepare(str(recipe), out, alt, workers=1)
    assert second["splits"]["train"]["lines"] == first["splits"]["train"]["lines"] - 1
    assert train_src[5] not in _lines(out / "train.src")
    assert second["splits"]["train"]["cleaning_counts"]["total"]["after_overlap"] == \
        first["splits"]["train"]["cleaning_counts"]["total"]["after_overlap"] - 1


def test_weights_for_some_corpora_only_is_refused(tmp_path, mirror):
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", mirror, replace={
        'name = "commoncrawl"': 'name = "commoncrawl"\nweight = 0.5'})
    with pytest.raises(UsageError, match=r"train\[0\]\.weight: give every training corpus"):
        prepare(str(recipe), tmp_path / "out", mirror)
    for bad in ("0", "-1", '"x"', "inf"):
        recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", mirror, replace={
            name: text.replace("2", bad) if "europarl" in name else text
            for name, text in WEIGHTS.items()})
        with pytest.raises(UsageError, match=r"train\[0\]\.weight"):
            prepare(str(recipe), tmp_path / "out", mirror)
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", mirror, replace={
        'name = "newstest2013"': 'name = "newstest2013"\nweight = 1'})
    with pytest.raises(UsageError, match=r"valid\.weight: unknown key"):
        prepare(str(recipe), tmp_path / "out", mirror)


def test_ranges_of_a_hand_made_data_dir(tmp_path):
    """No prep manifest: one unweighted corpus over the binarized split."""
    data = tmp_path / "d"
    (data / "bin").mkdir(parents=True)
    (data / "bin" / "meta.json").write_text(json.dumps({"splits": {"train": {"lines": 7}}}))
    assert corpus_ranges(data) == [CorpusRange("train", 0, 7, None)]
    assert epoch_shares(corpus_ranges(data)) == [1.0]
    (data / "manifest.json").write_text(json.dumps({"splits": {"train": {
        "lines": 7, "corpora": [{"name": "a", "start": 0, "lines": 3, "weight": None},
                                {"name": "b", "start": 3, "lines": 5, "weight": None}]}}}))
    with pytest.raises(DataError, match="add up to 8 lines but the split has 7"):
        corpus_ranges(data)
