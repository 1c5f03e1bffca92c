"""`nmt export ct2|hf -m MODEL -o DIR`: write a model for another inference engine."""

from __future__ import annotations

from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors, model_files

app = typer.Typer(help="Export a checkpoint for another inference engine: ct2 "
                  "(CTranslate2) or hf (Hugging Face transformers).",
                  no_args_is_help=True, add_completion=False)
# The options every exporter shares.
MODEL_HELP = ("Checkpoint (from train or average), or a run directory (its average.pt, else "
              "checkpoint_best.pt, else checkpoint_last.pt).")
FORCE_HELP = "Replace an existing output directory."


@app.command("ct2", help="Write a CTranslate2 model directory from an nmt checkpoint "
             "(needs ctranslate2: pip install 'nmt\\[ct2]'). Exit codes: 2 bad option, "
             "existing output or ctranslate2 missing; 3 unreadable file or directory; 6 "
             "unloadable checkpoint or failed conversion.")
def ct2(
    model: Path = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    output: Path = typer.Option(..., "--output", "-o", help="CTranslate2 model directory "
                                "to write (written under a temporary name, then renamed)."),
    quantization: str = typer.Option("float32", "--quantization", "-q", show_default=True,
                                     help="Weight type: float32, int8, int8_float32, "
                                     "int8_float16, int8_bfloat16, int16, float16, "
                                     "bfloat16 (CTranslate2 can also convert at load time "
                                     "with compute_type)."),
    force: bool = typer.Option(False, "--force", help=FORCE_HELP),
    shortlist: Path = typer.Option(None, "--shortlist", show_default="none",
                                   help="A file of `nmt shortlist`, written into the "
                                   "directory as CTranslate2's vocabulary map (translate "
                                   "with use_vmap=True)."),
) -> None:
    """Write a CTranslate2 model directory (model.bin, config.json, vocabulary,
    sentencepiece.model, README.md with usage) from an nmt checkpoint."""
    with handle_errors("export ct2"):
        from nmt.inference.export.ct2 import export_ct2  # torch: load lazily

        export_ct2(model_files("export ct2", [model])[0], output, quantization=quantization,
                   force=force, shortlist=shortlist)
        console.print(f"nmt export ct2: wrote {output} ({quantization}); usage in "
                      f"{output / 'README.md'}", markup=False, soft_wrap=True)


@app.command("hf", help="Write a Hugging Face transformers model directory (MarianMTModel, "
             "safetensors, tokenizer, generation config, model card) from an nmt checkpoint "
             "(needs transformers: pip install 'nmt\\[hf]'). Exit codes: 2 bad option, "
             "existing output, transformers missing or a model transformers cannot express "
             "(pre-norm, learned positions); 3 unreadable file or directory; 6 unloadable "
             "checkpoint.")
def hf(
    model: Path = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    output: Path = typer.Option(..., "--output", "-o", help="Model directory to write "
                                "(written under a temporary name, then renamed)."),
    force: bool = typer.Option(False, "--force", help=FORCE_HELP),
) -> None:
    """Write a directory that AutoModelForSeq2SeqLM, AutoTokenizer and
    pipeline("translation") load as they are."""
    with handle_errors("export hf"):
        from nmt.inference.export.hf import export_hf  # torch: load lazily

        export_hf(model_files("export hf", [model])[0], output, force=force)
        console.print(f"nmt export hf: wrote {output}; usage in {output / 'README.md'}",
                      markup=False, soft_wrap=True)
