"""Faults `nmt prep` must survive: each is one stderr line naming the file, the
documented exit code, and no partial output. Driven through the real CLI in a subprocess."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest
from helpers.cli import assert_one_line
from helpers.wmt import build_multi30k_mirror, build_wmt14_mirror, make_tgz, recipe_copy

from nmt.data.prep import prepare
from nmt.errors import DataError


@pytest.fixture(scope="module")
def wmt_mirror(tmp_path_factory):
    return build_wmt14_mirror(tmp_path_factory.mktemp("wmt"), n_train=20)


def test_checksum_mismatch_exit_4_nothing_written(tmp_path, multi30k_dir, nmt_cli):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    (mirror / "train.en.gz").write_bytes(gzip.compress(b"tampered\n"))
    out = tmp_path / "out"
    run = nmt_cli.run("prep", "multi30k-en-de", "-o", out,
                      env={"NMT_MIRROR": str(mirror)})  # mirror from NMT_MIRROR
    assert_one_line(run, 4, "train.en.gz", "content sha256 mismatch", "delete it")
    assert not out.exists()


def test_mirror_missing_file_exit_5(tmp_path, multi30k_dir, nmt_cli):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    (mirror / "val.en.gz").unlink()
    run = nmt_cli.run("prep", "multi30k-en-de", "-o", tmp_path / "out", "--mirror", mirror)
    assert_one_line(run, 5, "val.en.gz", "raw/val.en.gz", "lacks 1 file")
    assert not (tmp_path / "out").exists()


def test_recipe_unknown_key_exit_2(tmp_path, nmt_cli):
    bad = recipe_copy("multi30k-en-de", tmp_path / "bad.toml",
                      replace={"max_words = 250": "max_word = 250"})
    assert_one_line(nmt_cli.run("prep", bad, "-o", tmp_path / "o"), 2, "bad.toml",
                     "cleaning.max_word", "valid keys")
    # Bad values and unknown names: same path, checked in-process in test_recipes.py.
    assert not (tmp_path / "o").exists()


def test_truncated_archive_exit_4(tmp_path, wmt_mirror, nmt_cli):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for path in wmt_mirror.iterdir():
        (mirror / path.name).symlink_to(path)
    (mirror / "dev.tgz").unlink()
    data = (wmt_mirror / "dev.tgz").read_bytes()
    (mirror / "dev.tgz").write_bytes(data[: len(data) // 3])
    # No checksums in this copy, so the extractor itself must notice the damage.
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml")
    out = tmp_path / "out"
    run = nmt_cli.run("prep", recipe, "-o", out, "--mirror", mirror)
    assert_one_line(run, 4, "dev.tgz", "truncated or corrupt archive")
    leftovers = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    # Finished earlier steps may remain (they are complete); no temp or partial file does.
    assert all(not p.name.endswith(".tmp") for p in leftovers)
    assert not (out / "raw/extract/dev").exists()
    assert not (out / "valid.src").exists() and not (out / "valid.tgt").exists()


def test_hostile_tar_member_exit_4(tmp_path, wmt_mirror, nmt_cli):
    member = "../escape.txt"  # absolute names: tests/data/test_prep_extract.py
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for path in wmt_mirror.iterdir():
        (mirror / path.name).symlink_to(path)
    (mirror / "test-full.tgz").unlink()
    buf = (wmt_mirror / "test-full.tgz")
    with tarfile.open(buf) as src, tarfile.open(mirror / "test-full.tgz", "w:gz") as dst:
        info = tarfile.TarInfo(member)
        info.size = 4
        dst.addfile(info, io.BytesIO(b"pwn\n"))
        for item in src:
            dst.addfile(item, src.extractfile(item))
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml")
    out = tmp_path / "out"
    run = nmt_cli.run("prep", recipe, "-o", out, "--mirror", mirror)
    assert_one_line(run, 4, "test-full.tgz", repr(member), "outside the output directory")
    assert not (tmp_path / "escape.txt").exists() and not (out / "test.src").exists()


def test_download_path_via_file_urls(tmp_path, wmt_mirror):
    """Without a mirror the archives are downloaded (file:// URLs here), verified, kept."""
    recipe = recipe_copy("wmt14-en-de", tmp_path / "r.toml", wmt_mirror)
    text = recipe.read_text("utf-8")
    for prefix in ("http://www.statmt.org/wmt13/", "http://www.statmt.org/wmt14/"):
        text = text.replace(prefix, wmt_mirror.as_uri() + "/")
    recipe.write_text(text, "utf-8")
    out = tmp_path / "out"
    manifest = prepare(str(recipe), out)
    assert (out / "raw/downloads/dev.tgz").read_bytes() == (wmt_mirror / "dev.tgz").read_bytes()
    assert manifest["archives"]["dev"]["source"] == "download"
    assert manifest["splits"]["test"]["lines"] == 3003


def test_tar_with_only_unneeded_members_is_data_error(tmp_path):
    mirror = tmp_path / "m"
    mirror.mkdir()
    make_tgz(mirror / "x.tgz", {"a.en": b"x\n"})
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\nsrc_lang = "en"\ntgt_lang = "de"\nvocab_size = 100\n'
                      '[archives.x]\nurl = "https://example.org/x.tgz"\n'
                      '[train]\nsrc = { archive = "x", member = "a.en" }\n'
                      'tgt = { archive = "x", member = "a.de" }\n'
                      '[valid]\nsrc = { archive = "x", member = "a.en" }\n'
                      'tgt = { archive = "x", member = "a.en" }\n'
                      '[test]\nsrc = { archive = "x", member = "a.en" }\n'
                      'tgt = { archive = "x", member = "a.en" }\n', "utf-8")
    with pytest.raises(DataError, match="x.tgz: has no member 'a.de'"):
        prepare(str(recipe), tmp_path / "out", mirror)
    assert not (tmp_path / "out").exists()
