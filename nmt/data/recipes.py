"""Recipes: the TOML files in `recipes/` that say what `nmt prep` fetches and how it cleans.

A recipe is data, not code. It names its archives (URL plus whatever checksums are known, or
the path of a file on this machine), which archive members make each split, the language
pair, the cleaning rules of the training data and the vocabulary size `nmt bpe` uses. Every
key is checked here, once: an unknown key or a bad value is a UsageError naming the recipe
(file), the key and the valid choices, so the rest of the pipeline can trust a `Recipe`.
`recipe_from_data` validates a recipe built in memory (`nmt prep --train ...`, see
nmt/data/local_recipe.py) the same way.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from nmt.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency only there)
    import tomli as tomllib

# The package whose data files are the shipped recipes: the repository's recipes/ folder,
# installed inside nmt (pyproject's package-dir) so that a wheel adds no top-level name.
RECIPE_PACKAGE = "nmt.recipes"
SPLITS: tuple[str, ...] = ("train", "valid", "test")
FORMATS: tuple[str, ...] = ("text", "sgm", "xml-src", "xml-ref")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HEX = {"sha256": 64, "md5": 32, "content_sha256": 64}


@dataclass(frozen=True)
class Archive:
    """One downloadable file, or (`path`) a file on this machine, read where it lies.

    `file_name` is the name a mirror must hold. Checksums: `sha256` / `md5` / `size`
    describe the file as downloaded; `content_sha256` describes the decompressed bytes of a
    single-file `.gz` (stable whatever gzip level made it, and checkable on an uncompressed
    mirror copy). Only what is given is verified.
    """

    id: str
    url: str | None = None
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None
    content_sha256: str | None = None
    path: str | None = None  # absolute path of a local file (then `url` is None)

    @property
    def local(self) -> bool:
        """True for a file on this machine: never downloaded nor looked up in a mirror."""
        return self.path is not None

    @property
    def file_name(self) -> str:
        """The last component of the URL (the name looked up in a mirror) or the path."""
        if self.path is not None:
            return Path(self.path).name
        return PurePosixPath(urlparse(self.url or "").path).name

    @property
    def kind(self) -> str:
        """'tar' for .tgz/.tar.gz/.tar, 'gz' for a single gzipped file, else 'plain'."""
        name = self.file_name
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            return "tar"
        return "gz" if name.endswith(".gz") else "plain"


@dataclass(frozen=True)
class Source:
    """One side of a corpus: an archive, plus the member path inside it for tar archives."""

    archive: str
    member: str | None = None
    format: str = "text"


@dataclass(frozen=True)
class Corpus:
    """A parallel corpus: source-language and target-language files of equal line count.

    `weight` (training corpora only; all of them or none): the share of an epoch's training
    pairs drawn from this corpus, normalised over the corpora (0.5, 0.25, 0.25 and 2, 1, 1
    mean the same). None: no weighting, every pair once per epoch.
    """

    name: str
    src: Source
    tgt: Source
    weight: float | None = None


@dataclass(frozen=True)
class Cleaning:
    """Rules applied to TRAINING pairs only (dev and test are never filtered)."""

    normalize_punctuation: bool = True  # sacremoses MosesPunctNormalizer, per language
    remove_non_printing: bool = True  # Moses remove-non-printing-char: \p{C} -> space
    min_words: int = 1  # drop pairs with a side shorter than this (1: drop empty sides)
    max_words: int = 250  # drop pairs with a side longer than this (whitespace words)
    max_ratio: float = 1.5  # drop pairs whose word-count ratio exceeds this (0: no limit)
    # Drop a training pair whose source sentence (normalized as above) is also the source
    # of a dev or test pair: the test input must not be seen in training.
    remove_overlap: bool = True
    # Drop exact duplicate training pairs (after normalization), keeping the first.
    dedup: bool = True


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; `path` is the file it came from (None: built in memory from
    command-line flags), `digest` the sha256 of its text."""

    name: str
    path: Path | None
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
        data["path"] = None if self.path is None else str(self.path)
        return data


def recipe_dir() -> Path:
    """The folder of the shipped recipes: the `nmt.recipes` package's data files, found the
    same way in an installed wheel and an editable install (which maps the package to the
    checkout's recipes/). A checkout used without installing (the repository on PYTHONPATH)
    has no `nmt.recipes`: its recipes/ folder beside nmt/ is read instead."""
    try:
        return Path(str(importlib.resources.files(RECIPE_PACKAGE)))
    except ModuleNotFoundError as err:
        checkout = Path(__file__).resolve().parents[2] / "recipes"
        if (checkout / "__init__.py").is_file() and any(checkout.glob("*.toml")):
            return checkout
        raise UsageError(f"the shipped recipes (package {RECIPE_PACKAGE!r}) are not "
                         "installed; reinstall nmt (pip install .) or give a path to a "
                         ".toml recipe") from err


def recipe_names() -> list[str]:
    """Names of the recipes shipped in `recipes/`."""
    return sorted(p.stem for p in recipe_dir().glob("*.toml"))


def find_recipe(name_or_path: str) -> Path:
    """A shipped recipe name (`wmt14-en-de`) or a path to a `.toml` file -> its path."""
    candidate = Path(name_or_path)
    if name_or_path.endswith(".toml") or candidate.is_file():
        if not candidate.is_file():
            raise UsageError(f"recipe file {candidate} not found; give an existing .toml path "
                             f"or one of: {', '.join(recipe_names())}")
        return candidate
    path = recipe_dir() / f"{name_or_path}.toml"
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
    return _Parser(str(path), path).recipe(data, hashlib.sha256(raw).hexdigest())


def recipe_from_data(data: dict[str, Any], origin: str) -> Recipe:
    """Validate a recipe built in memory (the TOML tree as dicts); `origin` names it in
    error messages. Archive `path`s must be absolute. Its digest is the sha256 of its
    canonical JSON."""
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()
    return _Parser(origin, None).recipe(data, digest)


class _Parser:
    """Validates the TOML tree key by key, with errors that name file and key. `path`: the
    recipe file (local archive paths are relative to its folder), None for in-memory."""

    def __init__(self, origin: str, path: Path | None) -> None:
        self.origin, self.path = origin, path

    def fail(self, key: str, message: str) -> UsageError:
        return UsageError(f"{self.origin}: {key}: {message}")

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
        return Recipe(name=data["name"], path=self.path and self.path.resolve(), digest=digest,
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
        self.table(spec, key, {"url": False, "path": False, "sha256": False, "md5": False,
                               "size": False, "content_sha256": False})
        if ("url" in spec) == ("path" in spec):
            raise self.fail(key, "give exactly one of url (to download) or path (a local "
                            "file)")
        url, path = spec.get("url"), spec.get("path")
        if url is not None:
            url = self.typed(url, f"{key}.url", str)
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https", "file") or not PurePosixPath(
                    parsed.path).name:
                raise self.fail(f"{key}.url", f"{url!r} must be an http(s):// or file:// URL "
                                "ending in a file name")
        else:
            path = self.local_path(self.typed(path, f"{key}.path", str), f"{key}.path")
        for name, length in _HEX.items():
            value = spec.get(name)
            if value is not None and not re.fullmatch(f"[0-9a-f]{{{length}}}",
                                                      self.typed(value, f"{key}.{name}", str)):
                raise self.fail(f"{key}.{name}", f"must be {length} lowercase hex digits")
        size = spec.get("size")
        if size is not None and self.typed(size, f"{key}.size", int) <= 0:
            raise self.fail(f"{key}.size", f"must be a positive byte count, got {size}")
        archive = Archive(id=aid, url=url, sha256=spec.get("sha256"), md5=spec.get("md5"),
                          size=size, content_sha256=spec.get("content_sha256"), path=path)
        if archive.content_sha256 and archive.kind == "tar":
            raise self.fail(f"{key}.content_sha256", "only applies to single-file archives "
                            "(.gz or plain); use sha256/md5/size for a tar")
        return archive

    def local_path(self, value: str, key: str) -> str:
        """A local archive's absolute path: relative ones are taken from the recipe file's
        folder (an in-memory recipe must give absolute paths)."""
        path = Path(value).expanduser()
        if not path.is_absolute():
            if self.path is None:
                raise self.fail(key, f"{value!r} must be an absolute path")
            path = self.path.resolve().parent / path
        return str(path)

    def corpora(self, split: str, value: Any, archives: dict[str, Archive]) -> list[Corpus]:
        items = value if isinstance(value, list) else [value]
        if split != "train" and len(items) != 1:
            raise self.fail(split, "dev and test sets take exactly one corpus")
        if not items:
            raise self.fail(split, "needs at least one corpus")
        corpora = []
        allowed = {"name": False, "src": True, "tgt": True}
        if split == "train":
            allowed["weight"] = False
        for i, item in enumerate(items):
            key = f"{split}[{i}]" if isinstance(value, list) else split
            self.table(item, key, allowed)
            name = self.typed(item.get("name", f"{split}{i}"), f"{key}.name", str)
            corpora.append(Corpus(name=name, src=self.source(item["src"], f"{key}.src",
                                                             archives),
                                  tgt=self.source(item["tgt"], f"{key}.tgt", archives),
                                  weight=self.weight(item.get("weight"), f"{key}.weight")))
        names = [c.name for c in corpora]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise self.fail(split, f"corpus name {twice!r} is used twice; names must differ")
        weighted = [c.weight is not None for c in corpora]
        if any(weighted) and not all(weighted):
            i = weighted.index(False)
            raise self.fail(f"{split}[{i}].weight", "give every training corpus a weight, "
                            "or none (no weights: every pair once per epoch)")
        return corpora

    def weight(self, value: Any, key: str) -> float | None:
        """A training corpus's sampling weight: a positive finite number, or absent."""
        if value is None:
            return None
        number = float(self.typed(value, key, (int, float)))
        if not 0 < number < float("inf"):
            raise self.fail(key, f"must be a positive number, got {value!r}")
        return number

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
        name = member or archives[aid].file_name
        default = "sgm" if name.removesuffix(".gz").endswith(".sgm") else "text"
        fmt = self.typed(value.get("format", default), f"{key}.format", str)
        if fmt not in FORMATS:
            raise self.fail(f"{key}.format", f"unknown format {fmt!r}; choose one of: "
                            f"{', '.join(FORMATS)}")
        return Source(archive=aid, member=member, format=fmt)

    def cleaning(self, value: Any) -> Cleaning:
        defaults = Cleaning()
        spec = self.table(value, "cleaning", {k: False for k in asdict(defaults)})
        for key in ("normalize_punctuation", "remove_non_printing", "remove_overlap", "dedup"):
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

    def training(self, value: Any, key: str = "training") -> dict[str, Any]:
        """`[training]`: `arch` and ModelConfig/TrainConfig fields, each of its default's
        type, plus optional per-arch tables (`[training.big]`) whose values apply only when
        that arch is trained (the paper's big model trains 300k updates, base 100k)."""
        from nmt.config import MODEL_PRESETS, SETTABLE_MODEL_FIELDS, ModelConfig, TrainConfig

        model = ModelConfig().to_dict()
        defaults = {**{k: model[k] for k in SETTABLE_MODEL_FIELDS}, **TrainConfig().to_dict()}
        per_arch = key == "training"
        allowed = {k: False for k in defaults}
        if per_arch:
            allowed.update({"arch": False, **{name: False for name in MODEL_PRESETS}})
        spec = self.table(value, key, allowed)
        if "arch" in spec and spec["arch"] not in MODEL_PRESETS:
            raise self.fail(f"{key}.arch", f"unknown arch {spec['arch']!r}; choose one of: "
                            f"{', '.join(MODEL_PRESETS)}")
        out: dict[str, Any] = {}
        for name, item in spec.items():
            if per_arch and name in MODEL_PRESETS:
                out[name] = self.training(item, f"{key}.{name}")
                continue
            default = defaults.get(name)
            if name != "arch" and default is not None:
                kind: type | tuple[type, ...] = (int, float) if isinstance(default, float) \
                    else type(default)
                self.typed(item, f"{key}.{name}", kind)
            out[name] = item
        return out
