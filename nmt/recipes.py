"""Recipes: the TOML files in `recipes/` that say what `nmt prep` fetches and how it cleans.

A recipe is data, not code. It names its archives (URL plus whatever checksums are known),
which archive members make each split, the language pair, the cleaning rules of the training
data and the vocabulary size `nmt bpe` uses. Every key is checked here, once: an unknown key
or a bad value is a UsageError naming the recipe file, the key and the valid choices, so the
rest of the pipeline can trust a `Recipe`.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import nmt
from nmt.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency only there)
    import tomli as tomllib

RECIPE_DIR = Path(nmt.__file__).resolve().parents[1] / "recipes"
SPLITS: tuple[str, ...] = ("train", "valid", "test")
FORMATS: tuple[str, ...] = ("text", "sgm", "xml-src", "xml-ref")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HEX = {"sha256": 64, "md5": 32, "content_sha256": 64}


@dataclass(frozen=True)
class Archive:
    """One downloadable file. `file_name` is the name a mirror must hold.

    Checksums: `sha256` / `md5` / `size` describe the file as downloaded; `content_sha256`
    describes the decompressed bytes of a single-file `.gz` (stable whatever gzip level made
    it, and checkable on an uncompressed mirror copy). Only what is given is verified.
    """

    id: str
    url: str
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None
    content_sha256: str | None = None

    @property
    def file_name(self) -> str:
        """The URL's last path component: the name looked up in a mirror."""
        return PurePosixPath(urlparse(self.url).path).name

    @property
    def kind(self) -> str:
        """'tar' for .tgz/.tar.gz/.tar, 'gz' for a single gzipped file, else 'plain'."""
        name = self.file_name
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            return "tar"
        return "gz" if name.endswith(".gz") else "plain"

    @property
    def verifiable(self) -> bool:
        """True when at least one checksum or size is known."""
        return any(v is not None for v in (self.sha256, self.md5, self.size,
                                           self.content_sha256))


@dataclass(frozen=True)
class Source:
    """One side of a corpus: an archive, plus the member path inside it for tar archives."""

    archive: str
    member: str | None = None
    format: str = "text"


@dataclass(frozen=True)
class Corpus:
    """A parallel corpus: source-language and target-language files of equal line count."""

    name: str
    src: Source
    tgt: Source


@dataclass(frozen=True)
class Cleaning:
    """Rules applied to TRAINING pairs only (dev and test are never filtered)."""

    normalize_punctuation: bool = True  # sacremoses MosesPunctNormalizer, per language
    remove_non_printing: bool = True  # Moses remove-non-printing-char: \p{C} -> space
    min_words: int = 1  # drop pairs with a side shorter than this (1: drop empty sides)
    max_words: int = 250  # drop pairs with a side longer than this (whitespace words)
    max_ratio: float = 1.5  # drop pairs whose word-count ratio exceeds this (0: no limit)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; `path` is the file it came from, `digest` its sha256."""

    name: str
    path: Path
    digest: str
    src_lang: str
    tgt_lang: str
    vocab_size: int
    archives: dict[str, Archive]
    splits: dict[str, list[Corpus]]
    cleaning: Cleaning = field(default_factory=Cleaning)
    description: str = ""
    # Training defaults for this data (`arch` plus ModelConfig / TrainConfig fields); they
    # override nmt.config's defaults and are overridden by `nmt train` flags.
    training: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the manifest."""
        data = asdict(self)
        data["path"] = str(self.path)
        return data


def recipe_names() -> list[str]:
    """Names of the recipes shipped in `recipes/`."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))


def find_recipe(name_or_path: str) -> Path:
    """A shipped recipe name (`wmt14-en-de`) or a path to a `.toml` file -> its path."""
    candidate = Path(name_or_path)
    if name_or_path.endswith(".toml") or candidate.is_file():
        if not candidate.is_file():
            raise UsageError(f"recipe file {candidate} not found; give an existing .toml path "
                             f"or one of: {', '.join(recipe_names())}")
        return candidate
    path = RECIPE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise UsageError(f"unknown recipe {name_or_path!r}; choose one of: "
                         f"{', '.join(recipe_names())} (or give a path to a .toml file)")
    return path


def load_recipe(name_or_path: str) -> Recipe:
    """Find, parse and validate a recipe (UsageError on any problem)."""
    path = find_recipe(name_or_path)
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not valid TOML ({err}); fix the file") from err
    return _Parser(path).recipe(data, hashlib.sha256(raw).hexdigest())


class _Parser:
    """Validates the TOML tree key by key, with errors that name file and key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, message: str) -> UsageError:
        return UsageError(f"{self.path}: {key}: {message}")

    def table(self, value: Any, key: str, allowed: dict[str, bool]) -> dict[str, Any]:
        """Check `value` is a table whose keys are in `allowed` (name -> required)."""
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a table, got {type(value).__name__}")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                            f"unknown key; valid keys: {', '.join(sorted(allowed))}")
        missing = [k for k, required in allowed.items() if required and k not in value]
        if missing:
            raise self.fail(f"{key}.{missing[0]}" if key else missing[0],
                            "required key is missing")
        return value

    def typed(self, value: Any, key: str, kind: type | tuple[type, ...]) -> Any:
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise self.fail(key, f"must be a number, got {value!r}")
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "number"
            raise self.fail(key, f"must be a {names}, got {value!r}")
        return value

    def recipe(self, data: dict[str, Any], digest: str) -> Recipe:
        self.table(data, "", {"name": True, "description": False, "src_lang": True,
                              "tgt_lang": True, "vocab_size": True, "cleaning": False,
                              "archives": True, "train": True, "valid": True, "test": True,
                              "training": False})
        for key in ("name", "src_lang", "tgt_lang"):
            value = self.typed(data[key], key, str)
            if not _ID.match(value):
                raise self.fail(key, f"{value!r} is not a plain name (letters, digits, -_.)")
        vocab_size = self.typed(data["vocab_size"], "vocab_size", int)
        if vocab_size < 8:
            raise self.fail("vocab_size", f"must be >= 8, got {vocab_size}")
        table = data["archives"]
        if not isinstance(table, dict):
            raise self.fail("archives", "must be a table of archive-id = {url = ...}")
        archives = {aid: self.archive(aid, spec) for aid, spec in table.items()}
        if not archives:
            raise self.fail("archives", "needs at least one archive")
        splits = {split: self.corpora(split, data[split], archives) for split in SPLITS}
        return Recipe(name=data["name"], path=self.path.resolve(), digest=digest,
                      src_lang=data["src_lang"], tgt_lang=data["tgt_lang"],
                      vocab_size=vocab_size, archives=archives, splits=splits,
                      cleaning=self.cleaning(data.get("cleaning", {})),
                      description=self.typed(data.get("description", ""), "description",
                                             str),
                      training=self.training(data.get("training", {})))

    def archive(self, aid: str, spec: Any) -> Archive:
        key = f"archives.{aid}"
        if not _ID.match(aid):
            raise self.fail(key, "archive ids are plain names (letters, digits, -_.)")
        self.table(spec, key, {"url": True, "sha256": False, "md5": False, "size": False,
                               "content_sha256": False})
        url = self.typed(spec["url"], f"{key}.url", str)
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https", "file") or not PurePosixPath(
                parsed.path).name:
            raise self.fail(f"{key}.url", f"{url!r} must be an http(s):// or file:// URL "
                            "ending in a file name")
        for name, length in _HEX.items():
            value = spec.get(name)
            if value is not None and not re.fullmatch(f"[0-9a-f]{{{length}}}",
                                                      self.typed(value, f"{key}.{name}", str)):
                raise self.fail(f"{key}.{name}", f"must be {length} lowercase hex digits")
        size = spec.get("size")
        if size is not None and self.typed(size, f"{key}.size", int) <= 0:
            raise self.fail(f"{key}.size", f"must be a positive byte count, got {size}")
        archive = Archive(id=aid, url=url, sha256=spec.get("sha256"), md5=spec.get("md5"),
                          size=size, content_sha256=spec.get("content_sha256"))
        if archive.content_sha256 and archive.kind == "tar":
            raise self.fail(f"{key}.content_sha256", "only applies to single-file archives "
                            "(.gz or plain); use sha256/md5/size for a tar")
        return archive

    def corpora(self, split: str, value: Any, archives: dict[str, Archive]) -> list[Corpus]:
        items = value if isinstance(value, list) else [value]
        if split != "train" and len(items) != 1:
            raise self.fail(split, "dev and test sets take exactly one corpus")
        if not items:
            raise self.fail(split, "needs at least one corpus")
        corpora = []
        for i, item in enumerate(items):
            key = f"{split}[{i}]" if isinstance(value, list) else split
            self.table(item, key, {"name": False, "src": True, "tgt": True})
            name = self.typed(item.get("name", f"{split}{i}"), f"{key}.name", str)
            corpora.append(Corpus(name=name, src=self.source(item["src"], f"{key}.src",
                                                             archives),
                                  tgt=self.source(item["tgt"], f"{key}.tgt", archives)))
        return corpora

    def source(self, value: Any, key: str, archives: dict[str, Archive]) -> Source:
        self.table(value, key, {"archive": True, "member": False, "format": False})
        aid = self.typed(value["archive"], f"{key}.archive", str)
        if aid not in archives:
            raise self.fail(f"{key}.archive", f"unknown archive {aid!r}; valid: "
                            f"{', '.join(sorted(archives))}")
        member = value.get("member")
        if archives[aid].kind == "tar":
            if member is None:
                raise self.fail(f"{key}.member", "required for a tar archive")
            member = self.typed(member, f"{key}.member", str)
            pure = PurePosixPath(member)
            if pure.is_absolute() or ".." in pure.parts or "\\" in member or not pure.parts:
                raise self.fail(f"{key}.member", f"{member!r} must be a relative path "
                                "without '..'")
        elif member is not None:
            raise self.fail(f"{key}.member", f"archive {aid!r} is a single file; remove "
                            "'member'")
        default = "sgm" if member and member.endswith(".sgm") else "text"
        fmt = self.typed(value.get("format", default), f"{key}.format", str)
        if fmt not in FORMATS:
            raise self.fail(f"{key}.format", f"unknown format {fmt!r}; choose one of: "
                            f"{', '.join(FORMATS)}")
        return Source(archive=aid, member=member, format=fmt)

    def cleaning(self, value: Any) -> Cleaning:
        defaults = Cleaning()
        spec = self.table(value, "cleaning", {k: False for k in asdict(defaults)})
        for key in ("normalize_punctuation", "remove_non_printing"):
            self.typed(spec.get(key, True), f"cleaning.{key}", bool)
        for key in ("min_words", "max_words"):
            if self.typed(spec.get(key, 1), f"cleaning.{key}", int) < 0:
                raise self.fail(f"cleaning.{key}", f"must be >= 0, got {spec[key]}")
        ratio = self.typed(spec.get("max_ratio", 1.5), "cleaning.max_ratio", (int, float))
        if ratio != 0 and ratio < 1:
            raise self.fail("cleaning.max_ratio", f"must be >= 1 (or 0 for no limit), "
                            f"got {ratio}")
        cleaning = Cleaning(**{**asdict(defaults), **spec})
        if cleaning.max_words and cleaning.max_words < cleaning.min_words:
            raise self.fail("cleaning.max_words", "must be >= min_words")
        return cleaning

    def training(self, value: Any) -> dict[str, Any]:
        """`[training]`: `arch` and ModelConfig/TrainConfig fields, each of its default's type."""
        from nmt.config import MODEL_PRESETS, ModelConfig, TrainConfig

        defaults = {**ModelConfig().to_dict(), **TrainConfig().to_dict()}
        for fixed in ("vocab_size", "pad_id"):  # come from the data, not the recipe
            defaults.pop(fixed)
        spec = self.table(value, "training", {"arch": False, **{k: False for k in defaults}})
        if "arch" in spec and spec["arch"] not in MODEL_PRESETS:
            raise self.fail("training.arch", f"unknown arch {spec['arch']!r}; choose one of: "
                            f"{', '.join(MODEL_PRESETS)}")
        for key, item in spec.items():
            default = defaults.get(key)
            if key == "arch" or default is None:
                continue
            kind: type | tuple[type, ...] = (int, float) if isinstance(default, float) \
                else type(default)
            self.typed(item, f"training.{key}", kind)
        return dict(spec)
