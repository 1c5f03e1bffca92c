"""Record a finished `make demo` run as a demo record (bench/results/README.md).

Reads RUN/test.score (what `make demo` tees from `nmt score`: BLEU and chrF), or, where it is
absent, scores RUN/test.hyp against DATA/test.tgt; the updates (the last checkpoint's or the
train log's step) and training minutes from RUN/train_log.jsonl and RUN's checkpoints; the
length penalty from RUN/decoding.json (`nmt tune`); the CPU from `nmt doctor`'s report, taken
here, so run it on the machine (and under the ISA caps) the demo ran with. `--minutes` gives
the whole `make demo`'s wall time (the docs' figure, install included on a clean clone); without
it `minutes` is training's. Prints the record; `--record [PATH]` appends it.

    .venv/bin/python bench/record_demo.py runs/multi30k-en-de data/multi30k-en-de \\
        --minutes 15.9 --install "clean clone" --record
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results import record  # noqa: E402  (bench/results/record.py)

# The Multi30k recipe (recipes/multi30k-en-de.toml) as the demo records name it: change it
# with the recipe, so a table's range covers the runs of one recipe.
RECIPE = "linear, rising dropout, label smoothing 0.3"


def scores(run: Path, data: Path | None) -> dict[str, float]:
    """test2016 BLEU and chrF: RUN/test.score's lines, else test.hyp scored against
    DATA/test.tgt."""
    score_file = run / "test.score"
    if score_file.exists():
        text = score_file.read_text(encoding="utf-8")
        bleu = re.search(r"^BLEU = ([0-9.]+)", text, re.M)
        chrf = re.search(r"^chrF2? = ([0-9.]+)", text, re.M)
        if bleu:
            return {"bleu": float(bleu.group(1)),
                    **({"chrf": float(chrf.group(1))} if chrf else {})}
    if data is None:
        raise SystemExit(f"{score_file} has no BLEU line: give DATA to score {run}/test.hyp")
    from nmt.score import corpus_scores

    hyps = (run / "test.hyp").read_text(encoding="utf-8").splitlines()
    refs = (data / "test.tgt").read_text(encoding="utf-8").splitlines()
    found = corpus_scores(hyps, refs, digits=2, metrics=("bleu", "chrf"))
    return {"bleu": found["bleu"], "chrf": found["chrf"]}


def training(run: Path) -> dict[str, float | int | None]:
    """Updates (the highest of the train log's steps and the numbered checkpoints') and
    training minutes (the train log's last elapsed_minutes)."""
    steps, minutes = [0], [0.0]
    for line in (run / "train_log.jsonl").read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        steps.append(int(entry.get("step", 0)))
        minutes.append(float(entry.get("elapsed_minutes", 0.0)))
    steps += [int(p.stem.split("_")[1]) for p in run.glob("checkpoint_*.pt")
              if p.stem.split("_")[1].isdigit()]
    return {"updates": max(steps), "train_minutes": round(max(minutes), 2)}


def alpha(run: Path) -> float | str | None:
    """The length penalty test2016 was decoded with: `nmt tune`'s choice, else unknown."""
    decoding = run / "decoding.json"
    if decoding.exists():
        chosen = json.loads(decoding.read_text(encoding="utf-8")).get("alpha")
        return f"tuned ({chosen})"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the demo's run directory (RUN)")
    parser.add_argument("data", type=Path, nargs="?", default=None,
                        help="the demo's data directory (DATA), to score test.hyp")
    parser.add_argument("--minutes", type=float, default=None,
                        help="the whole make demo's wall minutes (default: training's)")
    parser.add_argument("--budget", type=float, default=15.0, help="make demo's MINUTES")
    parser.add_argument("--install", default=".venv installed",
                        help='"clean clone" (install timed too) or ".venv installed"')
    parser.add_argument("--alpha", default=None, help="ALPHA, where make demo was given one")
    parser.add_argument("--recipe", default=RECIPE, help="the recipe's description")
    parser.add_argument("--note", default=None)
    record.add_argument(parser, "demo")
    opts = parser.parse_args(argv)

    from nmt.doctor import report as machine
    from nmt.precision import bf16_rule

    doctor = machine(measure=False)
    figures: dict[str, object] = {**scores(opts.run, opts.data), **training(opts.run)}
    figures["minutes"] = opts.minutes if opts.minutes is not None else figures["train_minutes"]
    settings = {"minutes": opts.budget, "recipe": opts.recipe,
                "training_precision": "bf16" if bf16_rule()[0] else "fp32",
                "install": opts.install,
                "alpha": float(opts.alpha) if opts.alpha else alpha(opts.run),
                "beam": 4, "average_last": 5,
                "minutes_counted": "make demo" if opts.minutes is not None else "training"}
    caps = doctor["cpu"].get("caps")
    command = ("env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS="
               "AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 CT2_FORCE_CPU_ISA=AVX2 " if caps else "")
    command += "make demo" + ("" if opts.budget == 15 else f" MINUTES={opts.budget:g}") + (
        f" ALPHA={opts.alpha}" if opts.alpha else "")
    rec = record.make("demo", "nmt", settings, figures, doctor, command=command,
                      note=opts.note)
    print(json.dumps(rec))
    record.write([rec], opts.record)


if __name__ == "__main__":
    main()
