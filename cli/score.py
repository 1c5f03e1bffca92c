"""`nmt score --ref REF [-i HYP]`: sacreBLEU with its signature, or the paper's BLEU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from nmt.cli.common import handle_errors
from nmt.score import METRICS, score_files

PAPER_LABEL = ("paper-style tokenized BLEU (Moses tokenizer, ##AT## compound splitting, "
               "multi-bleu; NOT comparable to sacreBLEU): ")


def command(
    ref: Path = typer.Option(..., "--ref", "-r", help="Reference file, one segment a line."),
    hyp: Path = typer.Option(None, "--input", "-i", show_default="stdin",
                             help="Hypothesis file, one segment a line."),
    metrics: list[str] = typer.Option(["bleu"], "--metrics", "-M", show_default=True,
                                      help=f"Metrics among {', '.join(METRICS)}: "
                                      "--metrics bleu chrf ter, bleu,chrf,ter, or the "
                                      "option repeated."),
    tokenize: str = typer.Option(None, "--tokenize", show_default="13a",
                                 help="Any sacreBLEU BLEU tokenizer (13a, intl, zh, char, "
                                 "none, ...)."),
    lowercase: bool = typer.Option(False, "--lowercase", show_default=True,
                                   help="Case-insensitive scores."),
    paper: bool = typer.Option(False, "--paper", show_default=True,
                               help="The paper's tokenized BLEU with compound splitting "
                               "(tensor2tensor get_ende_bleu.sh), labelled as such."),
    lang: str = typer.Option(None, "--lang", show_default="the prepared data's (DATA/test.tgt: "
                             "manifest.json's tgt_lang), else a language extension (.de)",
                             help="Target language for the Moses tokenizer of --paper."),
    as_json: bool = typer.Option(False, "--json", show_default=True,
                                 help="Print one JSON line instead of human-readable lines."),
    more_metrics: list[str] = typer.Argument(None, hidden=True, show_default=False,
                                             help="Further metric names after --metrics "
                                             "(`--metrics bleu chrf ter`)."),
) -> None:
    """Score hypotheses against references: sacreBLEU 13a BLEU with its signature by
    default; data lines go to stdout."""
    with handle_errors("score"):
        # `--metrics bleu chrf ter`: an option takes one value, so the words after the first
        # arrive as (hidden) arguments; score has no other positional argument.
        given = [*metrics, *(more_metrics or [])]
        names = [m.strip().lower() for item in given for m in item.split(",") if m.strip()]
        data = None if hyp is not None else sys.stdin.buffer.read()
        scores = score_files(ref, hyp, data, metrics=names, tokenize=tokenize,
                             lowercase=lowercase, paper=paper, lang=lang)
        if as_json:
            record = {"ref": str(ref), "hyp": str(hyp) if hyp else "<stdin>",
                      "scores": [s.to_dict() for s in scores]}
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            for s in scores:
                label = PAPER_LABEL if s.metric == "bleu-paper" else ""
                sys.stdout.write(f"{label}{s.text}\nsignature: {s.signature}\n")
        sys.stdout.flush()
