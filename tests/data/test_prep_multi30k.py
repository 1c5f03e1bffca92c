"""`nmt prep multi30k-en-de` from gzipped and from plain mirrors of the real files."""

from __future__ import annotations

import gzip

import pytest
from helpers.wmt import build_multi30k_mirror

from nmt.data.prep import prepare
from nmt.errors import DownloadError, IntegrityError


def test_gzipped_mirror_gives_exact_test_and_valid(tmp_path, multi30k_dir):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    manifest = prepare("multi30k-en-de", tmp_path / "out", mirror, workers=1)
    out = tmp_path / "out"
    assert (out / "test.src").read_bytes() == (multi30k_dir / "test_2016_flickr.en").read_bytes()
    assert (out / "test.tgt").read_bytes() == (multi30k_dir / "test_2016_flickr.de").read_bytes()
    assert len((out / "test.tgt").read_bytes().split(b"\n")) == 1001  # 1,000 lines
    assert (out / "valid.tgt").read_bytes() == (multi30k_dir / "val.de").read_bytes()
    # 29,000 pairs less 1 whose source is a val/test source and 3 repeated pairs.
    counts = manifest["splits"]["train"]["cleaning_counts"]["total"]
    assert (counts["input"], counts["after_overlap"], counts["output"]) == (29000, 28999, 28996)
    assert manifest["splits"]["train"]["lines"] == 28996
    assert manifest["splits"]["train"]["corpora"] == [
        {"name": "multi30k-train", "start": 0, "lines": 28996, "weight": None}]
    assert manifest["splits"]["test"]["lines"] == 1000
    assert manifest["archives"]["train-en"]["verified"]["content_sha256"]
    assert not manifest["archives"]["train-en"]["uncompressed_copy"]
    # Cleaning normalized punctuation in train only.
    assert b"\xe2\x80\x9e" not in (out / "train.tgt").read_bytes()  # German „ became "


def test_plain_mirror_is_accepted(tmp_path, multi30k_dir):
    manifest = prepare("multi30k-en-de", tmp_path / "out", multi30k_dir, workers=1)
    assert manifest["archives"]["test-de"]["uncompressed_copy"]
    assert (tmp_path / "out/test.tgt").read_bytes() == \
        (multi30k_dir / "test_2016_flickr.de").read_bytes()


def test_corrupt_gzip_in_mirror(tmp_path, multi30k_dir):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    data = (mirror / "val.de.gz").read_bytes()
    (mirror / "val.de.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError, match=r"val.de.gz: corrupt or truncated gzip"):
        prepare("multi30k-en-de", tmp_path / "out", mirror)
    assert not (tmp_path / "out").exists()


def test_wrong_content_is_checksum_mismatch(tmp_path, multi30k_dir):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    (mirror / "val.de.gz").write_bytes(gzip.compress(b"not the real file\n"))
    with pytest.raises(IntegrityError, match=r"val.de.gz: content sha256 mismatch"):
        prepare("multi30k-en-de", tmp_path / "out", mirror)
    assert not (tmp_path / "out").exists()


def test_mirror_missing_files_lists_names_and_urls(tmp_path, multi30k_dir):
    mirror = build_multi30k_mirror(tmp_path / "mirror")
    (mirror / "train.de.gz").unlink()
    (mirror / "test_2016_flickr.en.gz").unlink()
    with pytest.raises(DownloadError) as err:
        prepare("multi30k-en-de", tmp_path / "out", mirror)
    message = str(err.value)
    assert "lacks 2 file(s)" in message and str(mirror) in message
    for name in ("train.de.gz", "test_2016_flickr.en.gz"):
        assert f"{name} (or {name[:-3]}) <- https://github.com/multi30k/dataset/raw/" \
               f"master/data/task1/raw/{name}" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
def test_output_is_the_same_for_any_worker_count(tmp_path, multi30k_dir):
    """29,000 training pairs are six cleaning chunks: 1 and 3 processes write the same."""
    one = prepare("multi30k-en-de", tmp_path / "one", multi30k_dir, workers=1)
    three = prepare("multi30k-en-de", tmp_path / "three", multi30k_dir, workers=3)
    assert one["splits"] == three["splits"]
    for name in ("train.src", "train.tgt", "valid.src", "test.tgt"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes()


def test_default_worker_count_is_the_core_count(tmp_path, multi30k_dir, monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, recipe, out, mirror, workers, *rest):
            seen.append(workers)

        def run(self):
            return {}

    monkeypatch.setattr("nmt.data.prep.available_cores", lambda: 5)
    monkeypatch.setattr("nmt.data.prep._Prep", Recorder)
    prepare("multi30k-en-de", tmp_path / "out", multi30k_dir)
    prepare("multi30k-en-de", tmp_path / "out", multi30k_dir, workers=2)
    assert seen == [5, 2]
