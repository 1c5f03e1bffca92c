"""Which rule for choosing the length penalty transfers to unseen data (issue 73): each
model's valid and test outputs at every alpha, each rule's choice on valid, and what that
choice scores on test (evaluated, never tuned on), beside the arg-max on valid and fixed
alphas.

    python3 bench/tune_evidence.py RUN [RUN ...] [--data DIR] [--out DIR]

A RUN is a run directory (its average.pt) or a checkpoint. Outputs are kept under --out
(one file per model, split and alpha), so a second call re-scores without decoding.
Prints a table per rule and one JSON line: per model the test BLEU of each rule's choice,
of the valid arg-max, of fixed 0.6 and 1.0 and of the best fixed alpha.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from results import record  # noqa: E402  (bench/results/record.py)

from nmt.config import DecodeConfig  # noqa: E402
from nmt.inference.tune import (  # noqa: E402
    ALPHAS,
    RULES,
    choose,
    corpus_ratio,
    score_trial,
    translations,
)
from nmt.score import read_lines  # noqa: E402

SPLITS = ("valid", "test")


def outputs(model: Path, data: Path, out: Path, alphas: list[float], workers: int
            ) -> dict[str, dict[float, list[str]]]:
    """The model's outputs for each split and alpha, decoded once and kept under `out`."""
    from nmt.checkpoint import resolve_model_path
    from nmt.inference.translate import Engine

    file, _ = resolve_model_path(model)
    out.mkdir(parents=True, exist_ok=True)
    engine = None
    got: dict[str, dict[float, list[str]]] = {}
    for split in SPLITS:
        sources = read_lines(data / f"{split}.src")
        got[split] = {}
        for alpha in alphas:
            path = out / f"{split}.{alpha}.hyp"
            if not path.is_file():
                if engine is None:
                    engine = Engine.load([file], DecodeConfig(), workers=workers,
                                         threads=1)
                hyps = translations(engine, sources, DecodeConfig(alpha=alpha))
                path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            got[split][alpha] = read_lines(path)
    if engine is not None:
        engine.close()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "multi30k-en-de")
    parser.add_argument("--out", type=Path, default=Path("/tmp/tune_evidence"))
    parser.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--describe", action="append", default=[], metavar="RUN=TEXT",
                        help="What a model is, for its record (e.g. u1200=\"1,200 updates, "
                        "fp32, capped at AVX2, seed 1\").")
    record.add_argument(parser, "tune")
    opt = parser.parse_args()
    described = dict(item.split("=", 1) for item in opt.describe)
    alphas = [float(a) for a in opt.alphas.split(",")]
    ratio = corpus_ratio(opt.data / "train.src", opt.data / "train.tgt")
    refs = {s: read_lines(opt.data / f"{s}.tgt") for s in SPLITS}
    srcs = {s: read_lines(opt.data / f"{s}.src") for s in SPLITS}
    print(f"training corpus target/source (13a tokens): {ratio:.4f}")
    records = []
    for run in opt.runs:
        name = run.name if run.is_dir() else f"{run.parent.name}/{run.stem}"
        hyps = outputs(run, opt.data, opt.out / name.replace("/", "_"), alphas, opt.workers)
        trials = {s: [score_trial(a, 4, hyps[s][a], refs[s], srcs[s]) for a in alphas]
                  for s in SPLITS}
        test = {t.alpha: t for t in trials["test"]}
        entry = {"model": name, "valid": [t.to_dict() for t in trials["valid"]],
                  "test": [t.to_dict() for t in trials["test"]], "chosen": {}}
        for rule in RULES:
            pick = choose(trials["valid"], ratio, rule)
            entry["chosen"][rule] = {"alpha": pick.alpha, "test_bleu": test[pick.alpha].bleu,
                                      "why": pick.why}
        argmax = max(trials["valid"], key=lambda t: t.bleu).alpha
        entry["chosen"]["valid-argmax"] = {"alpha": argmax, "test_bleu": test[argmax].bleu}
        best = max(test.values(), key=lambda t: t.bleu)
        entry["best_fixed"] = {"alpha": best.alpha, "test_bleu": best.bleu}
        records.append(entry)
        print(f"\n{name}")
        print(f"  {'alpha':>5} {'valid BLEU':>10} {'chrF':>6} {'len/ref':>7} {'len/src':>7}"
              f"   {'test BLEU':>9} {'chrF':>6} {'len/ref':>7} {'len/src':>7}")
        for v, t in zip(trials["valid"], trials["test"], strict=True):
            print(f"  {v.alpha:>5} {v.bleu:>10.2f} {v.chrf:>6.2f} {v.ratio:>7.3f} "
                  f"{v.src_ratio:>7.3f}   {t.bleu:>9.2f} {t.chrf:>6.2f} {t.ratio:>7.3f} "
                  f"{t.src_ratio:>7.3f}")
        for rule, c in entry["chosen"].items():
            print(f"  {rule:>14}: alpha {c['alpha']} -> test {c['test_bleu']:.2f}")
    print("\nrule (test BLEU of its choice per model; mean; worst gap to the best fixed "
          "alpha)")
    names = [*RULES, "valid-argmax", "fixed 0.6", "fixed 1.0"]
    summary = {}
    for rule in names:
        if rule.startswith("fixed"):
            a = float(rule.split()[1])
            scores = [next(t["bleu"] for t in r["test"] if t["alpha"] == a) for r in records]
        else:
            scores = [r["chosen"][rule]["test_bleu"] for r in records]
        gaps = [r["best_fixed"]["test_bleu"] - s for r, s in zip(records, scores, strict=True)]
        summary[rule] = {"mean": sum(scores) / len(scores), "worst_gap": max(gaps),
                         "scores": scores}
        print(f"  {rule:>14}: {' '.join(f'{s:6.2f}' for s in scores)}   mean "
              f"{summary[rule]['mean']:.2f}   worst gap {max(gaps):.2f}")
    from nmt.doctor import report as machine  # beside every figure

    doctor = machine(measure=False)
    print(json.dumps({"bench": "tune_evidence", "corpus_ratio": ratio, "alphas": alphas,
                      "records": records, "summary": summary, "doctor": doctor}))
    record.write([record.make("tune", "nmt", {
        "model": r["model"], "about": described.get(r["model"], ""),
        "data": opt.data.name, "corpus_ratio": round(ratio, 4)}, {
        "valid_bleu": {str(t["alpha"]): t["bleu"] for t in r["valid"]},
        "test_bleu": {str(t["alpha"]): t["bleu"] for t in r["test"]},
        "test_len_ratio": {str(t["alpha"]): t["ratio"] for t in r["test"]},
        "chosen_alpha": {rule: c["alpha"] for rule, c in r["chosen"].items()}}, doctor)
        for r in records], opt.record)


if __name__ == "__main__":
    main()
