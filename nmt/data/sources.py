"""Where a recipe's inputs are on disk, and their lines: local files read where they lie,
mirror copies, downloads (each verified, the result cached by path, size and mtime), tar
members extracted on demand, and the two sides of a corpus read in lockstep.

`nmt prep` (nmt/data/prep.py) drives one `ArchiveFiles` per run and copies its `records` (path,
origin, checks and, for local files, sha256) into the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nmt.data.download import (
    LocalFile,
    Reporter,
    VerifiedCache,
    download,
    locate_in_mirror,
    verify,
)
from nmt.data.extract import extract_members, read_lines
from nmt.data.recipes import Archive, Corpus, Recipe, Source
from nmt.errors import DataError
from nmt.fileio import count_lines


class ArchiveFiles:
    """The archives of one recipe under OUT/raw (downloads, extracted members, the
    verification cache), or in `mirror`, or (local `path` archives) where they are."""

    def __init__(self, recipe: Recipe, raw: Path, mirror: Path | None,
                 reporter: Reporter) -> None:
        self.recipe, self.raw, self.mirror, self.reporter = recipe, raw, mirror, reporter
        self.files: dict[str, LocalFile] = {}  # archive id -> file, once fetched
        self.records: dict[str, dict[str, Any]] = {}  # archive id -> manifest entry
        self._local: dict[str, tuple[LocalFile, dict]] = {}

    def local_sha256(self, archive_id: str) -> str | None:
        """sha256 of a local file (after `identify_local`), None for other archives."""
        entry = self._local.get(archive_id)
        return None if entry is None else str(entry[1]["sha256"])

    def identify_local(self) -> None:
        """Hash (and verify, where the recipe gives checksums) every local file; hashes are
        cached by path, size and modification time, so a re-run reads nothing."""
        local = [a for a in self.recipe.archives.values() if a.local]
        if not local:
            return
        cache = VerifiedCache(self.raw / "verified.json")
        for archive in local:
            path = Path(str(archive.path))
            if not path.is_file():
                raise DataError(f"{path}: no such file; check the path given to --train, "
                                "--valid or --test (or the recipe's archive path)")
            file = LocalFile(archive, path, from_mirror=False)
            checked = cache.get(file)
            if checked is None:
                checked = verify(file, self.reporter)
                cache.put(file, checked)
            self._local[archive.id] = (file, checked)
        cache.save()

    def check_local_line_counts(self, corpora: Iterable[Corpus]) -> None:
        """Both sides of a corpus made of two local plain-text files have as many lines:
        checked in seconds before cleaning, which may take hours (other inputs are checked
        as they are read)."""
        for corpus in corpora:
            sides = [self.recipe.archives[s.archive] for s in (corpus.src, corpus.tgt)]
            if all(a.local and a.kind == "plain" for a in sides) and \
                    corpus.src.format == corpus.tgt.format == "text":
                src, tgt = (Path(str(a.path)) for a in sides)
                n_src, n_tgt = count_lines(src), count_lines(tgt)
                if n_src != n_tgt:
                    raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}; corpus "
                                    f"{corpus.name!r} is not parallel (one line per "
                                    "sentence, same order on both sides)")

    def fetch(self, archives: list[Archive]) -> None:
        """Locate or download, then verify, every archive (all before anything is written).
        Local files were identified already and are read where they lie."""
        for archive in archives:
            if archive.local:
                self._record(*self._local[archive.id])
        archives = [a for a in archives if not a.local]
        if not archives:
            return
        cache = VerifiedCache(self.raw / "verified.json")
        if self.mirror is not None:
            for local in locate_in_mirror(archives, self.mirror).values():
                checked = cache.get(local)
                if checked is None:
                    checked = verify(local, self.reporter)
                    cache.put(local, checked)
                self._record(local, checked)
        else:
            for archive in archives:
                dest = self.raw / "downloads" / archive.file_name
                local = LocalFile(archive, dest, from_mirror=False)
                if dest.is_file():
                    checked = cache.get(local)
                    if checked is None:
                        checked = verify(local, self.reporter)
                else:
                    local, checked = download(archive, dest, self.reporter)
                cache.put(local, checked)
                self._record(local, checked)
        cache.save()

    def _record(self, local: LocalFile, checked: dict) -> None:
        archive = local.archive
        self.files[archive.id] = local
        entry: dict[str, Any] = {
            "url": archive.url, "path": str(local.path),
            "source": "local" if archive.local else
            "mirror" if local.from_mirror else "download",
            "uncompressed_copy": local.uncompressed, "verified": checked}
        if archive.local:  # the file's identity, whether or not the recipe gave a checksum
            entry["verified"] = {k: v for k, v in checked.items()
                                 if k != "sha256" or archive.sha256}
            entry.update(sha256=checked["sha256"], bytes=local.path.stat().st_size)
        self.records[archive.id] = entry

    def member_path(self, source: Source) -> tuple[Path, bool]:
        """Path to read for `source` and whether it is gzipped; extracts tars on demand."""
        local = self.files[source.archive]
        if source.member is None:
            return local.path, local.gzipped
        dest = self.raw / "extract" / source.archive
        wanted = sorted({s.member for c in self.recipe.splits.values() for corpus in c
                         for s in (corpus.src, corpus.tgt)
                         if s.archive == source.archive and s.member})
        stamp = dest / ".extracted.json"
        ident = {"archive": str(local.path), "size": local.path.stat().st_size,
                 "mtime_ns": local.path.stat().st_mtime_ns, "members": wanted}
        try:
            done = json.loads(stamp.read_text("utf-8")) == ident
        except (OSError, ValueError):
            done = False
        if not done:
            self.reporter.start(f"extract {local.path.name}", None)
            try:
                extract_members(local.path, set(wanted), dest)
            finally:
                self.reporter.done()
            stamp.write_text(json.dumps(ident), "utf-8")
        return dest / source.member, False

    def corpus_pairs(self, corpus: Corpus, strict: bool) -> Iterator[tuple[str, str]]:
        """Lines of both sides in lockstep; DataError if their counts differ. `strict`:
        invalid UTF-8 is an error (else U+FFFD)."""
        (src_path, src_gz), (tgt_path, tgt_gz) = (self.member_path(corpus.src),
                                                  self.member_path(corpus.tgt))
        src_lines = read_lines(src_path, src_gz, strict, corpus.src.format)
        tgt_lines = read_lines(tgt_path, tgt_gz, strict, corpus.tgt.format)
        n = 0
        sentinel = object()
        while True:
            src, tgt = next(src_lines, sentinel), next(tgt_lines, sentinel)
            if src is sentinel or tgt is sentinel:
                if src is not tgt:
                    short = src_path if src is sentinel else tgt_path
                    raise DataError(f"{short}: ends after {n} lines but its pair "
                                    f"{tgt_path if short == src_path else src_path} goes "
                                    f"on; corpus {corpus.name!r} is not parallel")
                return
            n += 1
            yield src, tgt  # type: ignore[misc]
