"""Time-to-quality race on Multi30k En-De: nmt against fairseq, same machine, same budget.

    .venv/bin/python bench/race_multi30k.py                 # budgets 5,10,20,30 minutes
    .venv/bin/python bench/race_multi30k.py --quick         # smoke test: budgets 1,2

What is held equal:
- data: `nmt prep multi30k-en-de` (mirror ../shared/data/multi30k) into bench/out/race/data,
  then `nmt bpe` (joint sentencepiece BPE, 8000 pieces). fairseq gets the same splits as
  piece text encoded with that DATA/spm.model and a dictionary built from its vocabulary
  (bench/_race_fairseq.py), so both models see identical token sequences;
- model: `small` = 3+3 layers, d_model 256, d_ff 1024, 4 heads, all embeddings shared,
  post-norm, sinusoidal positions, dropout 0.1;
- budget: one training run per toolkit of max(budgets) wall-clock minutes (plus one save
  interval and 30 s, so that the last mark has a checkpoint shortly before it), one after
  the other on the same machine; the clock starts when the training process is launched,
  so start-up (imports, data loading) counts against each toolkit. Checkpoints are saved
  every half minute (nmt, as its recipe does) or every 50 updates (fairseq); for each
  budget mark B, only the checkpoints whose file was complete at launch + B minutes are
  "available at B minutes". Decoding happens after both runs, so it never eats training
  time;
- decoding: beam 4, length penalty 0.6 (each toolkit's own formula: nmt the paper's GNMT
  penalty, fairseq score / length^0.6), max output length 0 * source + 50 pieces, each in
  its default precision (nmt `--precision auto`: bf16 on a CPU with native bf16; fairseq
  fp32, its only fast mode on a CPU);
- scoring: the same sacreBLEU call for both: detokenized BLEU (13a) and chrF of the
  test2016 output against the untouched reference ../shared/data/multi30k/test_2016_flickr.de.

Checkpoint choice (what each toolkit recommends): nmt averages the last 5 checkpoints saved
by the mark (the paper, section 6.1: `nmt average` over checkpoints written 10 minutes apart;
here half a minute apart, as in the Multi30k recipe and `make demo`). fairseq's
checkpoint-averaging script (scripts/average_checkpoints.py) is not shipped in the
fairseq-fixed wheel, so fairseq decodes the last checkpoint written by the mark
(`--fairseq-average N` is therefore not offered).

Training settings (override with --nmt-args / --fairseq-args): nmt trains with its
Multi30k recipe as `make demo` does (see `nmt_command` below: a linear decay to the end of
its budget); fairseq gets the same optimisation in its own flags (`train_command` in
bench/_race_fairseq.py): Adam (0.9, 0.98), 400 warm-up updates, label smoothing 0.1,
dropout 0.1, 2048 tokens per batch, no validation during training, and the schedule of
`--fairseq-schedule`: `inverse_sqrt` to `--fairseq-lr` (default 1.25e-3, the peak that
schedule was tuned to on nmt), or `linear` (fairseq's `polynomial_decay` to 0 at
`--fairseq-total-updates`, since fairseq has no clock-based decay: give it the updates
its inverse_sqrt run made in the budget). Each toolkit gets its best schedule for the
budget, so the race measures the toolkits, not a schedule one of them lacks.

Writes OUT/race.json and OUT/race.png (BLEU against minutes, one line per toolkit), prints a
table on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _race_fairseq as fs
from results import record

REPO = Path(__file__).resolve().parents[1]
NMT = Path(sys.executable).parent / "nmt"
MIRROR = REPO.parent / "shared" / "data" / "multi30k"
DATA = REPO / "bench" / "out" / "race" / "data"
BEAM, ALPHA, MAX_LEN_B = 4, 0.6, 50
AVERAGE_LAST = 5


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run `cmd` to completion with stdout+stderr in `log`; exit with its tail on failure."""
    with log.open("w", encoding="utf-8") as handle:
        code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        sys.exit(f"race: `{shlex.join(cmd[:3])} ...` failed (exit {code}); log {log}:\n{tail}")


def prepare_data(mirror: Path) -> None:
    """`nmt prep` + `nmt bpe` into bench/out/race/data, unless already done."""
    DATA.parent.mkdir(parents=True, exist_ok=True)
    if not (DATA / "manifest.json").exists():
        run([str(NMT), "prep", "multi30k-en-de", "--mirror", str(mirror), "-o", str(DATA)],
            DATA.parent / "prep.log")
    if not (DATA / "bin" / "meta.json").exists():
        run([str(NMT), "bpe", str(DATA)], DATA.parent / "bpe.log")


def empty(folder: Path) -> None:
    """Create `folder` or delete the files in it (runs and decodes hold no subfolders)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        path.unlink()


def timed_train(cmd: list[str], log: Path, minutes: float,
                env: dict[str, str] | None = None) -> dict[str, float]:
    """Launch a training process, wait for it (killing it 2 minutes after its budget if it
    has not stopped by itself) and return its launch and end times."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as handle:
        launch = time.time()
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=minutes * 60 + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the group of the process we started
            code = proc.wait()
    if code not in (0, -signal.SIGTERM):
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        sys.exit(f"race: training failed (exit {code}); log {log}:\n{tail}")
    return {"launch": launch, "end": time.time(), "exit_code": code}


def nmt_command(run_dir: Path, minutes: float, save_minutes: float,
                extra: list[str]) -> list[str]:
    """nmt train for the race with the recipe's own settings (recipes/multi30k-en-de.toml,
    the ones `make demo` uses, each documented there against the paper): `small`, Adam
    (0.9, 0.98, 1e-9), warmup 400 and lr scale 0.6 (peak 1.9e-3 at update 400, then down
    to 0 at the end of the budget), label smoothing 0.1, dropout 0.1, 2048 tokens per batch,
    bf16 autocast where the CPU does bf16 natively. Checkpoints every `save_minutes`, all
    kept so that every budget mark can find its last five; validation off (it would eat
    the budget)."""
    return [str(NMT), "train", str(DATA), "-o", str(run_dir),
            "--max-minutes", str(minutes), "--save-interval-minutes", str(save_minutes),
            "--keep-last", "1000", "--valid-interval", "1000000000", "--log-interval", "50",
            "--device", "cpu", "--seed", "1", *extra]


def nmt_checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint_{step}.pt files, oldest first by file time (checkpoint_last is a copy)."""
    found = [p for p in run_dir.glob("checkpoint_*.pt") if p.stem.split("_")[1].isdigit()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def available(paths: list[Path], launch: float, minutes: float) -> list[Path]:
    """The checkpoints complete at launch + `minutes` (written atomically, so mtime is when
    the file became complete)."""
    return [p for p in paths if p.stat().st_mtime - launch <= minutes * 60]


def score(hyps: list[str], refs: list[str]) -> dict[str, object]:
    """Detokenized sacreBLEU (13a) and chrF, with their signatures."""
    if len(hyps) != len(refs):
        sys.exit(f"race: {len(hyps)} hypotheses for {len(refs)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    return {"bleu": round(bleu.corpus_score(hyps, [refs]).score, 2),
            "chrf": round(chrf.corpus_score(hyps, [refs]).score, 2),
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def decode_nmt(run_dir: Path, ckpts: list[Path], budget: float, src: Path, refs: list[str],
               work: Path) -> dict[str, object]:
    """Average the last 5 checkpoints available at `budget`, translate test2016, score."""
    chosen = ckpts[-AVERAGE_LAST:]
    model = work / f"average_{budget:g}min.pt"
    if len(chosen) > 1:
        run([str(NMT), "average", *map(str, chosen), "-o", str(model)],
            work / f"average_{budget:g}min.log")
    else:
        model = chosen[0]
    hyp = work / f"test_{budget:g}min.hyp"
    start = time.perf_counter()
    run([str(NMT), "translate", "-m", str(model), "-i", str(src), "-o", str(hyp),
         "--beam", str(BEAM), "--alpha", str(ALPHA), "--max-len-a", "0",
         "--max-len-b", str(MAX_LEN_B), "--device", "cpu"], work / f"translate_{budget:g}min.log")
    seconds = time.perf_counter() - start
    hyps = hyp.read_text(encoding="utf-8").splitlines()
    steps = [int(p.stem.split("_")[1]) for p in chosen]
    return {"checkpoints": [p.name for p in chosen], "update": max(steps),
            "decode_seconds": round(seconds, 1), **score(hyps, refs)}


def decode_fairseq(bin_dir: Path, data_bin: Path, ckpts: list[Path], budget: float,
                   refs: list[str], work: Path) -> dict[str, object]:
    """Decode the last checkpoint available at `budget` with fairseq-generate, score."""
    chosen = ckpts[-1]
    start = time.perf_counter()
    hyps = fs.generate(bin_dir, data_bin, chosen, DATA / "spm.model", BEAM, ALPHA, MAX_LEN_B,
                       work / f"generate_{budget:g}min.log")
    seconds = time.perf_counter() - start
    (work / f"test_{budget:g}min.hyp").write_text("".join(h + "\n" for h in hyps),
                                                  encoding="utf-8")
    return {"checkpoints": [chosen.name], "update": fs.num_updates(bin_dir, [chosen])[0],
            "decode_seconds": round(seconds, 1), **score(hyps, refs)}


def plot(results: dict[str, list[dict]], path: Path, title: str) -> bool:
    """BLEU against minutes, one line per toolkit; False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("race: matplotlib missing (pip install 'nmt[plot]'); no race.png",
              file=sys.stderr)
        return False
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.subplots()
    for toolkit, rows in results.items():
        xs = [r["minutes"] for r in rows if r.get("bleu") is not None]
        ys = [r["bleu"] for r in rows if r.get("bleu") is not None]
        ax.plot(xs, ys, marker="o", label=toolkit)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
    ax.set_xlabel("training wall-clock minutes (from process launch)")
    ax.set_ylabel("BLEU, test2016 (sacreBLEU, detok.)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="5,10,20,30",
                        help="Budget marks in minutes (default: 5,10,20,30).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: budgets 1,2, saves every 15 s, first "
                        "200 test lines, output in bench/out/race-quick.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Output folder (default bench/out/race, or race-quick).")
    parser.add_argument("--mirror", type=Path, default=MIRROR,
                        help=f"Multi30k mirror for nmt prep (default {MIRROR}).")
    parser.add_argument("--toolkits", default="nmt,fairseq",
                        help="Which sides to run (default: nmt,fairseq).")
    parser.add_argument("--save-minutes", type=float, default=None,
                        help="nmt checkpoint interval (default 0.5, the recipe's; 0.25 "
                        "with --quick).")
    parser.add_argument("--fairseq-save-updates", type=int, default=None,
                        help="fairseq checkpoint interval in updates (default 50; 5 with "
                        "--quick); it also saves at every epoch end.")
    parser.add_argument("--nmt-args", default="", help="Extra `nmt train` flags.")
    parser.add_argument("--fairseq-args", default="", help="Extra fairseq-train flags.")
    parser.add_argument("--fairseq-schedule", default="inverse_sqrt", choices=fs.SCHEDULES,
                        help="fairseq's schedule: inverse_sqrt (the paper's) or linear "
                        "(polynomial_decay to 0 at --fairseq-total-updates).")
    parser.add_argument("--fairseq-lr", type=float, default=1.25e-3,
                        help="fairseq's peak learning rate (default 1.25e-3).")
    parser.add_argument("--fairseq-total-updates", type=int, default=None,
                        help="Where fairseq's linear schedule reaches 0: the updates it "
                        "makes in the budget (from an inverse_sqrt run's log).")
    record.add_argument(parser, "train-cpu")
    parser.add_argument("--retrain", action="store_true",
                        help="Delete earlier runs in OUT instead of reusing them.")
    args = parser.parse_args()

    budgets = [1.0, 2.0] if args.quick else [float(b) for b in args.budgets.split(",")]
    budgets = sorted(budgets)
    out = args.out or REPO / "bench" / "out" / ("race-quick" if args.quick else "race")
    save_minutes = args.save_minutes or (0.25 if args.quick else 0.5)
    fs_save_updates = args.fairseq_save_updates or (5 if args.quick else 50)
    test_lines = 200 if args.quick else None
    toolkits = [t.strip() for t in args.toolkits.split(",") if t.strip()]
    # Train a little past the last mark, so that a checkpoint saved shortly before it (and
    # not only the one at the process's own stop, which start-up pushes past the mark) exists.
    minutes = max(budgets) + save_minutes + 0.5
    out.mkdir(parents=True, exist_ok=True)

    prepare_data(args.mirror)
    manifest = json.loads((DATA / "manifest.json").read_text(encoding="utf-8"))
    src_lang, tgt_lang = manifest["src_lang"], manifest["tgt_lang"]
    refs = (args.mirror / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    refs = refs[:test_lines]
    test_src = out / "test.src"
    test_src.write_text("".join(line + "\n" for line in (DATA / "test.src").read_text(
        encoding="utf-8").splitlines()[:test_lines]), encoding="utf-8")

    # ---- training: one after the other, nothing else of ours running ----
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    commands: dict[str, list[str]] = {}
    fs_bin = fs_data = None
    if "fairseq" in toolkits:
        fs_bin = fs.ensure_venv()
        fs_data = fs.prepare(DATA, out / "fairseq", src_lang, tgt_lang, fs_bin, test_lines)
    for toolkit in toolkits:
        run_dir = out / toolkit / "run"
        if toolkit == "nmt":
            cmd = nmt_command(run_dir, minutes, save_minutes, shlex.split(args.nmt_args))
            env = None
        elif toolkit == "fairseq":
            assert fs_bin is not None and fs_data is not None
            cmd = fs.train_command(fs_bin, fs_data, run_dir, minutes, fs_save_updates,
                                   shlex.split(args.fairseq_args),
                                   fs.schedule_flags(args.fairseq_schedule, args.fairseq_lr,
                                                     args.fairseq_total_updates))
            env = fs.ENV
        else:
            sys.exit(f"race: unknown toolkit {toolkit!r}; choose among nmt, fairseq")
        commands[toolkit] = cmd
        if toolkit in timing and not args.retrain and run_dir.exists():
            print(f"race: reusing the {toolkit} run in {run_dir} (--retrain to redo)",
                  file=sys.stderr)
            continue
        empty(run_dir)
        print(f"race: training {toolkit} for {minutes:g} minutes", file=sys.stderr)
        timing[toolkit] = timed_train(cmd, out / toolkit / "train.log", minutes, env)
        timing_path.write_text(json.dumps(timing, indent=1))

    # ---- decoding and scoring, after all training ----
    results: dict[str, list[dict]] = {}
    for toolkit in toolkits:
        run_dir = out / toolkit / "run"
        work = out / toolkit / "decode"
        empty(work)  # only this run's averages and outputs, never an earlier one's
        ckpts = (nmt_checkpoints(run_dir) if toolkit == "nmt" else fs.checkpoints(run_dir))
        launch = timing[toolkit]["launch"]
        rows = []
        for budget in budgets:
            have = available(ckpts, launch, budget)
            row: dict[str, object] = {"minutes": budget}
            if not have:
                row.update(bleu=None, chrf=None, note="no checkpoint written by then")
            elif toolkit == "nmt":
                row.update(decode_nmt(run_dir, have, budget, test_src, refs, work))
            else:
                assert fs_bin is not None and fs_data is not None
                row.update(decode_fairseq(fs_bin, fs_data, have, budget, refs, work))
            if have:
                row["written_at_minutes"] = round(
                    (have[-1].stat().st_mtime - launch) / 60, 2)
            print(f"race: {toolkit} at {budget:g} min: BLEU {row['bleu']} chrF {row['chrf']}",
                  file=sys.stderr)
            rows.append(row)
        results[toolkit] = rows

    report = {
        "benchmark": "race_multi30k", "quick": args.quick, "budgets_minutes": budgets,
        "test": f"test_2016_flickr ({len(refs)} lines)", "data": str(DATA),
        "decoding": {"beam": BEAM, "length_penalty": ALPHA, "max_len": f"0*src+{MAX_LEN_B}"},
        "checkpoint_choice": {"nmt": f"average of the last {AVERAGE_LAST} saved by the mark",
                              "fairseq": "last saved by the mark (average_checkpoints.py is "
                              "not in the fairseq-fixed wheel)"},
        "commands": {k: shlex.join(v) for k, v in commands.items()},
        "training": {k: {"minutes_run": round((v["end"] - v["launch"]) / 60, 2),
                         "exit_code": v["exit_code"]} for k, v in timing.items()
                     if k in toolkits},
        # A busy machine slows both sides: compare figures only from a quiet one.
        "host": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "results": results,
    }
    (out / "race.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    plotted = plot(results, out / "race.png",
                   f"Multi30k En-De test2016, small model, {os.cpu_count()} CPU cores")

    print(f"{'minutes':>8} " + " ".join(f"{t + ' BLEU':>13} {t + ' chrF':>13}"
                                        for t in toolkits), file=sys.stderr)
    for i, budget in enumerate(budgets):
        cells = " ".join(f"{results[t][i]['bleu']!s:>13} {results[t][i]['chrf']!s:>13}"
                         for t in toolkits)
        print(f"{budget:>8g} {cells}", file=sys.stderr)
    print(f"race: wrote {out / 'race.json'}" + (f" and {out / 'race.png'}" if plotted else ""),
          file=sys.stderr)
    summary = {"benchmark": "race_multi30k", "quick": args.quick,
               **{f"{t}_bleu": {f"{r['minutes']:g}": r["bleu"] for r in results[t]}
                  for t in toolkits},
               **{f"{t}_chrf": {f"{r['minutes']:g}": r["chrf"] for r in results[t]}
                  for t in toolkits}}
    from nmt.doctor import report as machine  # beside every figure
    doctor = machine(measure=False)
    print(json.dumps({**summary, "doctor": doctor}))
    record.write(records(results, report, args, budgets, doctor), args.record)


def records(results: dict[str, list[dict]], report: dict, args: argparse.Namespace,
            budgets: list[float], doctor: dict) -> list[dict]:
    """train-cpu records (bench/results/README.md): per toolkit and budget mark, test2016
    BLEU, chrF and the updates by then; `mid_run` where the run's schedule had not ended
    by the mark (a longer budget's checkpoint)."""
    run = record.run_id()
    nmt_args = shlex.split(args.nmt_args)
    nmt_end = (float(nmt_args[nmt_args.index("--max-minutes") + 1])
               if "--max-minutes" in nmt_args else max(budgets))
    schedules = {"nmt": "the recipe's" + (f", --max-minutes {nmt_end:g}"
                                          if "--max-minutes" in nmt_args else ""),
                 "fairseq": f"{args.fairseq_schedule}, peak {args.fairseq_lr:g}" + (
                     f", to 0 at update {args.fairseq_total_updates}"
                     if args.fairseq_total_updates else "")}
    found = []
    for toolkit, rows in results.items():
        end = nmt_end if toolkit == "nmt" else max(budgets)
        for row in rows:
            if row.get("bleu") is None:
                continue
            settings = {"bench": "race_multi30k",
                        "measure": f"test2016 BLEU at {row['minutes']:g} minutes",
                        "shape": "small", "schedule": schedules[toolkit],
                        "budget_minutes": end, "mid_run": row["minutes"] < end - 0.5,
                        "beam": BEAM, "alpha": ALPHA, "quick": args.quick,
                        "smoke": args.quick, "command": report["commands"].get(toolkit)}
            figures = {"minutes": row["minutes"], "bleu": row["bleu"], "chrf": row.get("chrf"),
                       "updates": row.get("update")}
            found.append(record.make("train-cpu", toolkit, settings, figures, doctor, run=run))
    return found


if __name__ == "__main__":
    main()
