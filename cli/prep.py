"""`nmt prep RECIPE`: download, verify, extract and clean a recipe's corpora."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from cli.common import console, handle_errors
from nmt.data.download import RichReporter
from nmt.errors import UsageError
from nmt.prep import default_out, prepare
from nmt.recipes import load_recipe, recipe_names


def command(
    recipe: str = typer.Argument(None, show_default=False,
                                 help="Recipe name (see --list) or path to a recipe .toml."),
    out: Path = typer.Option(None, "--out", "-o", show_default="data/RECIPE",
                             help="Output directory."),
    mirror: Path = typer.Option(None, "--mirror", envvar="NMT_MIRROR", show_default="none",
                                show_envvar=True,
                                help="Folder holding the archives (by URL file name); used "
                                "instead of the network."),
    workers: int = typer.Option(1, "--workers", min=1, show_default=True,
                                help="Processes for normalizing training text."),
    list_recipes: bool = typer.Option(False, "--list", show_default=True,
                                      help="List the shipped recipes and exit."),
) -> None:
    """Download (or take from --mirror), verify, extract and clean RECIPE into OUT."""
    with handle_errors("prep"):
        if list_recipes:
            for name in recipe_names():
                print(f"{name}\t{load_recipe(name).description}")
            return
        if recipe is None:
            raise UsageError("missing RECIPE; give a recipe name or .toml path "
                             f"(one of: {', '.join(recipe_names())})")
        with RichReporter(console) as reporter:
            manifest = prepare(recipe, out, mirror, workers, reporter)
        where = out if out is not None else default_out(load_recipe(recipe))
        splits = ", ".join(f"{k} {v['lines']}" for k, v in manifest["splits"].items())
        sys.stderr.write(f"nmt prep: wrote {where}: {splits} lines\n")
