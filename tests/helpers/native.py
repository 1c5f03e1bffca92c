"""The C kernels' absence (nmt/native.py): Python code run where no compiler can be found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def without_a_compiler(code: str, tmp_path: Path, kernel: str) -> list[str]:
    """Run Python `code` in a fresh process whose PATH holds no compiler, whose $CC does
    not exist and whose kernel cache is empty (under `tmp_path`); its stdout lines, after
    checking that it exited 0 and that its stderr is exactly one line saying `kernel`
    (e.g. "the fused attention kernel") could not be built."""
    env = {"PATH": "/nonexistent", "CC": str(tmp_path / "no-such-cc"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nmt: {kernel} could not be built"), lines
    return proc.stdout.splitlines()
