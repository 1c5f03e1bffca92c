"""A wheel built from this tree ships the recipes, the serve page and the C kernels built for
every ISA level:
`nmt prep --list` works, and the kernels load and compute what the editable install's do, in
an install with no source tree beside it and no compiler on the machine. Offline: no build
isolation, no dependencies fetched; the new environment borrows torch & co. from the running
one through a .pth file."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

from nmt.data.recipes import recipe_names

_SKIP = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc", "*.so")
# Beam search with a tiny random model in fp32 and int8 (the C kernels where they load),
# and which level each kernel loaded: printed by the wheel's install and by this tree's.
PROBE = """
import torch
from nmt.config import model_preset
from nmt.inference.decoding import search_ids
from nmt.inference.backends import prepare
from nmt.model.transformer import Transformer
from nmt.doctor import report
torch.manual_seed(0)
src = torch.randint(4, 40, (3, 7))
for precision in ("fp32", "int8"):
    torch.manual_seed(1)
    model = Transformer(model_preset("tiny", vocab_size=40)).eval()
    prepare(model, precision)
    print(precision, search_ids(model, src))
print({name: k["level"] for name, k in report(measure=False)["kernels"].items()})
"""


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NMT_MIRROR")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_wheel_runs_its_kernels_where_no_compiler_is(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy, so the build writes nothing into the checkout
    for name in ("nmt", "cli", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=_SKIP)
    for name in ("pyproject.toml", "README.md", "setup.py"):
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
    page = site / "nmt" / "serve" / "page"  # nmt serve's page at / (package data)
    assert {p.name for p in page.iterdir()} >= {"index.html", "page.css", "page.js"}
    listed = _run(venv / "bin" / "nmt", "prep", "--list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == recipe_names()
    assert len(recipe_names()) >= 3

    no_compiler = {"PATH": str(venv / "bin"), "CC": str(tmp_path / "no-such-cc"),
                   "HOME": str(tmp_path)}
    installed = _run(python, "-c", PROBE, cwd=tmp_path, env=no_compiler)
    assert installed.returncode == 0 and installed.stderr == "", installed.stderr
    here = _run(sys.executable, "-c", PROBE, cwd=REPO)
    assert here.returncode == 0, here.stderr
    assert installed.stdout == here.stdout
    levels = ast.literal_eval(installed.stdout.splitlines()[-1])
    assert levels["fused_attention"] is not None and levels["step_topk"] is not None
    assert not list(Path(tmp_path).glob(".cache/nmt/*"))  # nothing written at run time


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
