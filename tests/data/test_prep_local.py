"""`nmt prep --src-lang .. --tgt-lang .. --train .. --valid .. --test ..`: local files, no
TOML, prepared by the recipe machinery with the same cleaning, manifest and guarantees.
Real data: Multi30k and newstest2014 from ../shared/data, in small slices where enough."""

from __future__ import annotations

import gzip
import json
from html import escape
from pathlib import Path

import pytest
from helpers.cli import assert_one_line

from nmt.data.dataset import CorpusRange, corpus_ranges
from nmt.data.local_recipe import files_recipe, parse_pair
from nmt.data.prep import prepare
from nmt.errors import DataError, UsageError
from nmt.train.settings import resolve


def _slice(src: Path, dest: Path, start: int, stop: int) -> Path:
    lines = src.read_text("utf-8").split("\n")[start:stop]
    dest.write_text("".join(line + "\n" for line in lines), "utf-8")
    return dest


@pytest.fixture
def files(tmp_path, multi30k_dir):
    """Two 600-pair training slices, val and test_2016 (whole), in a folder of their own."""
    d = tmp_path / "corpus"
    d.mkdir()
    for lang in ("en", "de"):
        _slice(multi30k_dir / f"train.{lang}", d / f"a.{lang}", 0, 600)
        _slice(multi30k_dir / f"train.{lang}", d / f"b.{lang}", 600, 1200)
    return d


def _args(d: Path, m30k: Path, *train: str) -> list[str]:
    train = train or (f"{d}/a.en,{d}/a.de",)
    return ["--src-lang", "en", "--tgt-lang", "de",
            *[x for t in train for x in ("--train", t)],
            "--valid", f"{m30k}/val.en,{m30k}/val.de",
            "--test", f"{m30k}/test_2016_flickr.en,{m30k}/test_2016_flickr.de"]


def test_local_files_give_what_the_recipe_gives(tmp_path, multi30k_dir, nmt_cli):
    """Multi30k's own files, no TOML, the recipe's cleaning: the same text, line for line."""
    run = nmt_cli.run("prep", *_args(multi30k_dir, multi30k_dir,
                                     f"{multi30k_dir}/train.en,{multi30k_dir}/train.de"),
                      "--max-ratio", "0", "--vocab-size", "8000", "-o", tmp_path / "local",
                      "--workers", "2")
    assert run.returncode == 0, run.err
    assert run.out == "" and "train 28996, valid 1014, test 1000 lines" in run.err
    recipe = prepare("multi30k-en-de", tmp_path / "recipe", multi30k_dir, workers=1)
    for name in ("train.src", "train.tgt", "valid.src", "valid.tgt", "test.src", "test.tgt"):
        assert (tmp_path / "local" / name).read_bytes() == \
            (tmp_path / "recipe" / name).read_bytes(), name
    local = json.loads((tmp_path / "local" / "manifest.json").read_text("utf-8"))
    assert local["recipe"] == "files-en-de" and local["recipe_file"] is None
    assert local["vocab_size"] == 8000 and local["cleaning"]["max_ratio"] == 0
    assert local["splits"]["train"]["cleaning_counts"]["total"] == \
        recipe["splits"]["train"]["cleaning_counts"]["total"]
    entry = local["archives"]["train.en"]
    assert entry["path"] == str(multi30k_dir / "train.en") and entry["source"] == "local"
    assert entry["sha256"] == recipe["archives"]["train-en"]["verified"]["content_sha256"]
    assert not (tmp_path / "local" / "raw" / "downloads").exists()  # read in place
    # `nmt train DATA` finds no [training] table: the config defaults apply.
    model, train, sources = resolve(tmp_path / "local", None, {}, {})
    assert sources == {} and model.d_model == 512


def test_idempotent_then_other_files_redo_only_what_they_feed(tmp_path, files, multi30k_dir,
                                                              nmt_cli):
    out = tmp_path / "out"
    first = prepare(files_recipe("en", "de", [parse_pair(f"{files}/a.en,{files}/a.de",
                                                         "--train")],
                                 parse_pair(f"{multi30k_dir}/val.en,{multi30k_dir}/val.de", "v"),
                                 parse_pair(f"{multi30k_dir}/test_2016_flickr.en,"
                                            f"{multi30k_dir}/test_2016_flickr.de", "t")),
                    out, workers=1)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    first_train = (out / "train.src").read_bytes()
    notes: list[str] = []
    run = nmt_cli.run("prep", *_args(files, multi30k_dir), "-o", out)
    assert run.returncode == 0, run.err
    assert stamps == {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    assert "writing it again" not in run.err

    # Other training files into the same DATA: train is redone (and says so), dev and
    # test stay; nothing of a.* is left in train.
    run = nmt_cli.run("prep", *_args(files, multi30k_dir, f"{files}/b.en,{files}/b.de"), "-o",
                      out)
    assert run.returncode == 0, run.err
    assert "train: inputs or settings differ from the last run's" in run.err
    manifest = json.loads((out / "manifest.json").read_text("utf-8"))
    assert [c["name"] for c in manifest["splits"]["train"]["corpora"]] == ["b"]
    assert {"b.en", "b.de"} <= set(manifest["archives"]) and "a.en" not in manifest["archives"]
    assert (out / "valid.src").stat().st_mtime_ns == stamps["valid.src"]
    b_src = set((files / "b.en").read_text("utf-8").splitlines())
    assert all(line in b_src for line in (out / "train.src").read_text("utf-8").splitlines())
    assert manifest["splits"]["valid"] == first["splits"]["valid"]

    # The same path with new content is another file too (sha256, not the name).
    _slice(multi30k_dir / "train.en", files / "b.en", 0, 600)
    _slice(multi30k_dir / "train.de", files / "b.de", 0, 600)
    prepare(files_recipe("en", "de", [parse_pair(f"{files}/b.en,{files}/b.de", "--train")],
                         parse_pair(f"{multi30k_dir}/val.en,{multi30k_dir}/val.de", "v"),
                         parse_pair(f"{multi30k_dir}/test_2016_flickr.en,"
                                    f"{multi30k_dir}/test_2016_flickr.de", "t")),
            out, workers=1, report=notes.append)
    assert notes == ["train: inputs or settings differ from the last run's; writing it again"]
    assert (out / "train.src").read_bytes() == first_train  # b.* now hold a's pairs


def test_weights_gz_and_sgm_inputs(tmp_path, files, multi30k_dir, wmt14_dir, nmt_cli):
    for name in ("b.en", "b.de"):
        (files / f"{name}.gz").write_bytes(gzip.compress((files / name).read_bytes()))
    sgm = wmt14_dir / "sgm"
    out = tmp_path / "out"
    run = nmt_cli.run("prep", "--src-lang", "en", "--tgt-lang", "de",
                      "--train", f"{files}/a.en,{files}/a.de:3",
                      "--train", f"{files}/b.en.gz,{files}/b.de.gz:1",
                      "--valid", f"{multi30k_dir}/val.en,{multi30k_dir}/val.de",
                      "--test", f"{sgm}/newstest2014-deen-src.en.sgm,"
                                f"{sgm}/newstest2014-deen-ref.de.sgm",
                      "--max-ratio", "0", "-o", out, "--workers", "1")
    assert run.returncode == 0, run.err
    assert (out / "test.src").read_bytes() == (wmt14_dir / "newstest2014.en").read_bytes()
    assert (out / "test.tgt").read_bytes() == (wmt14_dir / "newstest2014.de").read_bytes()
    corpora = json.loads((out / "manifest.json").read_text("utf-8"))["splits"]["train"][
        "corpora"]
    assert [(c["name"], c["weight"]) for c in corpora] == [("a", 3.0), ("b", 1.0)]
    assert corpora[1]["start"] == corpora[0]["lines"] == 600  # no overlap, no duplicate
    assert corpus_ranges(out) == [CorpusRange("a", 0, 600, 3.0),
                                  CorpusRange("b", 600, 600 + corpora[1]["lines"], 1.0)]


def test_wmt_xml_test_set(tmp_path, files, multi30k_dir, wmt14_dir):
    """One WMT .xml file (2021+ layout) holds both sides of a test set."""
    src = (wmt14_dir / "newstest2014.en").read_text("utf-8").splitlines()[:50]
    ref = (wmt14_dir / "newstest2014.de").read_text("utf-8").splitlines()[:50]
    segs = lambda lines: "".join(f'<seg id="{i}">{escape(s)}</seg>'  # noqa: E731
                                 for i, s in enumerate(lines, 1))
    xml = tmp_path / "newstest.en-de.xml"
    xml.write_text(f'<dataset id="t"><collection id="general"><doc id="d" origlang="en">'
                   f'<src lang="en"><p>{segs(src)}</p></src><ref lang="de" translator="A">'
                   f'<p>{segs(ref)}</p></ref></doc></collection></dataset>', "utf-8")
    recipe = files_recipe("en", "de", [parse_pair(f"{files}/a.en,{files}/a.de", "--train")],
                          parse_pair(f"{multi30k_dir}/val.en,{multi30k_dir}/val.de", "v"),
                          parse_pair(str(xml), "--test"))
    prepare(recipe, tmp_path / "out", workers=1)
    assert (tmp_path / "out" / "test.src").read_text("utf-8").splitlines() == src
    assert (tmp_path / "out" / "test.tgt").read_text("utf-8").splitlines() == ref


def test_bad_local_inputs_are_one_line_errors(tmp_path, files, multi30k_dir, nmt_cli):
    """In process (no interpreter start): each bad input is one line with its exit code."""
    out = tmp_path / "out"
    a, b = f"{files}/a.en,{files}/a.de", f"{files}/b.en,{files}/b.de"
    (files / "short.de").write_text("Nur eine Zeile.\n", "utf-8")
    run = nmt_cli.invoke("prep", *_args(files, multi30k_dir, f"{files}/a.en,{files}/short.de"),
                         "-o", out)
    assert_one_line(run, 3, "a.en has 600 lines", "short.de has 1", "not parallel")
    assert not out.exists()
    run = nmt_cli.invoke("prep", *_args(files, multi30k_dir, f"{files}/nope.en,{files}/a.de"),
                         "-o", out)
    assert_one_line(run, 3, "nope.en: no such file")
    run = nmt_cli.invoke("prep", *_args(files, multi30k_dir, f"{a}:2", b), "-o", out)
    assert_one_line(run, 2, "give every --train a weight")
    run = nmt_cli.invoke("prep", *_args(files, multi30k_dir, f"{files}/a.en"), "-o", out)
    assert_one_line(run, 2, "--train", "SRC,TGT")
    run = nmt_cli.invoke("prep", "multi30k-en-de", "--train", a)
    assert_one_line(run, 2, "--train describes local files", "not both")
    run = nmt_cli.invoke("prep", "--src-lang", "en", "--train", a)
    assert_one_line(run, 2, "need --tgt-lang")
    run = nmt_cli.invoke("prep", *_args(files, multi30k_dir), "--src-lang", "e n", "-o", out)
    assert_one_line(run, 2, "--src-lang 'e n'")
    assert not out.exists()
    # A valid/test split keeps strict reading: a misaligned dev set is refused as well.
    (files / "val.de").write_text("eins\nzwei\n", "utf-8")
    with pytest.raises(DataError, match=r"val.en has 1014 lines but .*val.de has 2;"):
        prepare(files_recipe("en", "de", [parse_pair(f"{files}/a.en,{files}/a.de", "t")],
                             parse_pair(f"{multi30k_dir}/val.en,{files}/val.de", "v"),
                             parse_pair(f"{files}/b.en,{files}/b.de", "t")), out, workers=1)
    with pytest.raises(UsageError, match="tar archive"):
        parse_pair(f"{files}/x.tgz,{files}/y.tgz", "--train")


def test_a_recipe_file_may_name_local_paths(tmp_path, files, multi30k_dir):
    """`path = ...` archives in a .toml, relative to the recipe's folder."""
    (files / "r.toml").write_text(f'''name = "mine"
src_lang = "en"
tgt_lang = "de"
vocab_size = 1000
[archives]
a-en = {{ path = "a.en" }}
a-de = {{ path = "a.de" }}
val-en = {{ path = "{multi30k_dir}/val.en" }}
val-de = {{ path = "{multi30k_dir}/val.de" }}
[[train]]
name = "a"
src = {{ archive = "a-en" }}
tgt = {{ archive = "a-de" }}
[valid]
src = {{ archive = "val-en" }}
tgt = {{ archive = "val-de" }}
[test]
src = {{ archive = "val-en" }}
tgt = {{ archive = "val-de" }}
''', "utf-8")
    manifest = prepare(str(files / "r.toml"), tmp_path / "out", workers=1)
    assert manifest["archives"]["a-en"]["path"] == str(files / "a.en")
    assert manifest["splits"]["test"]["lines"] == 1014
    bad = (files / "r.toml").read_text("utf-8").replace('{ path = "a.en" }',
                                                      '{ path = "a.en", url = "http://x/a" }')
    (files / "bad.toml").write_text(bad, "utf-8")
    with pytest.raises(UsageError, match="archives.a-en: give exactly one of url"):
        prepare(str(files / "bad.toml"), tmp_path / "out2")
