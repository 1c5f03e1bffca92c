"""`nmt translate -m MODEL [-i IN] [-o OUT]`: stdin lines to stdout lines, one for one."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import typer

from nmt.cli.common import console, handle_errors, interrupt_surely, model_files, warn
from nmt.cli.options import config_options, given, with_options
from nmt.config import DecodeConfig, RuntimeConfig
from nmt.errors import DataError
from nmt.fileio import atomic_write_bytes

if TYPE_CHECKING:
    from nmt.inference.translate import Engine, TranslateStats

def _with_decode_options(func: Callable[..., None]) -> Callable[..., None]:
    """`func` with the DecodeConfig and RuntimeConfig options after its `--output`."""
    return with_options(func, "output", [*config_options(DecodeConfig),
                                         *config_options(RuntimeConfig)])


@_with_decode_options
def command(
    models: list[Path] = typer.Option(..., "--model", "-m", help="Checkpoint (from train "
                                      "or average) or a run directory (its average.pt, else "
                                      "checkpoint_best.pt, else checkpoint_last.pt); repeat "
                                      "for an ensemble (probabilities averaged)."),
    input_path: Path = typer.Option(None, "--input", "-i", show_default="stdin",
                                    help="Source text, one segment a line."),
    output: Path = typer.Option(None, "--output", "-o", show_default="stdout",
                                help="Output file, written atomically when complete."),
    # (here: every DecodeConfig and RuntimeConfig option, see cli/options.py)
    max_src_len: int = typer.Option(None, "--max-src-len", show_default="model positions "
                                    "- 1", help="Longer lines are truncated (with a "
                                    "warning), never dropped."),
    stats: bool = typer.Option(False, "--stats", show_default=True,
                               help="Print sentences/s and target tokens/s on stderr (and "
                               "the workers chosen, which a terminal always gets)."),
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
    **settings: Any,
) -> None:
    """Translate one output line per input line (a line ends at \\n only), in input
    order; beam 4 and alpha 0.6 as in the paper, or what `nmt tune` chose for the run
    (its decoding.json, said on stderr; options given win). Exit codes: 3 bad input (e.g. --errors
    strict), 6 unloadable or unsafe checkpoint."""
    interrupt_surely("translate", terminate=True)
    with handle_errors("translate"):
        import torch

        from nmt.cores import available_cores
        from nmt.device import resolve_device
        from nmt.inference.translate import Engine
        from nmt.inference.tuned import describe, tuned_settings
        from nmt.inference.workers import plan_workers

        files = model_files("translate", models)
        asked = given(DecodeConfig, settings)
        tuned, tuned_from = tuned_settings(files)
        if tuned_from is not None:  # RUN/decoding.json of `nmt tune`; options given win
            console.print(f"nmt translate: {describe(tuned, tuned_from, list(asked))}",
                          markup=False, soft_wrap=True)
        cfg = DecodeConfig(**{**tuned, **asked})
        run = RuntimeConfig(**given(RuntimeConfig, settings))  # names checked here
        interactive = input_path is None and sys.stdin.isatty()
        plan = plan_workers(workers, threads_per_worker, resolve_device(run.device).type,
                            available_cores(), latency=interactive)
        if plan.note and (stats or sys.stderr.isatty()):  # a person reads it; a log need not
            console.print(f"nmt translate: {plan.note}", markup=False, soft_wrap=True)
        if plan.workers == 1:
            torch.set_num_threads(plan.threads)
        translator = Engine.load(files, cfg, device=run.device,
                                 precision=run.precision, max_src_len=max_src_len,
                                 seed=run.seed, weights=run.weights, workers=plan.workers,
                                 threads=plan.threads, shortlist=shortlist)
        if plan.workers == 1:  # decoding here: keep the loaded objects out of the collector's
            gc.collect()  # full passes, as the workers' parent does before it forks
            gc.freeze()
        with translator_lifetime(translator):
            _translate(translator, input_path, output, run.precision, run.errors, stats,
                       prefix_file, attention, attention_layer, attention_heads, interactive)


@contextlib.contextmanager
def translator_lifetime(translator: Engine) -> Iterator[None]:
    """Stop the translator's worker processes on the way out: after their work on success,
    at once on an interrupt or an error."""
    try:
        yield
    except BaseException:
        translator.terminate()
        raise
    translator.close()


def _translate(translator: Engine, input_path: Path | None, output: Path | None,
               precision: str, errors: str, stats: bool, prefix_file: Path | None,
               attention: Path | None, attention_layer: int, attention_heads: str,
               interactive: bool) -> None:
    """The body of `command` once the model is loaded."""
    from nmt.inference.translate import translate_stream
    from nmt.precision import precision_note  # torch: load lazily

    # bf16/fp16 that is slow on this CPU (emulated, or native but slower than fp32): named
    note = precision_note(precision, translator.device, training=False)  # "slow: ..."
    if note:
        warn("translate", f"--precision {precision} will be slow: {note.removeprefix('slow: ')}")
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
