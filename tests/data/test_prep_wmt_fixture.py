"""`nmt prep wmt14-en-de` on fixture archives with the real WMT layout and SGML."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, shared_data_path
from helpers.wmt import BAD_PAIRS, build_wmt14_mirror, recipe_copy

from nmt.data.prep import prepare
from nmt.errors import IntegrityError


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    return build_wmt14_mirror(tmp_path_factory.mktemp("wmt14-mirror"), n_train=200)


def test_wmt14_fixture_end_to_end_and_idempotent(tmp_path, mirror):
    wmt = shared_data_path("wmt14")
    recipe = recipe_copy("wmt14-en-de", tmp_path / "wmt14-en-de.toml", mirror)
    out = tmp_path / "out"
    manifest = prepare(str(recipe), out, mirror, workers=1)
    for split, name in (("test", "newstest2014"), ("valid", "newstest2013")):
        assert (out / f"{split}.src").read_bytes() == (wmt / f"{name}.en").read_bytes()
        assert (out / f"{split}.tgt").read_bytes() == (wmt / f"{name}.de").read_bytes()
    assert manifest["splits"]["test"]["lines"] == 3003
    counts = manifest["splits"]["train"]["cleaning_counts"]
    per = len(BAD_PAIRS) + 1 + 200
    assert counts["total"]["input"] == 3 * per
    assert counts["total"]["after_empty"] == 3 * (per - 1)
    assert counts["total"]["after_max_words"] == 3 * (per - 2)
    assert counts["total"]["output"] == manifest["splits"]["train"]["lines"]
    train_src = (out / "train.src").read_text("utf-8").splitlines()
    assert 'A man rides a "horse" .' in train_src
    assert len(train_src) == manifest["splits"]["train"]["lines"]
    on_disk = json.loads((out / "manifest.json").read_text("utf-8"))
    assert on_disk["vocab_size"] == 37000 and on_disk["src_lang"] == "en"
    assert on_disk["archives"]["test-full"]["verified"]["sha256"]
    # Second run: every step is finished, nothing is rewritten.
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    prepare(str(recipe), out, mirror, workers=1)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    # A damaged output is noticed and only that split is redone.
    (out / "valid.tgt").write_text("damaged\n")
    prepare(str(recipe), out, mirror, workers=1)
    assert (out / "valid.tgt").read_bytes() == (wmt / "newstest2013.de").read_bytes()
    assert (out / "train.src").stat().st_mtime_ns == stamps["train.src"]


def test_shipped_recipe_checks_its_sizes_sha256s_and_sacrebleu_md5(tmp_path, mirror):
    with pytest.raises(IntegrityError, match="training-parallel-commoncrawl.tgz: size "
                                             "mismatch .expected 918311367"):
        prepare("wmt14-en-de", tmp_path / "out", mirror)
    assert not (tmp_path / "out").exists()
    text = (REPO / "recipes" / "wmt14-en-de.toml").read_text("utf-8")
    recipe = tmp_path / "md5-only.toml"  # the training archives' checks taken out
    recipe.write_text(re.sub(r"^(size|sha256) = .*\n", "", text, flags=re.M), "utf-8")
    with pytest.raises(IntegrityError, match="test-full.tgz: md5 mismatch"):
        prepare(str(recipe), tmp_path / "out", mirror)
    assert not (tmp_path / "out").exists()


def test_cli_wmt14_fixture_with_workers(tmp_path, mirror, nmt_cli):
    recipe = recipe_copy("wmt14-en-de", tmp_path / "wmt14-en-de.toml", mirror)
    out = tmp_path / "cli-out"
    run = nmt_cli.run("prep", recipe, "-o", out, "--workers", "2",
                      env={"NMT_MIRROR": str(mirror)})
    assert run.returncode == 0, run.err
    assert run.out == ""
    assert "test 3003" in run.err
    wmt = shared_data_path("wmt14")
    assert (out / "test.tgt").read_bytes() == (wmt / "newstest2014.de").read_bytes()
