"""`nmt translate -m MODEL [-i IN] [-o OUT]`: stdin lines to stdout lines, one for one."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import typer

from cli.common import console, handle_errors, interrupt_surely, model_files, warn
from nmt.config import DecodeConfig, RuntimeConfig
from nmt.errors import DataError
from nmt.fileio import atomic_write_bytes

if TYPE_CHECKING:
    from nmt.inference.translate import TranslateStats, Translator

_D = DecodeConfig()
_R = RuntimeConfig()


def command(
    models: list[Path] = typer.Option(..., "--model", "-m", help="Checkpoint (from train "
                                      "or average) or a run directory (its average.pt, else "
                                      "checkpoint_best.pt, else checkpoint_last.pt); repeat "
                                      "for an ensemble (probabilities averaged)."),
    input_path: Path = typer.Option(None, "--input", "-i", show_default="stdin",
                                    help="Source text, one segment a line."),
    output: Path = typer.Option(None, "--output", "-o", show_default="stdout",
                                help="Output file, written atomically when complete."),
    beam: int = typer.Option(_D.beam, "--beam", show_default=True, help="Beam size."),
    alpha: float = typer.Option(_D.alpha, "--alpha", show_default=True,
                                help="GNMT length penalty ((5+|Y|)/6)^alpha, |Y| counting "
                                "EOS; 0 = raw log-probability; a larger alpha favours "
                                "longer output."),
    max_len_a: float = typer.Option(_D.max_len_a, "--max-len-a", show_default=True,
                                    help="Max output pieces = a * source tokens + b "
                                    "(per sentence, source counted with EOS)."),
    max_len_b: int = typer.Option(_D.max_len_b, "--max-len-b", show_default=True,
                                  help="See --max-len-a."),
    min_len: int = typer.Option(_D.min_len, "--min-len", show_default=True,
                                help="Min output pieces before EOS may end a hypothesis "
                                "(1: a non-empty line never gets an empty translation; "
                                "0: allow it). --max-len-a/b win where they conflict."),
    early_stop: str = typer.Option(_D.early_stop, "--early-stop", show_default=True,
                                   help="When a sentence's search ends: bound (once no "
                                   "unfinished hypothesis can beat the finished ones: the "
                                   "paper's code, the best the beam can find) | beam (once "
                                   "beam hypotheses have finished, as fairseq and "
                                   "CTranslate2: fewer steps, faster)."),
    nbest: int = typer.Option(_D.nbest, "--nbest", show_default=True,
                              help="Hypotheses per line; > 1 prints "
                              "index<TAB>score<TAB>text lines (index from 0)."),
    sampling: bool = typer.Option(_D.sampling, "--sampling", show_default=True,
                                  help="Sample instead of beam search."),
    temperature: float = typer.Option(_D.temperature, "--temperature", show_default=True,
                                      help="Sampling temperature."),
    top_k: int = typer.Option(_D.top_k, "--top-k", show_default=True,
                              help="Sample among the k best tokens; 0 = all."),
    top_p: float = typer.Option(_D.top_p, "--top-p", show_default=True,
                                help="Nucleus sampling mass; 1.0 = off."),
    max_tokens: int = typer.Option(None, "--max-tokens", show_default="2048 on a CPU, 8192 "
                                   "on a GPU", help="Source tokens per batch, padding "
                                   "included."),
    buffer_size: int = typer.Option(_D.buffer_size, "--buffer-size", show_default=True,
                                    help="Lines read ahead and length-sorted."),
    max_src_len: int = typer.Option(None, "--max-src-len", show_default="model positions "
                                    "- 1", help="Longer lines are truncated (with a "
                                    "warning), never dropped."),
    errors: str = typer.Option(_R.errors, "--errors", show_default=True,
                               help="Invalid UTF-8: 'replace' (U+FFFD) or 'strict' (exit 3 "
                               "naming the line)."),
    device: str = typer.Option(_R.device, "--device", show_default=True,
                               help="auto | cpu | cuda."),
    precision: str = typer.Option(_R.precision, "--precision", show_default=True,
                                  help="auto | fp32 | bf16 | fp16 | int8 model weights "
                                  "(int8: CPU only, int8 linear layers, see "
                                  "docs/inference.md). auto: bf16 "
                                  "where the CPU (AVX512-BF16/AMX) or GPU computes it "
                                  "natively (fp16 on pre-Ampere GPUs), else fp32; as "
                                  "`train` does. Outputs may differ from fp32 in rounding "
                                  "only. On a CPU the linears run through oneDNN with "
                                  "packed weights (fp32 and bf16)."),
    weights: str = typer.Option(_R.weights, "--weights", show_default=True,
                                help="auto | raw | ema: which weights of a checkpoint "
                                "trained with --ema-decay to use (auto: the EMA ones where "
                                "the file has them)."),
    stats: bool = typer.Option(False, "--stats", show_default=True,
                               help="Print sentences/s and target tokens/s on stderr (and "
                               "the workers chosen, which a terminal always gets)."),
    seed: int = typer.Option(_R.seed, "--seed", show_default=True, help="Seed for --sampling."),
    shortlist: Path = typer.Option(None, "--shortlist", show_default="off",
                                   help="A file of `nmt shortlist` (same vocabulary): score "
                                   "only each batch's likely target pieces, not the whole "
                                   "vocabulary (faster; see docs/performance.md)."),
    workers: int = typer.Option(None, "--workers", show_default="CPU: every core (one when "
                                "typing at a terminal); GPU: 1",
                                help="Processes decoding batches in parallel on a CPU, "
                                "sharing one copy of the weights; output is the same for "
                                "any number."),
    threads_per_worker: int = typer.Option(None, "--threads-per-worker",
                                           show_default="cores / workers",
                                           help="Torch threads of each worker."),
    prefix_file: Path = typer.Option(None, "--prefix-file", show_default="off",
                                     help="One target prefix per input line (an empty line: "
                                     "none): each output starts with its prefix, the model "
                                     "continuing from it (teacher-forced, counted in the "
                                     "score). Must have as many lines as the input."),
    attention: Path = typer.Option(None, "--attention", show_default="off",
                                   help="Write DIR/NNNNNN.png per non-empty input line "
                                   "(1-based line number): a heatmap of the encoder-decoder "
                                   "attention of the best output (first model of an "
                                   "ensemble)."),
    attention_layer: int = typer.Option(-1, "--attention-layer", show_default=True,
                                        help="Decoder layer plotted by --attention: "
                                        "0..L-1, or negative from the top (-1 = last)."),
    attention_heads: str = typer.Option("mean", "--attention-heads", show_default=True,
                                        help="mean (heads averaged, one panel) | all "
                                        "(one panel per head)."),
) -> None:
    """Translate one output line per input line (a line ends at \\n only), in input
    order; beam 4 and alpha 0.6 as in the paper. Exit codes: 3 bad input (e.g. --errors
    strict), 6 unloadable or unsafe checkpoint."""
    interrupt_surely("translate", terminate=True)
    with handle_errors("translate"):
        import torch

        from nmt.cores import available_cores
        from nmt.device import resolve_device
        from nmt.inference.translate import Translator
        from nmt.inference.workers import plan_workers

        cfg = DecodeConfig(beam=beam, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                           min_len=min_len, early_stop=early_stop, nbest=nbest,
                           sampling=sampling,
                           temperature=temperature, top_k=top_k, top_p=top_p,
                           max_tokens=max_tokens, buffer_size=buffer_size)
        RuntimeConfig(device=device)  # a known device name before resolving it
        interactive = input_path is None and sys.stdin.isatty()
        plan = plan_workers(workers, threads_per_worker, resolve_device(device).type,
                            available_cores(), latency=interactive)
        if plan.note and (stats or sys.stderr.isatty()):  # a person reads it; a log need not
            console.print(f"nmt translate: {plan.note}", markup=False, soft_wrap=True)
        if plan.workers == 1:
            torch.set_num_threads(plan.threads)
        translator = Translator.load(model_files("translate", models), cfg, device=device,
                                     precision=precision, max_src_len=max_src_len, seed=seed,
                                     weights=weights, workers=plan.workers,
                                     threads=plan.threads, shortlist=shortlist)
        with translator_lifetime(translator):
            _translate(translator, input_path, output, precision, errors, stats, prefix_file,
                       attention, attention_layer, attention_heads, interactive)


@contextlib.contextmanager
def translator_lifetime(translator: Translator) -> Iterator[None]:
    """Stop the translator's worker processes on the way out: after their work on success,
    at once on an interrupt or an error."""
    try:
        yield
    except BaseException:
        translator.terminate()
        raise
    translator.close()


def _translate(translator: Translator, input_path: Path | None, output: Path | None,
               precision: str, errors: str, stats: bool, prefix_file: Path | None,
               attention: Path | None, attention_layer: int, attention_heads: str,
               interactive: bool) -> None:
    """The body of `command` once the model is loaded."""
    from nmt.inference.translate import translate_stream
    from nmt.precision import emulation_note  # torch: load lazily

    # bf16/fp16 on a CPU that only emulates it: named, with its measured cost
    note = emulation_note(precision, translator.device, training=False)
    if note:
        warn("translate", f"--precision {precision} will be slow: {note}")
    observe = None
    if attention is not None:
        from nmt.inference.attention_map import AttentionWriter

        observe = AttentionWriter(translator.models[0], translator.vocab, attention,
                                  attention_layer, attention_heads, translator.device)
    name = str(input_path) if input_path is not None else "<stdin>"

    results: list[TranslateStats] = []
    try:
        with contextlib.ExitStack() as stack:
            prefixes = (stack.enter_context(open(prefix_file, "rb")) if prefix_file
                        else None)

            def run(source: BinaryIO, sink: BinaryIO) -> TranslateStats:
                return translate_stream(source, sink, translator,
                                        interactive=interactive, errors=errors,
                                        source_name=name,
                                        warn=lambda msg: warn("translate", msg),
                                        observe=observe, prefix_source=prefixes,
                                        prefix_name=str(prefix_file))

            source = (stack.enter_context(open(input_path, "rb")) if input_path
                      else sys.stdin.buffer)
            if output is None:
                results.append(run(source, sys.stdout.buffer))
            else:
                atomic_write_bytes(output, lambda sink: results.append(run(source, sink)))
    except BrokenPipeError:
        raise
    except OSError as err:
        raise DataError(f"{err.filename or name}: {err.strerror or err}") from err
    if stats:
        console.print(f"nmt translate: {results[0].summary()}", markup=False,
                      soft_wrap=True)
