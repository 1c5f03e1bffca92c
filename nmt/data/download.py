"""Getting a recipe's archives: mirror look-up, resumable downloads, checksum verification.

A mirror directory is searched by the URL's file name before any network access (for a
`.gz` URL an uncompressed copy named without `.gz` is accepted too). Downloads go to
`DEST.part`, resume with an HTTP Range request, and are renamed to `DEST` only after the
checksums the recipe gives have matched; a mismatch removes the `.part` and writes nothing.
Progress goes to a `Reporter` (the CLI's draws rich bars on stderr: cli/progress.py);
nothing is printed here.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nmt.data.recipes import Archive
from nmt.errors import DownloadError, IntegrityError
from nmt.fileio import CHUNK


class Reporter(Protocol):
    """Receives progress of long steps (downloads, hashing, cleaning)."""

    def start(self, label: str, total: int | None) -> None:
        """A step named `label` begins; `total` units (bytes, lines) if known."""

    def advance(self, amount: int) -> None:
        """`amount` more units are done."""

    def done(self) -> None:
        """The current step finished (or failed)."""


class NullReporter:
    """A Reporter that ignores everything (library default, tests)."""

    def start(self, label: str, total: int | None) -> None:
        """Ignore."""

    def advance(self, amount: int) -> None:
        """Ignore."""

    def done(self) -> None:
        """Ignore."""


@dataclass(frozen=True)
class LocalFile:
    """Where an archive lies on disk. `uncompressed`: a mirror's plain copy of a `.gz` URL."""

    archive: Archive
    path: Path
    from_mirror: bool
    uncompressed: bool = False

    @property
    def gzipped(self) -> bool:
        """True when the bytes at `path` are a single gzip stream to decompress on read."""
        return self.archive.kind == "gz" and not self.uncompressed


def locate_in_mirror(archives: list[Archive], mirror: Path) -> dict[str, LocalFile]:
    """Map every archive to its file in `mirror`; DownloadError lists all that are missing."""
    if not mirror.is_dir():
        raise DownloadError(f"mirror {mirror} is not a directory; pass --mirror DIR (or set "
                            "NMT_MIRROR) to a folder holding the archives")
    found: dict[str, LocalFile] = {}
    missing: list[str] = []
    for archive in archives:
        exact = mirror / archive.file_name
        if exact.is_file():
            found[archive.id] = LocalFile(archive, exact, from_mirror=True)
        elif archive.kind == "gz" and (plain := mirror / archive.file_name[:-3]).is_file():
            found[archive.id] = LocalFile(archive, plain, from_mirror=True, uncompressed=True)
        else:
            alt = f" (or {archive.file_name[:-3]})" if archive.kind == "gz" else ""
            missing.append(f"{archive.file_name}{alt} <- {archive.url}")
    if missing:
        raise DownloadError(f"mirror {mirror} lacks {len(missing)} file(s): "
                            f"{'; '.join(missing)}; put them there or drop --mirror to "
                            "download")
    return found


def verify(local: LocalFile, reporter: Reporter | None = None) -> dict[str, str | int]:
    """Check every checksum the recipe gives that applies to `local`; return what matched.

    sha256, md5 and size describe the file as published, so they are skipped for an
    uncompressed mirror copy; content_sha256 is checked on the decompressed bytes. A local
    file (`path` archive) is always hashed: its sha256 is returned as its identity.
    Raises IntegrityError naming the file, the expected and the actual value.
    """
    archive, reporter = local.archive, reporter or NullReporter()
    checked: dict[str, str | int] = {}
    if not local.uncompressed and (archive.sha256 or archive.md5 or archive.size
                                   or archive.local):
        size = local.path.stat().st_size
        if archive.size is not None and size != archive.size:
            raise _mismatch(local.path, "size", str(archive.size), str(size))
        sha, md5 = hashlib.sha256(), hashlib.md5()
        reporter.start(f"verify {local.path.name}", size)
        try:
            with open(local.path, "rb") as handle:
                while block := handle.read(CHUNK):
                    sha.update(block)
                    md5.update(block)
                    reporter.advance(len(block))
        finally:
            reporter.done()
        for name, want, got in (("sha256", archive.sha256, sha.hexdigest()),
                                ("md5", archive.md5, md5.hexdigest())):
            if want is not None:
                if want != got:
                    raise _mismatch(local.path, name, want, got)
                checked[name] = got
        if archive.local:
            checked["sha256"] = sha.hexdigest()
        if archive.size is not None:
            checked["size"] = size
    if archive.content_sha256:
        got = _content_sha256(local, reporter)
        if got != archive.content_sha256:
            raise _mismatch(local.path, "content sha256", archive.content_sha256, got)
        checked["content_sha256"] = got
    return checked


def _content_sha256(local: LocalFile, reporter: Reporter) -> str:
    digest = hashlib.sha256()
    reporter.start(f"verify {local.path.name}", local.path.stat().st_size)
    try:
        with open(local.path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if local.gzipped else raw
            last = 0
            while block := stream.read(CHUNK):
                digest.update(block)
                reporter.advance(raw.tell() - last)
                last = raw.tell()
    except (OSError, EOFError, zlib.error) as err:
        raise IntegrityError(f"{local.path}: corrupt or truncated gzip ({err}); delete it "
                             "and fetch it again") from err
    finally:
        reporter.done()
    return digest.hexdigest()


def _mismatch(path: Path, what: str, want: str, got: str) -> IntegrityError:
    return IntegrityError(f"{path}: {what} mismatch (expected {want}, got {got}); the file is "
                          "corrupt or not the one the recipe names: delete it and fetch it "
                          "again")


class VerifiedCache:
    """Remembers files already verified (path, size, mtime, recipe checksums) in a JSON
    file, so a second run does not re-hash gigabytes of unchanged archives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, dict] = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def _key(local: LocalFile) -> tuple[str, dict]:
        stat = local.path.stat()
        a = local.archive
        return str(local.path.resolve()), {
            "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "uncompressed":
            local.uncompressed, "expect": [a.sha256, a.md5, a.size, a.content_sha256]}

    def get(self, local: LocalFile) -> dict | None:
        """The checks recorded for `local` if the file and the recipe are unchanged."""
        key, ident = self._key(local)
        entry = self.entries.get(key)
        return entry["checked"] if entry and entry.get("ident") == ident else None

    def put(self, local: LocalFile, checked: dict) -> None:
        """Record a successful verification (written by `save`)."""
        key, ident = self._key(local)
        self.entries[key] = {"ident": ident, "checked": checked}

    def save(self) -> None:
        """Write the cache atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.entries, indent=1), "utf-8")
        os.replace(tmp, self.path)


def download(archive: Archive, dest: Path, reporter: Reporter | None = None,
             retries: int = 3, timeout: float = 60.0) -> tuple[LocalFile, dict[str, str | int]]:
    """Fetch `archive.url` into `dest`, resuming `dest.part`; verify; rename into place.

    Returns the local file and the checks that matched.
    Up to `retries` attempts, each resuming where the last stopped. A checksum mismatch
    removes the `.part` (IntegrityError); a network failure keeps it for the next run
    (DownloadError).
    """
    reporter = reporter or NullReporter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    error: Exception | None = None
    for attempt in range(max(1, retries)):
        if attempt:
            time.sleep(min(2.0 ** attempt, 10.0) * 0.1)
        try:
            _fetch(archive.url, part, reporter, timeout)
            error = None
            break
        except (urllib.error.URLError, OSError, EOFError) as err:
            error = err
    if error is not None:
        got = part.stat().st_size if part.exists() else 0
        raise DownloadError(f"download of {archive.url} failed after {got} bytes "
                            f"({getattr(error, 'reason', None) or error}); run the same "
                            "command again to resume, or use --mirror DIR") from error
    local = LocalFile(archive, part, from_mirror=False)
    try:
        checked = verify(local, reporter)
    except IntegrityError:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, dest)
    return LocalFile(archive, dest, from_mirror=False), checked


def _fetch(url: str, part: Path, reporter: Reporter, timeout: float) -> None:
    """One attempt: append to `part` from its current size (Range), or restart it."""
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "nmt-prep"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing left to fetch: the part is complete
            return
        raise
    with response:
        status = getattr(response, "status", 200)
        if offset and status != 206:  # server ignored Range: start over
            offset = 0
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length is not None else None
        reporter.start(f"download {part.name[:-5]}", total)
        reporter.advance(offset)
        received = 0
        try:
            with open(part, "ab" if offset else "wb") as handle:
                while block := response.read(CHUNK):
                    handle.write(block)
                    received += len(block)
                    reporter.advance(len(block))
        finally:
            reporter.done()
        if length is not None and received < int(length):
            raise EOFError(f"connection closed after {offset + received} of {total} bytes")
