"""Importing a file that is not on sys.path (bench/ scripts, bench/results/*.py) by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def by_path(name: str, path: Path) -> ModuleType:
    """Import `path` as module `name` (registered in sys.modules, so dataclasses and pickling
    inside it work) and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
