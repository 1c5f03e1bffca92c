"""The C kernels' absence (nmt/native.py): Python code run where no compiler can be found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def without_a_compiler(code: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Run Python `code` in a fresh process whose PATH holds no compiler, whose $CC does
    not exist and whose kernel cache is empty (under `tmp_path`); its stdout and stderr
    lines. Raises if it exits non-zero."""
    env = {"PATH": "/nonexistent", "CC": str(tmp_path / "no-such-cc"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    return proc.stdout.splitlines(), proc.stderr.strip().splitlines()
