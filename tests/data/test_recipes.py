"""Recipes: the shipped TOML files load, and bad ones fail with file, key and choices."""

from __future__ import annotations

import pytest
from helpers.wmt import recipe_copy

from nmt.data.recipes import load_recipe, recipe_names
from nmt.errors import UsageError


def test_shipped_recipes_load_with_paper_values():
    assert set(recipe_names()) >= {"wmt14-en-de", "wmt14-en-fr", "multi30k-en-de"}
    ende, enfr, m30k = (load_recipe(n) for n in ("wmt14-en-de", "wmt14-en-fr",
                                                   "multi30k-en-de"))
    assert (ende.vocab_size, enfr.vocab_size, m30k.vocab_size) == (37000, 32000, 8000)
    assert (ende.src_lang, ende.tgt_lang, enfr.tgt_lang) == ("en", "de", "fr")
    assert [c.name for c in ende.splits["train"]] == ["europarl-v7", "commoncrawl",
                                                      "news-commentary-v9"]
    assert len(enfr.splits["train"]) == 5
    assert ende.splits["test"][0].src.member == "test-full/newstest2014-deen-src.en.sgm"
    assert ende.splits["test"][0].src.format == "sgm"
    assert ende.cleaning.max_words == 250 and ende.cleaning.max_ratio == 1.5
    assert ende.archives["test-full"].md5 == "a8cd784e006feb32ac6f3d9ec7eb389a"
    sizes = {"europarl": 657632379, "commoncrawl": 918311367, "news-commentary": 80418416}
    for recipe in (ende, enfr):
        assert {a: recipe.archives[a].size for a in sizes} == sizes
        assert all(recipe.archives[a].sha256 for a in sizes)
    assert ende.cleaning.dedup and ende.cleaning.remove_overlap
    assert m30k.archives["test-en"].file_name == "test_2016_flickr.en.gz"
    assert m30k.archives["test-en"].kind == "gz"


def test_recipe_by_path(tmp_path):
    path = recipe_copy("multi30k-en-de", tmp_path / "mine.toml")
    assert load_recipe(str(path)).name == "multi30k-en-de"


@pytest.mark.parametrize("old,new,expect", [
    ('vocab_size = 8000', 'vocab_size = 8000\nvocab = 1', ["vocab:", "unknown key",
                                                           "vocab_size"]),
    ('vocab_size = 8000', 'vocab_size = "big"', ["vocab_size", "must be a int"]),
    ('max_words = 250', 'max_wrds = 250', ["cleaning.max_wrds", "max_words", "max_ratio"]),
    ('max_ratio = 0 ', 'max_ratio = 0.5 ', ["cleaning.max_ratio", ">= 1"]),
    ('src = { archive = "val-en" }', 'src = { archive = "val-xx" }',
     ["valid.src.archive", "val-en"]),
    ('src = { archive = "val-en" }', 'src = { archive = "val-en", format = "pdf" }',
     ["valid.src.format", "sgm", "xml-src"]),
    ('src = { archive = "val-en" }', 'src = { archive = "val-en", member = "x" }',
     ["valid.src.member", "single file"]),
    ('raw/val.en.gz"', 'raw/val.en.gz"\nsha256 = "XYZ"', ["archives.val-en.sha256", "hex"]),
])
def test_bad_recipe_values(tmp_path, old, new, expect):
    path = recipe_copy("multi30k-en-de", tmp_path / "bad.toml", replace={old: new})
    with pytest.raises(UsageError) as err:
        load_recipe(str(path))
    message = str(err.value)
    assert str(path.resolve()) in message or str(path) in message
    for word in expect:
        assert word in message
    assert "\n" not in message


def test_member_escaping_output_is_refused(tmp_path):
    path = recipe_copy("wmt14-en-de", tmp_path / "bad.toml", replace={
        'member = "dev/newstest2013.en"': 'member = "../../etc/passwd"'})
    with pytest.raises(UsageError, match=r"valid\.src\.member.*without '\.\.'"):
        load_recipe(str(path))


def test_unknown_recipe_lists_choices():
    with pytest.raises(UsageError, match="wmt14-en-de.*multi30k|multi30k.*wmt14-en-de"):
        load_recipe("wmt15-xx")
