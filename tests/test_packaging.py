"""A wheel built from this tree installs like a library: `nmt` (and its .dist-info, with the
LICENSE) is the one name it puts in site-packages, the CLI and the recipes inside it as
nmt.cli and nmt.recipes (no top-level `cli` to collide with another project's). It ships the
recipes, the serve page and the C kernels built for every ISA level: its `nmt` console
script runs (`nmt prep --list`), and the kernels load and compute what the editable
install's do, in an install with no source tree beside it and no compiler on the machine.
Offline: no build isolation, no dependencies fetched; the new environment borrows torch & co.
from the running one through a .pth file. The fast tests check pyproject's package list and
where the editable install and a bare checkout find the CLI and the recipes."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

import nmt.data.recipes
from nmt import __version__
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
    for name in ("pyproject.toml", "README.md", "setup.py", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    build = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-w", tmp_path / "dist", src, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("nmt-*.whl")
    check_wheel_names(zipfile.ZipFile(wheel).namelist())

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

    where = _run(python, "-c", "import nmt, nmt.cli.main, nmt.recipes\n"
                 "for m in (nmt, nmt.cli.main, nmt.recipes): print(m.__file__)\n"
                 "import importlib.util as u; print(u.find_spec('cli'), u.find_spec('recipes'))",
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    *files, old_names = where.stdout.splitlines()
    assert [Path(f).relative_to(site).as_posix() for f in files] == [
        "nmt/__init__.py", "nmt/cli/main.py", "nmt/recipes/__init__.py"], where.stdout
    assert old_names == "None None"  # no top-level cli or recipes in this environment
    page = site / "nmt" / "serve" / "page"  # nmt serve's page at / (package data)
    assert {p.name for p in page.iterdir()} >= {"index.html", "page.css", "page.js"}
    version = _run(venv / "bin" / "nmt", "--version", cwd=tmp_path)  # the console script
    assert version.returncode == 0 and version.stdout.strip() == f"nmt {__version__}", (
        version.stderr)
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


def check_wheel_names(names: list[str]) -> None:
    """A wheel's file list: `nmt` and its .dist-info are its only top-level names; it holds
    the CLI as nmt/cli, every recipe as nmt/recipes/NAME.toml and the LICENSE."""
    dist_info = f"nmt-{__version__}.dist-info"
    assert {name.split("/")[0] for name in names} == {"nmt", dist_info}, sorted(names)
    assert "nmt/cli/main.py" in names and "nmt/cli/__init__.py" in names
    assert {f"nmt/recipes/{name}.toml" for name in recipe_names()} <= set(names)
    licenses = [n for n in names if n.startswith(dist_info + "/") and n.endswith("LICENSE")]
    assert licenses, f"no LICENSE in {dist_info}"


def test_wheel_names_are_checked() -> None:
    """check_wheel_names rejects the old layout, a top-level `cli` and `recipes`."""
    good = ["nmt/__init__.py", "nmt/cli/__init__.py", "nmt/cli/main.py",
            *(f"nmt/recipes/{name}.toml" for name in recipe_names()),
            f"nmt-{__version__}.dist-info/METADATA",
            f"nmt-{__version__}.dist-info/licenses/LICENSE"]
    check_wheel_names(good)
    old = [n.replace("nmt/cli/", "cli/").replace("nmt/recipes/", "recipes/") for n in good]
    with pytest.raises(AssertionError, match="'cli'"):
        check_wheel_names(old)
    with pytest.raises(AssertionError, match="LICENSE"):
        check_wheel_names(good[:-1])


def tomllib_load() -> dict:
    """pyproject.toml, parsed."""
    from nmt.data.recipes import tomllib  # tomllib, or tomli before Python 3.11

    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_every_package_folder_is_listed_and_installed_inside_nmt() -> None:
    """pyproject lists its packages by hand (discovery cannot rename cli/ to nmt/cli): the
    list is every folder under nmt/ (a new subpackage cannot be left out of wheels) plus the
    CLI and the recipes, mapped from the repository's top level; the console script runs
    nmt.cli."""
    config = tomllib_load()
    setuptools = config["tool"]["setuptools"]
    folders = {".".join(p.relative_to(REPO).parts) for p in [REPO / "nmt",
                                                             *(REPO / "nmt").rglob("*")]
               if p.is_dir() and not p.name.startswith(("__", "."))}
    assert set(setuptools["packages"]) == folders | {"nmt.cli", "nmt.recipes"}
    assert setuptools["package-dir"] == {"nmt.cli": "cli", "nmt.recipes": "recipes"}
    assert config["project"]["scripts"] == {"nmt": "nmt.cli.main:main"}
    assert (REPO / "LICENSE").is_file()


def test_package_data_patterns_cover_every_recipe() -> None:
    """The fast, static half of the wheel test: pyproject's package data for `nmt.recipes`
    matches every recipe file in the tree, so a new recipe cannot be left out of wheels."""
    import fnmatch

    setuptools = tomllib_load()["tool"]["setuptools"]
    assert "nmt.recipes" in setuptools["packages"]
    patterns = setuptools["package-data"]["nmt.recipes"]
    files = sorted(p.name for p in (REPO / "recipes").iterdir()
                   if p.is_file() and p.suffix != ".py")
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)
    assert {f.removesuffix(".toml") for f in files if f.endswith(".toml")} == set(
        recipe_names())


def test_the_checkout_is_what_the_editable_install_runs() -> None:
    """`pip install -e .` (what `make install` and `make test` do) maps nmt.cli and
    nmt.recipes to this checkout's cli/ and recipes/: `python -m nmt.cli.main`, run from the
    repository root as the tests run it, and `nmt` run anywhere use the files being edited."""
    import nmt.cli.main
    import nmt.recipes

    assert Path(nmt.cli.main.__file__).resolve() == REPO / "cli" / "main.py"
    assert Path(nmt.recipes.__file__).resolve().parent == REPO / "recipes"
    assert nmt.data.recipes.recipe_dir().resolve() == REPO / "recipes"


def test_a_bare_checkout_finds_its_recipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the repository on PYTHONPATH and nothing installed there is no nmt.recipes
    package: recipe_dir() then reads recipes/ beside nmt/."""
    monkeypatch.setattr(nmt.data.recipes, "RECIPE_PACKAGE", "nmt.no_such_recipes")
    assert nmt.data.recipes.recipe_dir().resolve() == REPO / "recipes"
    assert len(recipe_names()) >= 3
