"""`nmt tune -m RUN`: choose the length penalty (and beam) on a dev set by a rule that
transfers to unseen data, print the table, and keep the choice in RUN/decoding.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from nmt.cli.common import console, handle_errors, model_files
from nmt.cli.options import config_options, given, with_options
from nmt.config import DecodeConfig, RuntimeConfig
from nmt.errors import DataError, UsageError
from nmt.inference.tune import ALPHAS, DEFAULT_RULE, RULES


def _with_runtime_options(func: Any) -> Any:
    """`func` with RuntimeConfig's options that decoding the dev set uses, after
    `--dry-run`."""
    return with_options(func, "dry_run", config_options(RuntimeConfig,
                                                         ["device", "precision", "weights"]))


@_with_runtime_options
def command(
    model: Path = typer.Option(..., "--model", "-m", help="A run directory (its average.pt, "
                               "else checkpoint_best.pt, else checkpoint_last.pt) or a "
                               "checkpoint in one; decoding.json is written beside it."),
    dev: str = typer.Option(None, "--dev", show_default="the run's valid split",
                            help="SRC,REF: the dev set to decode and score."),
    data: Path = typer.Option(None, "--data", show_default="the directory the run was "
                              "trained on", help="Data directory of `nmt bpe` (valid.src/"
                              "valid.tgt, train.src/train.tgt)."),
    alphas: str = typer.Option(",".join(map(str, ALPHAS)), "--alphas", show_default=True,
                               help="Length penalties to try, comma-separated."),
    beams: str = typer.Option("4", "--beams", show_default=True,
                              help="Beam sizes to try, comma-separated (each multiplies "
                              "the decoding time)."),
    rule: str = typer.Option(DEFAULT_RULE, "--rule", show_default=True,
                             help=f"How to choose: {' | '.join(RULES)} (docs/translating.md "
                             "has the evidence behind the default)."),
    ratio: float = typer.Option(None, "--ratio", show_default="the training corpus's",
                                help="Target/source length ratio (13a tokens) the rule "
                                "aims for."),
    dry_run: bool = typer.Option(False, "--dry-run", show_default=True,
                                 help="Print the table and the choice; write nothing."),
    **settings: Any,
) -> None:
    """Choose decoding settings on a dev set: translate it at each alpha (and beam), score
    BLEU, chrF, length and repeats, pick by --rule, and write RUN/decoding.json, which `nmt
    translate -m RUN`, the Python API and `nmt serve` then use (an explicit --alpha or
    --beam wins)."""
    with handle_errors("tune"):
        from nmt.checkpoint import load_checkpoint
        from nmt.inference.translate import Engine
        from nmt.inference.tune import choose, corpus_ratio, parse_values, sweep
        from nmt.inference.tuned import write_decoding
        from nmt.score import check_lengths, read_lines

        alpha_list = parse_values(alphas, float, "--alphas")
        beam_list = parse_values(beams, int, "--beams")
        if rule not in RULES:
            raise UsageError(f"--rule: unknown {rule!r}; choose one of {', '.join(RULES)}")
        file = model_files("tune", [model])[0]
        data_dir = data if data is not None else _trained_on(load_checkpoint(file, mmap=True))
        src, ref = _dev_files(dev, data_dir)
        sources, refs = read_lines(src, what="dev source"), read_lines(ref, what="dev reference")
        check_lengths(sources, refs, str(src), str(ref))
        if ratio is None:
            if data_dir is None:
                raise DataError(f"{file}: the checkpoint does not say what it was trained on; "
                                "pass --data DIR (with train.src/train.tgt) or --ratio R")
            ratio = corpus_ratio(data_dir / "train.src", data_dir / "train.tgt")
        elif ratio <= 0:
            raise UsageError(f"--ratio must be > 0, got {ratio}")
        runtime = RuntimeConfig(**given(RuntimeConfig, settings))
        engine = Engine.load([file], DecodeConfig(), device=runtime.device,
                             precision=runtime.precision, weights=runtime.weights)
        console.print(f"nmt tune: {len(sources)} dev lines ({src}), {len(alpha_list)} alphas "
                      f"x {len(beam_list)} beams; training corpus target/source "
                      f"{ratio:.3f}", markup=False, soft_wrap=True)
        typer.echo(f"{'alpha':>5} {'beam':>4} {'BLEU':>6} {'chrF':>6} {'len/ref':>7} "
                   f"{'len/src':>7} {'repeats %':>9} {'BLEU at corpus length':>21}")

        def say(t: Any) -> None:
            typer.echo(f"{t.alpha:>5} {t.beam:>4} {t.bleu:>6.2f} {t.chrf:>6.2f} "
                       f"{t.ratio:>7.3f} {t.src_ratio:>7.3f} {t.repeats:>9.2f} "
                       f"{t.bleu_at_length(ratio * t.src_len):>21.2f}")

        with engine:
            trials = sweep(engine, sources, refs, alpha_list, beam_list, DecodeConfig(), say)
        pick = choose(trials, ratio, rule)
        typer.echo(f"chose alpha {pick.alpha}, beam {pick.beam} ({pick.rule}: {pick.why})")
        if dry_run:
            return
        path = write_decoding(file.parent, {"alpha": pick.alpha, "beam": pick.beam}, {
            "rule": pick.rule, "why": pick.why, "model": file.name,
            "dev": {"src": str(src), "ref": str(ref), "lines": len(sources)},
            "corpus_ratio": round(ratio, 4), "trials": [t.to_dict() for t in trials]})
        console.print(f"nmt tune: wrote {path}", markup=False, soft_wrap=True)


def _trained_on(checkpoint: dict[str, Any]) -> Path | None:
    """The data directory a checkpoint's run was trained on, if it says and it exists."""
    meta = checkpoint.get("meta") or {}
    data_dir = meta.get("data_dir") if isinstance(meta, dict) else None
    return Path(data_dir) if data_dir and Path(data_dir).is_dir() else None


def _dev_files(dev: str | None, data_dir: Path | None) -> tuple[Path, Path]:
    """(source, reference) of the dev set: --dev SRC,REF, else the data's valid split."""
    if dev is not None:
        parts = [p for p in dev.split(",") if p]
        if len(parts) != 2:
            raise UsageError(f"--dev takes SRC,REF (two files), got {dev!r}")
        return Path(parts[0]), Path(parts[1])
    if data_dir is None:
        raise DataError("the checkpoint does not say what it was trained on (or that "
                        "directory is gone); pass --dev SRC,REF and --ratio R, or --data DIR")
    return data_dir / "valid.src", data_dir / "valid.tgt"
