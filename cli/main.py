"""The Typer app: `nmt prep|bpe|train|average|translate|tune|shortlist|score|plot|serve|
export|doctor`."""

from __future__ import annotations

import sys

import typer

from nmt import __version__
from nmt.cli import (
    average,
    bpe,
    doctor,
    export,
    plot,
    prep,
    score,
    serve,
    shortlist,
    train,
    translate,
    tune,
)
from nmt.host_memory import reexec_with_huge_page_heap


def _hide_flag_types() -> None:
    """Show no value type beside flags in the help. Recent Typer (0.2x) labels every flag
    `<bool>` in its rich help (--help, --version, --force), as if it took a value; a flag
    takes none. Typer versions without that hook are left as they are."""
    option = getattr(typer.core, "TyperOption", None)
    original = getattr(option, "display_type_rich", None)
    if option is None or original is None or getattr(original, "nmt_flags_hidden", False):
        return

    def display_type_rich(self: typer.core.TyperOption, ctx: object) -> str | None:
        return None if self.is_flag else original(self, ctx)

    display_type_rich.nmt_flags_hidden = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich


_hide_flag_types()

app = typer.Typer(
    name="nmt",
    help="Neural machine translation with the Transformer of 'Attention Is All You Need': "
    "prep -> bpe -> train -> average -> translate -> score.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command("prep", help="Download, extract and clean a recipe's corpora.")(prep.command)
app.command("bpe", help="Learn joint sentencepiece BPE and binarize every split.")(bpe.command)
app.command("train", help="Train a Transformer on binarized data.")(train.command)
app.command("average", help="Average the parameters of several checkpoints.")(average.command)
app.command("translate", help="Translate lines from stdin (or -i) with beam search.")(
    translate.command)
app.command("tune", help="Choose the length penalty (and beam) on a dev set by a rule "
            "that transfers; translate then uses it.")(tune.command)
app.command("shortlist", help="Learn a lexical shortlist for faster translation "
            "(translate --shortlist).")(shortlist.command)
app.command("score", help="Score hypotheses against references (sacreBLEU, paper BLEU).")(
    score.command)
app.command("plot", help="Plot a run's training curves as a PNG (needs "
            "nmt\\[plot]).")(plot.command)
app.command("serve", help="Serve models over HTTP: LibreTranslate's API and a native one "
            "(needs nmt\\[serve]).")(serve.command)
app.command("doctor", help="What this machine and install give nmt: CPU class, kernels, "
            "precision, threads, GPUs (--json for bug reports).")(doctor.command)
app.add_typer(export.app, name="export", help="Export a checkpoint for CTranslate2 (needs "
              "nmt\\[ct2]) or Hugging Face transformers (needs nmt\\[hf]).")


def _version(value: bool) -> None:
    if value:
        print(f"nmt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Neural machine translation toolkit."""


def main() -> None:
    """Console-script entry point: UTF-8 everywhere, then the Typer app. `nmt train` first
    re-executes itself with glibc's heap in huge pages (nmt/host_memory.py)."""
    if sys.argv[1:2] == ["train"]:
        reexec_with_huge_page_heap()
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="replace")
    app()


if __name__ == "__main__":
    main()
