"""`nmt prep`: recipe -> verified archives -> extracted members -> OUT/{split}.{src,tgt}.

Steps, each skipped when a previous run finished it: locate (mirror) or download every
archive and verify it; extract the named tar members; write each split (training pairs
cleaned, dev and test copied in order) through temp files renamed into place, and record
line counts, cleaning counts and sha256s in OUT/manifest.json after every split. If a
run fails before writing anything, the directories it created are removed again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nmt import __version__
from nmt.data.clean import Counts, clean_pairs, without_line_breaks
from nmt.data.download import (
    LocalFile,
    NullReporter,
    Reporter,
    VerifiedCache,
    download,
    locate_in_mirror,
    verify,
)
from nmt.data.extract import extract_members, read_lines
from nmt.errors import DataError
from nmt.fileio import atomic_output, sha256_file
from nmt.recipes import SPLITS, Corpus, Recipe, Source, load_recipe

MANIFEST = "manifest.json"
SIDES = ("src", "tgt")


def default_out(recipe: Recipe) -> Path:
    """data/RECIPE, relative to the working directory."""
    return Path("data") / recipe.name


def prepare(recipe_ref: str, out: Path | None = None, mirror: Path | None = None,
            workers: int = 1, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run every unfinished step of `recipe_ref` into `out`; return the manifest."""
    recipe = load_recipe(recipe_ref)
    out = Path(out) if out is not None else default_out(recipe)
    existed = out.exists()
    try:
        return _Prep(recipe, out, mirror, max(1, workers), reporter or NullReporter()).run()
    except BaseException:
        if not existed and not (out / MANIFEST).exists():
            # Nothing finished: drop the verification cache too. Completed, verified
            # downloads stay (they are whole files, and costly to fetch again).
            (out / "raw" / "verified.json").unlink(missing_ok=True)
            _remove_empty_dirs(out)
        raise


def _remove_empty_dirs(root: Path) -> None:
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    if not any(root.iterdir()):
        root.rmdir()


class _Prep:
    """One `nmt prep` run; holds the recipe, output directory and progress reporter."""

    def __init__(self, recipe: Recipe, out: Path, mirror: Path | None, workers: int,
                 reporter: Reporter) -> None:
        self.recipe, self.out, self.mirror = recipe, out, mirror
        self.workers, self.reporter = workers, reporter
        self.raw = out / "raw"
        self.manifest = self._load_manifest()

    def run(self) -> dict[str, Any]:
        todo = [s for s in SPLITS if not self._split_done(s)]
        if todo:
            needed = sorted({src.archive for s in todo for c in self.recipe.splits[s]
                             for src in (c.src, c.tgt)})
            files = self._fetch([self.recipe.archives[a] for a in needed])
            for split in todo:
                self._write_split(split, files)
        return self.manifest

    # -- manifest and step fingerprints ------------------------------------------------
    def _load_manifest(self) -> dict[str, Any]:
        recipe = self.recipe
        base: dict[str, Any] = {
            "recipe": recipe.name, "recipe_file": str(recipe.path),
            "recipe_sha256": recipe.digest, "src_lang": recipe.src_lang,
            "tgt_lang": recipe.tgt_lang, "vocab_size": recipe.vocab_size,
            "cleaning": asdict(recipe.cleaning), "created_by": f"nmt {__version__}",
            "archives": {}, "splits": {}}
        try:
            old = json.loads((self.out / MANIFEST).read_text("utf-8"))
        except (OSError, ValueError):
            return base
        if old.get("recipe") == recipe.name and isinstance(old.get("splits"), dict):
            base["splits"] = old["splits"]
            base["archives"] = old.get("archives", {})
        return base

    def _fingerprint(self, split: str) -> str:
        """Everything a split's output depends on: its corpora, their archives' URLs and
        checksums, and (for train) the cleaning rules."""
        corpora = self.recipe.splits[split]
        used = sorted({s.archive for c in corpora for s in (c.src, c.tgt)})
        data = {"corpora": [asdict(c) for c in corpora],
                "archives": [asdict(self.recipe.archives[a]) for a in used],
                "cleaning": asdict(self.recipe.cleaning) if split == "train" else None,
                "version": 1}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def _split_done(self, split: str) -> bool:
        entry = self.manifest["splits"].get(split)
        if not entry or entry.get("fingerprint") != self._fingerprint(split):
            return False
        for side in SIDES:
            path = self.out / entry[side]["file"]
            if not path.is_file() or path.stat().st_size != entry[side]["bytes"] \
                    or sha256_file(path) != entry[side]["sha256"]:
                return False
        return True

    def _save_manifest(self) -> None:
        text = json.dumps(self.manifest, indent=2, ensure_ascii=False) + "\n"
        with atomic_output(self.out / MANIFEST) as tmp:
            tmp.write_text(text, "utf-8")

    # -- archives ------------------------------------------------------------------------
    def _fetch(self, archives: list) -> dict[str, LocalFile]:
        """Locate or download, then verify, every archive; extract tar members."""
        cache = VerifiedCache(self.raw / "verified.json")
        if self.mirror is not None:
            files = locate_in_mirror(archives, self.mirror)
            for local in files.values():  # all verified before anything is written
                checked = cache.get(local)
                if checked is None:
                    checked = verify(local, self.reporter)
                    cache.put(local, checked)
                self._record(local, checked)
        else:
            files = {}
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
                files[archive.id] = local
                self._record(local, checked)
        cache.save()
        return files

    def _record(self, local: LocalFile, checked: dict) -> None:
        self.manifest["archives"][local.archive.id] = {
            "url": local.archive.url, "path": str(local.path),
            "source": "mirror" if local.from_mirror else "download",
            "uncompressed_copy": local.uncompressed, "verified": checked}

    def _member_path(self, source: Source, files: dict[str, LocalFile]) -> tuple[Path, bool]:
        """Path to read for `source` and whether it is gzipped; extracts tars on demand."""
        local = files[source.archive]
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

    # -- splits --------------------------------------------------------------------------
    def _corpus_pairs(self, corpus: Corpus, files: dict[str, LocalFile], strict: bool
                      ) -> Iterator[tuple[str, str]]:
        """Lines of both sides in lockstep; DataError if their counts differ."""
        (src_path, src_gz), (tgt_path, tgt_gz) = (self._member_path(corpus.src, files),
                                                  self._member_path(corpus.tgt, files))
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

    def _write_split(self, split: str, files: dict[str, LocalFile]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        recipe = self.recipe
        corpora_counts: dict[str, Any] = {}
        total = Counts()
        paths = {side: self.out / f"{split}.{side}" for side in SIDES}
        digests = {side: hashlib.sha256() for side in SIDES}
        lines = 0
        self.reporter.start(f"{split}: write", None)
        try:
            with atomic_output(paths["src"]) as tmp_src, atomic_output(paths["tgt"]) as tmp_tgt:
                with open(tmp_src, "wb") as f_src, open(tmp_tgt, "wb") as f_tgt:
                    for corpus in recipe.splits[split]:
                        pairs = self._corpus_pairs(corpus, files, strict=split != "train")
                        if split == "train":
                            counts = Counts()
                            pairs = clean_pairs(pairs, recipe.cleaning, recipe.src_lang,
                                                recipe.tgt_lang, counts, self.workers)
                        for src, tgt in pairs:
                            if split != "train":
                                src, tgt = without_line_breaks(src), without_line_breaks(tgt)
                            for side, text, handle in (("src", src, f_src),
                                                       ("tgt", tgt, f_tgt)):
                                data = (text + "\n").encode("utf-8")
                                handle.write(data)
                                digests[side].update(data)
                            lines += 1
                            if lines % 10000 == 0:
                                self.reporter.advance(10000)
                        if split == "train":
                            total.add(counts)
                            corpora_counts[corpus.name] = counts.to_dict()
        finally:
            self.reporter.done()
        entry: dict[str, Any] = {
            "lines": lines, "fingerprint": self._fingerprint(split),
            "corpora": [c.name for c in recipe.splits[split]],
            **{side: {"file": paths[side].name, "sha256": digests[side].hexdigest(),
                      "bytes": paths[side].stat().st_size} for side in SIDES}}
        if split == "train":
            entry["cleaning_counts"] = {"total": total.to_dict(), **corpora_counts}
        self.manifest["splits"][split] = entry
        self._save_manifest()

