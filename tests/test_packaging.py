"""A wheel built from this tree ships the recipes and the attention kernel's C source: `nmt
prep --list` works, and the kernel builds, from an install with no source tree beside it.
Offline: no build isolation, no dependencies fetched; the new environment borrows torch &
co. from the running one through a .pth file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

from nmt.data.recipes import recipe_names

_SKIP = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NMT_MIRROR")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_wheel_ships_the_recipes(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy, so the build writes nothing into the checkout
    for name in ("nmt", "cli", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=_SKIP)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    build = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-w", tmp_path / "dist", src, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("nmt-*.whl")

    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    install = _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                   "--no-index", wheel, cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     cwd=tmp_path).stdout.strip())
    # Dependencies (torch, typer, ...) from the running environment, after the wheel's own.
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run(python, "-c", "import nmt, recipes; print(nmt.__file__); "
                 "print(recipes.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    listed = _run(venv / "bin" / "nmt", "prep", "--list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == recipe_names()
    assert len(recipe_names()) >= 3
    # the C kernels' sources ship too, and build from the installed package
    for module in ("nmt.model.fused_attention", "nmt.inference.step_topk"):
        kernel = _run(python, "-c", f"import shutil, nmt, {module} as f; "
                      "print(f.SOURCE.is_relative_to(nmt.__path__[0]), f.SOURCE.is_file(), "
                      "f.enabled() or shutil.which('cc') is None)", cwd=tmp_path)
        assert kernel.returncode == 0, kernel.stderr
        assert kernel.stdout.split() == ["True", "True", "True"], (module, kernel.stdout)


def test_package_data_patterns_cover_every_recipe() -> None:
    """The fast, static half of the wheel test: pyproject's package data for `recipes`
    matches every recipe file in the tree, so a new recipe cannot be left out of wheels."""
    import fnmatch

    from nmt.data.recipes import tomllib  # tomllib, or tomli before Python 3.11

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = config["tool"]["setuptools"]
    assert "recipes" in setuptools["packages"]["find"]["include"]
    patterns = setuptools["package-data"]["recipes"]
    files = sorted(p.name for p in (REPO / "recipes").iterdir()
                   if p.is_file() and p.suffix != ".py")
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)
    assert {f.removesuffix(".toml") for f in files if f.endswith(".toml")} == set(
        recipe_names())
