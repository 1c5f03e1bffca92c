"""A recipe for files already on this machine, from `nmt prep --train ... --valid ... --test`.

No TOML to write: the flags become the same tree a recipe file holds (archives with a local
`path`, the three splits, `[cleaning]`), validated by nmt.data.recipes and prepared by nmt.data.prep
exactly like a shipped recipe: same cleaning, manifest, atomic and idempotent outputs, and
dev/test copied unfiltered. Files are read where they lie, never copied; the manifest
records each one's path and sha256, so a re-run on other files redoes what they feed.

A file pair is `SRC,TGT` (plain text, .gz, or .sgm as in WMT's test sets); one WMT `.xml`
file holds both sides of a test set. Training pairs may end in `:WEIGHT`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nmt.data.recipes import Cleaning, Recipe, recipe_from_data
from nmt.errors import UsageError

_WEIGHT = re.compile(r"(?P<files>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_TAR = (".tgz", ".tar.gz", ".tar")


@dataclass(frozen=True)
class FilePair:
    """One corpus given on the command line: its two files (the same WMT .xml file twice
    for a test set in that format) and, for training data, its weight."""

    src: Path
    tgt: Path
    weight: float | None = None

    @property
    def xml(self) -> bool:
        """Both sides from one WMT .xml file (source and reference segments)."""
        return self.src == self.tgt and _plain_name(self.src).endswith(".xml")


def _plain_name(path: Path) -> str:
    """The file name, lower case, without a trailing .gz."""
    return path.name.lower().removesuffix(".gz")


def parse_pair(spec: str, flag: str, weighted: bool = False) -> FilePair:
    """`SRC,TGT` (or `FILE.xml`; with `weighted`, optionally `...:WEIGHT`) -> FilePair.

    Paths are taken from the working directory. UsageError names the flag and the value.
    """
    weight = None
    files = spec
    match = _WEIGHT.fullmatch(spec) if weighted else None
    if match and "," in match["files"]:
        files, weight = match["files"], float(match["weight"])
        if weight <= 0:
            raise UsageError(f"{flag} {spec}: the weight must be positive")
    parts = [p.strip() for p in files.split(",")]
    if len(parts) == 1 and _plain_name(Path(parts[0])).endswith(".xml"):
        parts = parts * 2
    if len(parts) != 2 or not all(parts):
        form = "SRC,TGT[:WEIGHT]" if weighted else "SRC,TGT (or one WMT .xml file)"
        raise UsageError(f"{flag} {spec}: expected {form}, two files separated by a comma")
    src, tgt = (Path(p).expanduser().absolute() for p in parts)
    for path in (src, tgt):
        if path.name.lower().endswith(_TAR):
            raise UsageError(f"{flag} {path}: a tar archive; extract the two files and give "
                             "them, or write a recipe with `member = ...`")
    return FilePair(src, tgt, weight)


def _corpus_name(pair: FilePair, taken: set[str]) -> str:
    """The source file's name without .gz and its last suffix (`train.en` -> `train`),
    made unique among `taken`."""
    base = Path(pair.src.name.removesuffix(".gz")).stem
    base = _UNSAFE_ID.sub("_", base).lstrip("_.-") or "corpus"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    taken.add(name)
    return name


def _format(path: Path, side: str, xml: bool) -> str:
    if xml:
        return "xml-src" if side == "src" else "xml-ref"
    return "sgm" if _plain_name(path).endswith(".sgm") else "text"


def files_recipe(src_lang: str, tgt_lang: str, train: Sequence[FilePair], valid: FilePair,
                 test: FilePair, vocab_size: int | None = None,
                 cleaning: dict[str, Any] | None = None) -> Recipe:
    """A validated in-memory recipe named `files-SRC-TGT` for the given local files.

    `vocab_size`: None takes ModelConfig's default (the paper's shared vocabulary);
    `cleaning`: Cleaning fields to change from their defaults.
    """
    from nmt.config import ModelConfig

    for flag, lang in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
        if not lang or _UNSAFE_ID.search(lang):
            raise UsageError(f"{flag} {lang!r}: give a language code such as en, de or pt_BR")
    if not train:
        raise UsageError("give at least one --train SRC,TGT")
    if len({pair.weight is None for pair in train}) > 1:
        raise UsageError("give every --train a weight (SRC,TGT:WEIGHT), or none (no "
                         "weights: every pair once per epoch)")
    unknown = sorted(set(cleaning or {}) - set(asdict(Cleaning())))
    if unknown:
        raise UsageError(f"unknown cleaning setting {unknown[0]!r}")
    archives: dict[str, dict[str, str]] = {}
    ids: dict[Path, str] = {}

    def archive_id(path: Path) -> str:
        if path not in ids:
            base = _UNSAFE_ID.sub("_", path.name).lstrip("_.-") or "file"
            aid, n = base, 1
            while aid in archives:
                n += 1
                aid = f"{base}-{n}"
            ids[path] = aid
            archives[aid] = {"path": str(path)}
        return ids[path]

    def corpus(pair: FilePair, names: set[str]) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": _corpus_name(pair, names)}
        for side, path in (("src", pair.src), ("tgt", pair.tgt)):
            entry[side] = {"archive": archive_id(path), "format": _format(path, side, pair.xml)}
        if pair.weight is not None:
            entry["weight"] = pair.weight
        return entry

    data: dict[str, Any] = {
        "name": f"files-{src_lang}-{tgt_lang}",
        "description": f"local files, {src_lang}->{tgt_lang}",
        "src_lang": src_lang, "tgt_lang": tgt_lang,
        "vocab_size": ModelConfig().vocab_size if vocab_size is None else vocab_size,
        "cleaning": dict(cleaning or {}),
        "train": [corpus(pair, names) for names in [set()] for pair in train],
        "valid": corpus(valid, set()), "test": corpus(test, set()),
    }
    data["archives"] = archives
    return recipe_from_data(data, "nmt prep flags")
