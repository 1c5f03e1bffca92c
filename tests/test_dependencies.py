"""The dependency rules of the design notes (shared/docs/DESIGN.md), read from the source
with `ast`: every import of every module, lazy ones inside functions included.

- `cli -> nmt` only: the library never imports the CLI or its frameworks.
- `nmt/search.py` is pure algorithms: torch, the standard library and the special ids.
- `nmt/model.py` is the network: torch, the standard library and the network modules,
  which themselves import nothing else (no files, CLI, search or decoding).
- Caches live in one place: only nmt/decoding.py imports nmt/kv_cache.py.
- No `__del__` in the library: lifetimes are explicit (context managers, owner objects).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "nmt"

# Top-level packages the library must never import. Add "rich" here once progress
# reporting has moved to cli/ (nmt/data/download.py and nmt/train/log.py still use it).
FORBIDDEN_IN_LIBRARY = {"cli", "typer", "rich"}  # rich: progress bars are drawn by cli/
SEARCH_MAY_IMPORT = {"torch", "nmt.special_ids"}
NETWORK = {"nmt.model", "nmt.config", "nmt.layers", "nmt.attention", "nmt.dropout",
           "nmt.errors"}
CACHE_OWNERS = {"nmt.decoding"}  # the only importers of nmt.kv_cache


def module_name(path: Path) -> str:
    """Dotted name of a source file under the repository: nmt/data/clean.py ->
    nmt.data.clean, nmt/__init__.py -> nmt."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def library_modules() -> dict[str, Path]:
    """Every module of the library by dotted name."""
    return {module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Absolute names of all modules the source file `path` imports."""
    return imports_in(path.read_text(encoding="utf-8"), module_name(path),
                      path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool) -> set[str]:
    """Absolute names of all modules that `source` (of module `name`) imports, anywhere
    in it; `from package import module` counts as the module when it is one of ours,
    relative imports are resolved."""
    package = name if is_package else name.rpartition(".")[0]
    ours = library_modules()
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
    """Dependencies point one way: cli -> nmt."""
    bad = {m for m in imports(library_modules()[name]) if top(m) in FORBIDDEN_IN_LIBRARY}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_search_imports_only_torch_and_the_special_ids() -> None:
    found = non_stdlib_imports(LIBRARY / "search.py")
    bad = {m for m in found if m not in SEARCH_MAY_IMPORT and top(m) != "torch"}
    assert not bad, f"nmt/search.py imports {sorted(bad)}; allowed: torch, nmt.special_ids"


def test_special_ids_import_nothing() -> None:
    assert non_stdlib_imports(LIBRARY / "special_ids.py") == set()


def test_model_is_the_network_alone() -> None:
    """nmt/model.py and everything it reaches: torch and the network modules only."""
    modules = library_modules()
    seen, todo = set(), ["nmt.model"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in non_stdlib_imports(modules[name]):
            if top(imported) == "torch":
                continue
            assert imported in NETWORK, (
                f"{name} (reached from nmt.model) imports {imported}; the network may use "
                f"torch and {sorted(NETWORK - {'nmt.model'})} only")
            todo.append(imported)


def test_only_decoding_knows_the_caches() -> None:
    users = {name for name, path in library_modules().items()
             if "nmt.kv_cache" in imports(path)}
    assert users <= CACHE_OWNERS, f"{sorted(users - CACHE_OWNERS)} import nmt.kv_cache"


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
    """The parser itself: lazy, relative and from-package imports are all found."""
    source = ("import torch.nn\nfrom nmt.data import batching\n\n\ndef f():\n"
              "    from . import search\n    from .data.clean import x\n")
    assert imports_in(source, "nmt.example", is_package=False) == {
        "torch.nn", "nmt.data", "nmt.data.batching", "nmt", "nmt.search", "nmt.data.clean"}
    assert "nmt.search" in imports(LIBRARY / "decoding.py")


def test_vocab_does_not_import_the_data_package() -> None:
    """nmt.data.binarize imports nmt.vocab; the reverse would be an import circle."""
    bad = {m for m in imports(library_modules()["nmt.vocab"]) if m.startswith("nmt.data")}
    assert not bad, f"nmt/vocab.py imports {sorted(bad)}"
