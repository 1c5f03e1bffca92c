"""The C kernels' absence (nmt/kernels): Python code run where no kernel library was built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def without_kernels(code: str, tmp_path: Path) -> list[str]:
    """Run Python `code` in a fresh process where no kernel library was built (the loader
    looks in the empty `tmp_path`, as an install without a compiler leaves it) and no
    compiler can be found; its stdout lines, after checking that it exited 0 and said
    nothing on stderr (the PyTorch paths run in silence: `nmt doctor` tells why)."""
    prefix = f"import pathlib, nmt.kernels as k\nk.HERE = pathlib.Path({str(tmp_path)!r})\n"
    env = {"PATH": "/nonexistent", "CC": str(tmp_path / "no-such-cc"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True,
                          text=True, env=env, timeout=120, check=True)
    assert proc.stderr == "", proc.stderr
    return proc.stdout.splitlines()
