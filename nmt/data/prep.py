"""`nmt prep`: recipe -> verified archives -> extracted members -> OUT/{split}.{src,tgt}.

Steps, each skipped when a previous run finished it: locate (mirror) or download every
archive and verify it; extract the named tar members; write each split (training pairs
cleaned, deduplicated and freed of dev/test sources; dev and test copied in order) through
temp files renamed into place, and record line counts, per-corpus line ranges and weights,
cleaning counts and sha256s in OUT/manifest.json after every split. If a run fails before
writing anything, the directories it created are removed again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nmt import __version__
from nmt.cores import available_cores
from nmt.data.clean import Counts, PairCleaner, clean_pairs, without_line_breaks
from nmt.data.dedup import DigestSet
from nmt.data.download import NullReporter, Reporter
from nmt.data.recipes import SPLITS, Corpus, Recipe, load_recipe
from nmt.data.sources import ArchiveFiles
from nmt.fileio import atomic_output, sha256_file

MANIFEST = "manifest.json"
# Bumped whenever the same inputs and settings would give different output text, so data
# prepared by an older nmt is redone. 2: Moses' Penn quote rules (` and '') now applied;
# duplicates and dev/test sources removed from training data.
PREP_VERSION = 2
HELD_OUT = ("valid", "test")
SIDES = ("src", "tgt")


def default_out(recipe: Recipe) -> Path:
    """data/RECIPE, relative to the working directory."""
    return Path("data") / recipe.name


def prepare(recipe_ref: str | Recipe, out: Path | None = None, mirror: Path | None = None,
            workers: int | None = None, reporter: Reporter | None = None,
            report: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Run every unfinished step of a recipe (name, .toml path, or one built in memory,
    e.g. by nmt.data.local_recipe.files_recipe) into `out`; return the manifest.

    `workers`: processes cleaning the training text (None: every core this process may
    use); the output is the same for any number. `report` receives one-line notes (a split
    redone because its inputs or settings changed since the last run).
    """
    recipe = recipe_ref if isinstance(recipe_ref, Recipe) else load_recipe(recipe_ref)
    out = Path(out) if out is not None else default_out(recipe)
    existed = out.exists()
    workers = available_cores() if workers is None else max(1, workers)
    try:
        return _Prep(recipe, out, mirror, workers, reporter or NullReporter(), report).run()
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
                 reporter: Reporter, report: Callable[[str], None]) -> None:
        self.recipe, self.out = recipe, out
        self.workers, self.reporter, self.report = workers, reporter, report
        self.manifest = self._load_manifest()
        self.sources = ArchiveFiles(recipe, out / "raw", mirror, reporter)

    def run(self) -> dict[str, Any]:
        # Local files first: their sha256 is part of the fingerprints, so a run on other
        # files (or changed ones) redoes the splits made from them.
        self.sources.identify_local()
        todo = [s for s in SPLITS if not self._split_done(s)]
        for split in todo:
            if split in self.manifest["splits"]:
                self.report(f"{split}: inputs or settings differ from the last run's; "
                            "writing it again")
        if todo:
            self.sources.check_local_line_counts(c for s in todo for c in self.recipe.splits[s])
            needed = sorted({src.archive for s in todo for c in self._inputs(s)
                             for src in (c.src, c.tgt)})
            self.sources.fetch([self.recipe.archives[a] for a in needed])
            self.manifest["archives"].update(self.sources.records)
            for split in todo:
                self._write_split(split)
        # Archives no split of this recipe reads any more (a run on other files) go.
        self.manifest["archives"] = {k: v for k, v in self.manifest["archives"].items()
                                     if k in self.recipe.archives}
        self._record_weights()
        self._save_manifest(only_if_changed=True)
        return self.manifest

    # -- manifest and step fingerprints ------------------------------------------------
    def _load_manifest(self) -> dict[str, Any]:
        recipe = self.recipe
        base: dict[str, Any] = {
            "recipe": recipe.name,
            "recipe_file": None if recipe.path is None else str(recipe.path),
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

    def _inputs(self, split: str) -> list[Corpus]:
        """The corpora a split's output is made from: its own, and for train with
        `remove_overlap` also dev and test (their sources are removed from it)."""
        corpora = list(self.recipe.splits[split])
        if split == "train" and self.recipe.cleaning.remove_overlap:
            corpora += [c for s in HELD_OUT for c in self.recipe.splits[s]]
        return corpora

    def _fingerprint(self, split: str) -> str:
        """Everything a split's text depends on: its input corpora, their archives' URLs
        and checksums, and (for train) the cleaning rules. Not the weights: they change
        the manifest only (see _record_weights)."""
        corpora = self._inputs(split)
        used = sorted({s.archive for c in corpora for s in (c.src, c.tgt)})
        data = {"corpora": [{"name": c.name, "src": asdict(c.src), "tgt": asdict(c.tgt)}
                            for c in corpora],
                "archives": [{**asdict(self.recipe.archives[a]),
                              "local_sha256": self.sources.local_sha256(a)} for a in used],
                "cleaning": asdict(self.recipe.cleaning) if split == "train" else None,
                "version": PREP_VERSION}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def _record_weights(self) -> None:
        """Copy the recipe's corpus weights into the manifest's corpus entries (a weight
        changes how training samples, not the prepared text)."""
        for split, corpora in self.recipe.splits.items():
            entries = self.manifest["splits"].get(split, {}).get("corpora", [])
            for entry, corpus in zip(entries, corpora, strict=False):
                if isinstance(entry, dict) and entry.get("name") == corpus.name:
                    entry["weight"] = corpus.weight

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

    def _save_manifest(self, only_if_changed: bool = False) -> None:
        text = json.dumps(self.manifest, indent=2, ensure_ascii=False) + "\n"
        path = self.out / MANIFEST
        if only_if_changed:
            try:
                if path.read_text("utf-8") == text:
                    return
            except OSError:
                pass
        with atomic_output(path) as tmp:
            tmp.write_text(text, "utf-8")

    # -- splits --------------------------------------------------------------------------
    def _held_out_sources(self) -> frozenset[str]:
        """Dev and test source sentences, normalized as training sources are."""
        recipe = self.recipe
        if not recipe.cleaning.remove_overlap:
            return frozenset()
        cleaner = PairCleaner(recipe.cleaning, recipe.src_lang, recipe.tgt_lang)
        return frozenset(cleaner.normalize(src, 0) for split in HELD_OUT
                         for corpus in recipe.splits[split]
                         for src, _ in self.sources.corpus_pairs(corpus, strict=True))

    def _write_split(self, split: str) -> None:
        """Write OUT/{split}.src/.tgt atomically and record the split in the manifest."""
        self.out.mkdir(parents=True, exist_ok=True)
        recipe, train = self.recipe, split == "train"
        held_out = self._held_out_sources() if train else frozenset()
        seen = DigestSet()  # training pairs written so far, across corpora (dedup)
        corpora: list[dict[str, Any]] = []
        counts: dict[str, Any] = {}
        total = Counts()
        paths = {side: self.out / f"{split}.{side}" for side in SIDES}
        digests = {side: hashlib.sha256() for side in SIDES}
        lines = 0
        self.reporter.start(f"{split}: write", None)
        try:
            with atomic_output(paths["src"]) as tmp_src, atomic_output(paths["tgt"]) as tmp_tgt:
                with open(tmp_src, "wb") as f_src, open(tmp_tgt, "wb") as f_tgt:
                    for corpus in recipe.splits[split]:
                        start, corpus_counts = lines, Counts()
                        pairs = self.sources.corpus_pairs(corpus, strict=not train)
                        if train:
                            pairs = clean_pairs(pairs, recipe.cleaning, recipe.src_lang,
                                                recipe.tgt_lang, corpus_counts, self.workers,
                                                held_out=held_out, seen=seen)
                        for src, tgt in pairs:
                            if not train:
                                src, tgt = without_line_breaks(src), without_line_breaks(tgt)
                            for side, text, handle in (("src", src, f_src),
                                                       ("tgt", tgt, f_tgt)):
                                data = (text + "\n").encode("utf-8")
                                handle.write(data)
                                digests[side].update(data)
                            lines += 1
                            if lines % 10000 == 0:
                                self.reporter.advance(10000)
                        corpora.append({"name": corpus.name, "start": start,
                                        "lines": lines - start, "weight": corpus.weight})
                        if train:
                            total.add(corpus_counts)
                            counts[corpus.name] = corpus_counts.to_dict()
        finally:
            self.reporter.done()
        entry: dict[str, Any] = {
            "lines": lines, "fingerprint": self._fingerprint(split), "corpora": corpora,
            **{side: {"file": paths[side].name, "sha256": digests[side].hexdigest(),
                      "bytes": paths[side].stat().st_size} for side in SIDES}}
        if train:
            entry["cleaning_counts"] = {"total": total.to_dict(), **counts}
        self.manifest["splits"][split] = entry
        self._save_manifest()
