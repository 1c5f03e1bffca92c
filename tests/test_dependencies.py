"""The dependency rules of the design notes (docs/design.md and nmt/__init__.py), read
from the source with `ast`: every import of every module, lazy ones inside functions included.

- `nmt.cli -> nmt` only: the library (nmt.*, but for the CLI) never imports the CLI or its
  frameworks. The CLI's source is cli/ at the repository's top level, installed as nmt.cli;
  nothing imports it, or the recipes, by the old top-level names `cli` and `recipes`.
- Packages layer one way: nmt.data and nmt.model use only the shared top-level modules,
  nmt.inference adds them, nmt.train adds nmt.inference; the shared modules reach up only
  where checkpoint builds a model (`load_model`, lazily).
- The network (nmt.model) is torch, nmt.config and nmt.errors alone: no C, no switches.
- `nmt/inference/search.py` is pure algorithms: torch, the standard library, the special ids
  and its step's candidate kernel (nmt/inference/step_topk.py, computation only).
- Caches live in one place: only nmt/inference/decoding.py imports the cache (kv_cache.py);
  a layer's step sees it through `LayerCache` (nmt/inference/layer_step.py) alone.
- No import circles between modules, lazy imports included.
- No `__del__` in the library: lifetimes are explicit (context managers, owner objects).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "nmt"
# Folders at the repository's top level installed inside nmt (pyproject's package-dir).
MAPPED = {"cli": "nmt.cli", "recipes": "nmt.recipes"}

CLI = "nmt.cli"
# rich: progress bars are drawn by the CLI (cli/progress.py); `cli`: its name before it moved
# into nmt, which no longer installs (tests/test_packaging.py).
FORBIDDEN_IN_LIBRARY = {"cli", "typer", "rich"}
SEARCH_MAY_IMPORT = {"torch", "nmt.special_ids", "nmt.inference.step_topk"}
# besides torch and nmt.model:
NETWORK_MAY_IMPORT = {"nmt.config", "nmt.errors"}
CACHE_OWNERS = {"nmt.inference.decoding"}  # the only importers of the caches
CACHES = {"nmt.inference.kv_cache"}
PACKAGES = ("nmt.data", "nmt.model", "nmt.inference", "nmt.train", "nmt.api", "nmt.serve",
            "nmt.doctor")
# What each layer may import besides the standard library, torch and the other packages:
# "shared" is every top-level module of nmt (config, checkpoint, errors, ...).
MAY_IMPORT = {
    "shared": {"shared"},
    "nmt.data": {"shared", "nmt.data"},
    "nmt.model": {"nmt.model"},  # and NETWORK_MAY_IMPORT, checked on its own
    "nmt.inference": {"shared", "nmt.data", "nmt.model", "nmt.inference"},
    "nmt.train": {"shared", "nmt.data", "nmt.model", "nmt.inference", "nmt.train"},
    "nmt.api": {"shared", "nmt.data", "nmt.model", "nmt.inference"},
    "nmt.serve": {"shared", "nmt.data", "nmt.model", "nmt.inference", "nmt.api", "nmt.serve"},
    "nmt.doctor": {"shared", "nmt.data", "nmt.model", "nmt.inference"},
}
# The shared module that builds a model from its file, and what it reaches for.
REACHES_UP = {"nmt.checkpoint": {"nmt.model.transformer", "nmt.data.vocab"},
              "nmt": {"nmt.api"}}  # the package's lazy `from nmt import Translator`


def module_name(path: Path) -> str:
    """Dotted name of a source file under the repository as installed: nmt/data/clean.py ->
    nmt.data.clean, nmt/__init__.py -> nmt, cli/train.py -> nmt.cli.train (MAPPED)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in MAPPED:
        parts[0] = MAPPED[parts[0]]
    return ".".join(parts)


@functools.cache
def library_modules() -> dict[str, Path]:
    """Every module of the library by dotted name."""
    return {module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


@functools.cache
def cli_modules() -> dict[str, Path]:
    """Every module of the CLI (cli/, installed as nmt.cli) by dotted name."""
    return {module_name(p): p for p in sorted((REPO / "cli").rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Absolute names of all modules the source file `path` imports."""
    return imports_in(path.read_text(encoding="utf-8"), module_name(path),
                      path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool) -> set[str]:
    """Absolute names of all modules that `source` (of module `name`) imports, anywhere
    in it; `from package import module` counts as the module when it is one of ours,
    relative imports are resolved."""
    package = name if is_package else name.rpartition(".")[0]
    ours = library_modules().keys() | cli_modules().keys()
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in ours)
    return names


def top(name: str) -> str:
    return name.partition(".")[0]


def is_stdlib(name: str) -> bool:
    return top(name) in sys.stdlib_module_names or name == "__future__"


def non_stdlib_imports(path: Path) -> set[str]:
    return {name for name in imports(path) if not is_stdlib(name)}


@pytest.mark.parametrize("name", sorted(library_modules()))
def test_library_never_imports_the_cli(name: str) -> None:
    """Dependencies point one way: nmt.cli -> the rest of nmt."""
    bad = {m for m in imports(library_modules()[name])
           if top(m) in FORBIDDEN_IN_LIBRARY or m == CLI or m.startswith(CLI + ".")}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_the_cli_imports_the_library_as_nmt() -> None:
    """The CLI is a module of nmt like any other: its imports of itself and of the library
    are nmt.cli.* and nmt.*, resolvable in a wheel where cli/ is nmt/cli/."""
    modules = cli_modules()
    assert "nmt.cli.main" in modules and "nmt.cli.train" in imports(modules["nmt.cli.main"])
    for name, path in modules.items():
        found = imports(path)
        assert not {m for m in found if top(m) in MAPPED}, f"{name} imports {sorted(found)}"
        missing = {m for m in found if m.startswith(CLI + ".") and m not in modules}
        assert not missing, f"{name} imports {sorted(missing)}, not modules of cli/"


def python_sources() -> list[Path]:
    """Every Python file of the project that ships or runs it: the library, the CLI, the
    recipes' package, the tests and the benchmarks (not the virtual environments, nor the
    peers' under bench/.venv-*, whose packages are not ours)."""
    roots = [REPO / name for name in ("nmt", "cli", "recipes", "tests", "bench")]
    return sorted(p for root in roots for p in root.rglob("*.py")
                  if not any(part.startswith(".venv") for part in p.relative_to(REPO).parts))


def test_nothing_uses_the_old_top_level_names() -> None:
    """No import of `cli` or `recipes` as top-level packages, and no string naming the old
    `cli` package's main module (a `python -m` command line): an installed nmt has neither
    top-level name (they are nmt.cli and nmt.recipes), so such a line would work only from
    the repository root and hide the breakage there."""
    old_main = re.compile(r"(?<![\w.])" + re.escape("cli" + ".main") + r"\b")
    bad = []
    for path in python_sources():
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            strings = ([node.value] if isinstance(node, ast.Constant)
                       and isinstance(node.value, str) else [])
            if any(top(n) in MAPPED for n in names) or any(old_main.search(s)
                                                            for s in strings):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bad, f"use nmt.cli / nmt.recipes: {bad}"


def layer(name: str) -> str:
    """The layer of a library module: its package, or "shared" for a top-level module."""
    return next((pkg for pkg in PACKAGES if name == pkg or name.startswith(pkg + ".")),
                "shared")


def library_imports(name: str) -> set[str]:
    """The library modules (not packages' __init__ alone) that module `name` imports."""
    modules = library_modules()
    return {m for m in imports(modules[name]) if m in modules and m != "nmt"}


@pytest.mark.parametrize("name", sorted(library_modules()))
def test_packages_layer_one_way(name: str) -> None:
    allowed = MAY_IMPORT[layer(name)]
    bad = {m for m in library_imports(name)
           if layer(m) not in allowed and m not in REACHES_UP.get(name, set())}
    if layer(name) == "nmt.model":
        bad -= NETWORK_MAY_IMPORT
    assert not bad, (f"{name} ({layer(name)}) imports {sorted(bad)}; it may import "
                     f"{sorted(allowed)} (see nmt/__init__.py)")


def test_no_import_circles() -> None:
    """A depth-first walk over the module import graph finds no cycle."""
    graph = {name: library_imports(name) for name in library_modules()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_search_imports_only_torch_and_the_special_ids() -> None:
    found = non_stdlib_imports(LIBRARY / "inference" / "search.py")
    bad = {m for m in found if m not in SEARCH_MAY_IMPORT and top(m) != "torch"}
    assert not bad, (f"nmt/inference/search.py imports {sorted(bad)}; "
                     "allowed: torch, nmt.special_ids, nmt.inference.step_topk")


def test_special_ids_import_nothing() -> None:
    assert non_stdlib_imports(LIBRARY / "special_ids.py") == set()


def test_model_is_the_network_alone() -> None:
    """nmt.model and everything it reaches: torch, nmt.config and nmt.errors only."""
    modules = library_modules()
    seen, todo = set(), [n for n in modules if layer(n) == "nmt.model"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in non_stdlib_imports(modules[name]):
            if top(imported) == "torch":
                continue
            assert layer(imported) == "nmt.model" or imported in NETWORK_MAY_IMPORT, (
                f"{name} (the network) imports {imported}; the network may use torch, "
                f"nmt.model and {sorted(NETWORK_MAY_IMPORT)} only")
            todo.append(imported)


def test_only_decoding_knows_the_caches() -> None:
    users = {name for name, path in library_modules().items() if CACHES & imports(path)}
    assert users <= CACHE_OWNERS, f"{sorted(users - CACHE_OWNERS)} import a cache module"


@pytest.mark.parametrize("name", sorted(library_modules()))
def test_no_finalisers(name: str) -> None:
    """No `__del__`: memory and files are released explicitly, not when the collector
    happens to run."""
    tree = ast.parse(library_modules()[name].read_text(encoding="utf-8"))
    found = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             and node.name == "__del__"]
    assert not found, f"{name} defines __del__ at line(s) {found}"


def test_the_rules_see_every_kind_of_import() -> None:
    """The parser itself: lazy, relative and from-package imports are all found, and the
    rules reject what they should."""
    source = ("import torch.nn\nfrom nmt.data import batching\n\n\ndef f():\n"
              "    from . import inference\n    from .data.clean import x\n")
    assert imports_in(source, "nmt.example", is_package=False) == {
        "torch.nn", "nmt.data", "nmt.data.batching", "nmt", "nmt.inference",
        "nmt.data.clean"}
    assert "nmt.inference.search" in imports(LIBRARY / "inference" / "decoding.py")
    assert imports_in("from nmt import cli\n", "nmt.example", is_package=False) == {
        "nmt", "nmt.cli"}  # the CLI's package, seen as such from the library
    assert module_name(REPO / "cli" / "train.py") == "nmt.cli.train"
    assert layer("nmt.inference.search") == "nmt.inference"
    assert layer("nmt.checkpoint") == "shared"
    assert layer("nmt.train") == "nmt.train"
    assert "nmt.train" not in MAY_IMPORT[layer("nmt.inference.translate")]
