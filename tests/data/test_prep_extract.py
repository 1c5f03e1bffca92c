"""Archive extraction and test-set readers: safe tar members, sacreBLEU-exact SGML."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest
from helpers.wmt import make_tgz

from nmt.data.extract import extract_members, read_lines
from nmt.errors import DataError, IntegrityError


def test_sgm_conversion_is_byte_identical_to_reference(wmt14_dir):
    for sgm, ref in (("newstest2014-deen-src.en.sgm", "newstest2014.en"),
                     ("newstest2014-deen-ref.de.sgm", "newstest2014.de")):
        lines = list(read_lines(wmt14_dir / "sgm" / sgm, fmt="sgm"))
        assert len(lines) == 3003
        assert "".join(s + "\n" for s in lines).encode() == (wmt14_dir / ref).read_bytes()


def test_wmt_xml_reads_src_and_ref_sides(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<dataset id="x"><collection id="general"><doc id="d1" origlang="en">'
                   '<src lang="en"><p><seg id="1"> A  &amp; B </seg><seg id="2">C</seg></p>'
                   '</src><ref lang="de" translator="A"><p><seg id="1">A &amp; B</seg>'
                   '<seg id="2">C2</seg></p></ref></doc></collection></dataset>', "utf-8")
    assert list(read_lines(xml, fmt="xml-src")) == ["A & B", "C"]
    assert list(read_lines(xml, fmt="xml-ref")) == ["A & B", "C2"]


def test_extract_writes_only_named_members(tmp_path):
    archive = make_tgz(tmp_path / "a.tgz", {"training/x.en": b"a\n", "training/x.de": b"b\n",
                                            "other": b"c"})
    extract_members(archive, {"training/x.en", "training/x.de"}, tmp_path / "out")
    assert (tmp_path / "out/training/x.en").read_bytes() == b"a\n"
    assert not (tmp_path / "out/other").exists()


@pytest.mark.parametrize("name", ["../evil", "/tmp/evil", "a/../../evil"])
def test_tar_member_escaping_is_refused(tmp_path, name):
    archive = tmp_path / "a.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(IntegrityError, match="outside the output directory") as err:
        extract_members(archive, {"evil"}, tmp_path / "out")
    assert str(archive) in str(err.value)
    assert list(tmp_path.iterdir()) == [archive]  # no dest, no temp dir left


def test_truncated_archive_is_integrity_error_and_leaves_nothing(tmp_path):
    big = bytes(range(256)) * 4000
    archive = make_tgz(tmp_path / "a.tgz", {"x.en": big, "x.de": big})
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(IntegrityError, match="truncated or corrupt"):
        extract_members(archive, {"x.en", "x.de"}, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [archive]


def test_missing_member_is_data_error(tmp_path):
    archive = make_tgz(tmp_path / "a.tgz", {"x.en": b"a\n"})
    with pytest.raises(DataError, match="no member 'x.de'"):
        extract_members(archive, {"x.en", "x.de"}, tmp_path / "out")


def test_corrupt_gzip_and_bad_utf8_name_the_file(tmp_path):
    bad = tmp_path / "c.gz"
    data = gzip.compress(b"hello\n" * 1000)
    bad.write_bytes(data[:-30])
    with pytest.raises(IntegrityError, match="c.gz: corrupt or truncated gzip"):
        list(read_lines(bad, gzipped=True))
    latin = tmp_path / "l.txt"
    latin.write_bytes(b"ok\nGr\xfc\xdfe\n")
    with pytest.raises(DataError, match=r"l.txt: line 2: invalid UTF-8"):
        list(read_lines(latin, strict=True))
    assert list(read_lines(latin, strict=False)) == ["ok", "Gr\ufffd\ufffde"]


def test_only_newline_ends_a_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("a\rb\r\nc\u2028d".encode())
    assert list(read_lines(path)) == ["a\rb\r", "c\u2028d"]
