"""`nmt prep RECIPE` or `nmt prep --src-lang .. --tgt-lang .. --train .. --valid .. --test ..`:
download (or read local files), verify, extract and clean a corpus into a DATA directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from nmt.cli.common import console, handle_errors
from nmt.cli.progress import RichReporter
from nmt.config import ModelConfig
from nmt.cores import available_cores
from nmt.data.local_recipe import files_recipe, parse_pair
from nmt.data.prep import default_out, prepare
from nmt.data.recipes import Cleaning, Recipe, load_recipe, recipe_names
from nmt.errors import UsageError

_CLEAN = Cleaning()
_FILES = "Local files (instead of RECIPE)"


def command(
    recipe: str = typer.Argument(None, show_default=False,
                                 help="Recipe name (see --list) or path to a recipe .toml."),
    out: Path = typer.Option(None, "--out", "-o", show_default="data/RECIPE, or "
                             "data/files-SRC-TGT for local files", help="Output directory."),
    mirror: Path = typer.Option(None, "--mirror", envvar="NMT_MIRROR", show_default="none",
                                show_envvar=True,
                                help="Folder holding the archives (by URL file name); used "
                                "instead of the network."),
    workers: int = typer.Option(None, "--workers", min=1,
                                show_default=f"every core this process may use, "
                                f"{available_cores()} here",
                                help="Processes cleaning the training text; the output is "
                                "the same for any number."),
    list_recipes: bool = typer.Option(False, "--list", show_default=True,
                                      help="List the shipped recipes and exit."),
    src_lang: str = typer.Option(None, "--src-lang", show_default=False, rich_help_panel=_FILES,
                                 help="Source language code (en, de, pt_BR, ...)."),
    tgt_lang: str = typer.Option(None, "--tgt-lang", show_default=False, rich_help_panel=_FILES,
                                 help="Target language code."),
    train: list[str] = typer.Option(None, "--train", show_default=False,
                                    rich_help_panel=_FILES,
                                    help="SRC,TGT training files (plain, .gz); repeat for "
                                    "several corpora, written in this order. SRC,TGT:W gives "
                                    "a corpus the weight W (all or none): its share of each "
                                    "epoch, normalised over the corpora."),
    valid: str = typer.Option(None, "--valid", show_default=False, rich_help_panel=_FILES,
                              help="SRC,TGT dev files (plain, .gz, WMT .sgm), or one WMT "
                              ".xml file; copied unfiltered."),
    test: str = typer.Option(None, "--test", show_default=False, rich_help_panel=_FILES,
                             help="SRC,TGT test files, as --valid."),
    vocab_size: int = typer.Option(None, "--vocab-size", min=8, rich_help_panel=_FILES,
                                   show_default=str(ModelConfig().vocab_size),
                                   help="Joint BPE vocabulary size recorded for `nmt bpe`."),
    min_words: int = typer.Option(None, "--min-words", min=0, rich_help_panel=_FILES,
                                  show_default=str(_CLEAN.min_words),
                                  help="Drop training pairs with a side of fewer words."),
    max_words: int = typer.Option(None, "--max-words", min=0, rich_help_panel=_FILES,
                                  show_default=str(_CLEAN.max_words),
                                  help="Drop training pairs with a side of more words."),
    max_ratio: float = typer.Option(None, "--max-ratio", min=0, rich_help_panel=_FILES,
                                    show_default=str(_CLEAN.max_ratio),
                                    help="Drop training pairs whose word-count ratio is "
                                    "higher (0: no limit)."),
    normalize_punctuation: bool = typer.Option(
        None, "--normalize-punctuation/--no-normalize-punctuation", rich_help_panel=_FILES,
        show_default=str(_CLEAN.normalize_punctuation).lower(),
        help="Moses punctuation normalization of training text."),
    remove_non_printing: bool = typer.Option(
        None, "--remove-non-printing/--keep-non-printing", rich_help_panel=_FILES,
        show_default=str(_CLEAN.remove_non_printing).lower(),
        help="Control and format characters in training text become spaces."),
    remove_overlap: bool = typer.Option(
        None, "--remove-overlap/--keep-overlap", rich_help_panel=_FILES,
        show_default=str(_CLEAN.remove_overlap).lower(),
        help="Drop training pairs whose source is a dev or test source."),
    dedup: bool = typer.Option(None, "--dedup/--no-dedup", rich_help_panel=_FILES,
                               show_default=str(_CLEAN.dedup).lower(),
                               help="Drop exact duplicate training pairs, keeping the first."),
) -> None:
    """Download (or take from --mirror), verify, extract and clean RECIPE into OUT; or
    prepare local files (--src-lang, --tgt-lang, --train, --valid, --test) the same way."""
    with handle_errors("prep"):
        if list_recipes:
            for name in recipe_names():
                print(f"{name}\t{load_recipe(name).description}")
            return
        cleaning = {k: v for k, v in dict(
            min_words=min_words, max_words=max_words, max_ratio=max_ratio,
            normalize_punctuation=normalize_punctuation,
            remove_non_printing=remove_non_printing, remove_overlap=remove_overlap,
            dedup=dedup).items() if v is not None}
        local = dict(src_lang=src_lang, tgt_lang=tgt_lang, train=train or None, valid=valid,
                     test=test, vocab_size=vocab_size)
        chosen = _recipe(recipe, local, cleaning)
        with RichReporter(console) as reporter:
            manifest = prepare(chosen, out, mirror, workers, reporter,
                               report=lambda message: sys.stderr.write(
                                   f"nmt prep: {message}\n"))
        where = out if out is not None else default_out(chosen)
        splits = ", ".join(f"{k} {v['lines']}" for k, v in manifest["splits"].items())
        sys.stderr.write(f"nmt prep: wrote {where}: {splits} lines\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _recipe(recipe: str | None, local: dict[str, Any], cleaning: dict[str, Any]) -> Recipe:
    """The shipped/.toml recipe, or one built from the local-file flags (not both)."""
    given = [k for k, v in local.items() if v is not None] + list(cleaning)
    if recipe is not None:
        if given:
            raise UsageError(f"{_flag(given[0])} describes local files; give RECIPE or "
                             "--train/--valid/--test, not both (a recipe sets cleaning in "
                             "its [cleaning] table)")
        return load_recipe(recipe)
    if not given:
        raise UsageError("missing RECIPE; give a recipe name or .toml path (one of: "
                         f"{', '.join(recipe_names())}), or local files with --src-lang, "
                         "--tgt-lang, --train, --valid and --test")
    missing = [k for k in ("src_lang", "tgt_lang", "train", "valid", "test")
               if local[k] is None]
    if missing:
        raise UsageError(f"local files need {_flag(missing[0])} too (--src-lang, --tgt-lang, "
                         "--train SRC,TGT, --valid SRC,TGT, --test SRC,TGT)")
    return files_recipe(local["src_lang"], local["tgt_lang"],
                        [parse_pair(spec, "--train", weighted=True) for spec in local["train"]],
                        parse_pair(local["valid"], "--valid"), parse_pair(local["test"], "--test"),
                        local["vocab_size"], cleaning)
