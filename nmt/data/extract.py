"""Unpacking archives and reading their text: tar members, gzip streams, WMT SGML and XML.

Tar archives are streamed once and only the members a recipe names are written, into a
temp directory renamed into place when the whole archive has been read, so a truncated or
corrupt archive leaves nothing behind. Any member with an absolute path or `..` is refused
before anything is written. Readers yield lines without their newline; WMT test sets are
converted exactly as sacreBLEU converts them, so `newstest2014` comes out byte-identical to
sacreBLEU's `wmt14/full` text.
"""

from __future__ import annotations

import gzip
import re
import shutil
import tarfile
import tempfile
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from nmt.errors import DataError, IntegrityError
from nmt.fileio import CHUNK

_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, OSError)
_SEG = re.compile(r"<seg.*?>(.*)</seg>.*?")
_SPACES = re.compile(r"\s+")


def _member_name(name: str) -> str:
    """Normalise a tar member name ('./a/b' -> 'a/b')."""
    while name.startswith("./"):
        name = name[2:]
    return name


def _unsafe(name: str) -> bool:
    pure = PurePosixPath(name)
    return (pure.is_absolute() or ".." in pure.parts or name.startswith("\\")
            or (len(name) > 1 and name[1] == ":"))


def extract_members(archive: Path, members: set[str], dest: Path) -> None:
    """Stream `archive` (tar, tgz) and write the named `members` under `dest`.

    `dest` appears only once every member is written. IntegrityError: truncated or corrupt
    archive, or a member path that would escape `dest`; DataError: a named member is absent
    or not a regular file.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        found = _stream_tar(archive, members, tmp)
        absent = sorted(members - found)
        if absent:
            raise DataError(f"{archive}: has no member {absent[0]!r}; check the recipe's "
                            "member paths against `tar tf` of the archive")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stream_tar(archive: Path, members: set[str], out: Path) -> set[str]:
    found: set[str] = set()
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for info in tar:
                if _unsafe(info.name) or (info.issym() or info.islnk()) and _unsafe(
                        info.linkname):
                    raise IntegrityError(f"{archive}: member {info.name!r} would be written "
                                         "outside the output directory; refusing this "
                                         "archive (do not use it)")
                name = _member_name(info.name)
                if name not in members:
                    continue
                if not info.isfile():
                    raise DataError(f"{archive}: member {name!r} is not a regular file; "
                                    "check the recipe's member path")
                source = tar.extractfile(info)
                assert source is not None  # a regular file always has data
                target = out / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as handle:
                    shutil.copyfileobj(source, handle, CHUNK)
                found.add(name)
    except (IntegrityError, DataError):
        raise
    except _ARCHIVE_ERRORS as err:
        reason = str(err) or type(err).__name__
        raise IntegrityError(f"{archive}: truncated or corrupt archive ({reason}); delete "
                             "it and fetch it again") from err
    return found


def _open_bytes(path: Path, gzipped: bool) -> IO[bytes]:
    try:
        return gzip.open(path, "rb") if gzipped else open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open ({err.strerror or err}); check the file") \
            from err


def read_lines(path: Path, gzipped: bool = False, strict: bool = True,
               fmt: str = "text") -> Iterator[str]:
    """Yield the segments of a text, SGML or XML file (UTF-8), without line endings.

    Lines end only at '\\n': a stray '\\r' stays inside its line, so pairs never shift.
    `strict`: invalid UTF-8 is a DataError naming file and line; otherwise it becomes
    U+FFFD. A corrupt gzip is an IntegrityError naming the file.
    """
    if not gzipped and path.name.endswith(".gz"):
        gzipped = True  # tar members such as giga-fren.release2.fixed.en.gz
    errors = "strict" if strict else "replace"
    line_no = 0
    try:
        with _open_bytes(path, gzipped) as handle:
            if fmt in ("xml-src", "xml-ref"):
                yield from _xml_segments(handle, path, fmt[4:])
                return
            for line_no, raw in enumerate(handle, 1):  # noqa: B007 (used in errors)
                line = raw.decode("utf-8", errors)
                if fmt == "sgm":
                    if line.startswith("<seg "):
                        yield _SPACES.sub(" ", _SEG.sub(r"\1", line).strip())
                else:
                    yield line[:-1] if line.endswith("\n") else line
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: line {line_no}: invalid UTF-8 ({err.reason}); "
                        "convert the file to UTF-8") from err
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise IntegrityError(f"{path}: corrupt or truncated gzip ({err or 'unexpected end'}"
                             "); delete it and fetch it again") from err


def _xml_segments(handle: IO[bytes], path: Path, side: str) -> Iterator[str]:
    """WMT XML (2021+, source and references in one file): the <seg>s of each document's
    <src> (side 'src') or first <ref> (side 'ref'), whitespace-cleaned as sacreBLEU does."""
    try:
        root = ET.parse(handle).getroot()
    except ET.ParseError as err:
        raise DataError(f"{path}: malformed XML ({err}); check the file") from err
    for doc in root.iter("doc"):
        block = doc.find(side)
        if block is None:
            raise DataError(f"{path}: document {doc.get('id')!r} has no <{side}>; check "
                            "the recipe's format (xml-src / xml-ref)")
        for seg in block.iter("seg"):
            yield _SPACES.sub(" ", "".join(seg.itertext()).strip())
