"""Training throughput on CPU: nmt vs fairseq on identical batches and architecture.

For the `small` and `base` shapes, times one training update (forward + backward + Adam
step + zero_grad; dropout 0.1, label smoothing 0.1, shared embeddings, post-norm) on the
same length-bucketed batches of random ids with Multi30k-like lengths, and reports
non-padding source + target tokens/s and peak RSS. nmt runs exactly the hot path of
nmt/train/loop.py (non-PAD target rows projected, fused smoothed loss, its Adam); fairseq
(bench/.venv-fairseq, bench/_fairseq_train_step.py) runs TransformerModel +
label_smoothed_nll_loss + torch Adam.

Fair measurement on a shared machine: every measurement is its own process; nmt and
fairseq alternate (`--rounds`), so load changes hit both alike; tokens/s is reported both
per process CPU second (robust to other jobs when --threads 1) and per wall second, as the
median over all timed steps of all rounds. The load average is printed with the results.

Settings compared (each labelled in the output; --settings picks):
  fp32   nmt fp32 vs fairseq fp32: like for like (default)
  best   nmt --precision bf16 (autocast) vs fairseq fp32, fairseq's best setting that runs
         on CPU: `fairseq-train --cpu --bf16` switches on its TPU mode and fails without
         torch_xla; `--amp` autocasts CUDA only (default)
  bf16   nmt bf16 vs an emulation of fairseq --bf16 (bf16 weights, fp32 master copy in the
         optimizer, as its FP16Optimizer does): what fairseq would reach if it ran

    .venv/bin/python bench/train_throughput.py [--threads 1] [--steps 8] [--rounds 3]
        [--base-steps 3] [--base-rounds 2] [--shapes small,base] [--settings fp32,best]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from results import record  # noqa: E402  (bench/results/record.py)

FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
SHAPES = {"small": dict(layers=3, d_model=256, d_ff=1024, heads=4),
          "base": dict(layers=6, d_model=512, d_ff=2048, heads=8)}
# (nmt precision, fairseq precision). fairseq's --bf16 turns on its TPU mode and dies
# without torch_xla on CPU (checked with fairseq-train --cpu --bf16), and its --amp uses
# torch.cuda.amp (no effect on CPU ops), so fairseq's best working CPU setting is fp32.
# "bf16" compares against an emulation of what --bf16 would do (see _fairseq_train_step).
SETTINGS = {"fp32": ("fp32", "fp32"), "best": ("bf16", "fp32"), "bf16": ("bf16", "bf16")}


def make_batches(path: Path, steps: int, max_tokens: int, vocab: int, seed: int = 1) -> None:
    """Write `steps` collated batches (nmt layout) of random ids to an .npz."""
    sys.path.insert(0, str(REPO))
    from nmt.data.batching import batch_by_tokens, collate

    rng = np.random.default_rng(seed)
    n = 20000
    src_lens = np.clip(rng.normal(14, 5, n), 3, 60).astype(np.int64)
    tgt_lens = np.clip(src_lens + rng.integers(-3, 4, n), 3, 60).astype(np.int64)
    batches = batch_by_tokens(src_lens, tgt_lens, max_tokens, 256).batches
    full = [b for b in batches if len(b) * (max(src_lens[b].max(), tgt_lens[b].max()) + 1)
            > 0.8 * max_tokens]
    pick = rng.choice(len(full), steps, replace=False)
    arrays: dict[str, np.ndarray] = {"count": np.array(steps), "vocab": np.array(vocab)}
    for i, b in enumerate(pick):
        idx = full[b]
        batch = collate([rng.integers(4, vocab, s) for s in src_lens[idx]],
                        [rng.integers(4, vocab, t) for t in tgt_lens[idx]])
        arrays[f"src{i}"] = batch.src.numpy()
        arrays[f"tgt_in{i}"] = batch.tgt_in.numpy()
        arrays[f"tgt_out{i}"] = batch.tgt_out.numpy()
    np.savez(path, **arrays)


def summarize(toolkit: str, tokens: list[int], cpu: list[float], wall: list[float]) -> dict:
    """Per-step rates of one child process, plus its peak RSS."""
    return {"toolkit": toolkit, "tokens": tokens, "cpu_s": cpu, "wall_s": wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def nmt_child(batches: str, shape: dict, threads: int, precision: str, warmup: int,
              count: int) -> dict:
    """Time nmt's training update: `train_step` and `apply_update` (nmt/train/step.py),
    the functions `nmt train` runs, on CPU (logits projected, as the Trainer does there)."""
    import torch

    from nmt.config import ModelConfig, TrainConfig
    from nmt.data.batching import Batch
    from nmt.host_memory import keep_freed_memory
    from nmt.model.transformer import Transformer
    from nmt.precision import grad_scaler
    from nmt.train.feed import host_selection, to_device
    from nmt.train.schedule import build_optimizer
    from nmt.train.step import LossOptions, apply_update, train_step

    keep_freed_memory()  # as Trainer does on CPU
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    data = np.load(batches)
    cfg = ModelConfig(vocab_size=int(data["vocab"]), encoder_layers=shape["layers"],
                      decoder_layers=shape["layers"], d_model=shape["d_model"],
                      d_ff=shape["d_ff"], heads=shape["heads"], dropout=0.1)
    device = torch.device("cpu")
    model = Transformer(cfg).train()
    optimizer = build_optimizer(model.parameters(), TrainConfig(), device)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4  # fixed: the schedule's cost is nil, its warm-up would stall Adam
    scaler = grad_scaler(device, enabled=False)
    loss = LossOptions(label_smoothing=0.1, pad_id=cfg.pad_id)
    tokens, cpu, wall = [], [], []
    for i in range(min(int(data["count"]), warmup + count)):
        src_np, tgt_out_np = data[f"src{i}"], data[f"tgt_out{i}"]
        src = torch.from_numpy(src_np)
        tgt_in = torch.from_numpy(data[f"tgt_in{i}"])
        tgt_out = torch.from_numpy(tgt_out_np)
        c0, w0 = time.process_time(), time.perf_counter()
        src_lens = (src_np != 0).sum(1)  # the loop reads these from host length arrays
        tgt_lens = (tgt_out_np != 0).sum(1)
        ntok = int(tgt_lens.sum())
        has_pad, select = host_selection(src_lens, tgt_lens, tgt_out.size(1))
        micro = to_device(Batch(src, tgt_in, tgt_out, int(src_lens.sum()), ntok), has_pad,
                          select, device)
        step = train_step(model, model, [micro], tgt_tokens=ntok, optimizer=optimizer,
                          scaler=scaler, precision=precision, loss=loss)
        finite = bool(torch.isfinite(step.loss_sum) & torch.isfinite(step.grad_norm))
        apply_update(optimizer, scaler, finite)
        c1, w1 = time.process_time(), time.perf_counter()
        if i >= warmup:
            tokens.append(int(src_lens.sum()) + ntok)
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    return summarize("nmt", tokens, cpu, wall)


def run_child(cmd: list[str], threads: int) -> dict:
    """Run one measurement process; its last stdout line is JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rates(runs: list[dict]) -> dict:
    """Median tokens/s per CPU second and per wall second over every step of `runs`."""
    steps = [(t, c, w) for r in runs
             for t, c, w in zip(r["tokens"], r["cpu_s"], r["wall_s"], strict=True)]
    return {"tokens_per_cpu_s": statistics.median(t / c for t, c, _ in steps),
            "tokens_per_wall_s": statistics.median(t / w for t, _, w in steps),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "steps": len(steps),
            "rounds": len(runs)}


def measure(name: str, setting: str, batches: Path, opts: argparse.Namespace) -> dict:
    """Alternate nmt and fairseq runs of one shape and setting; both sides' rates."""
    shape = SHAPES[name]
    ours_prec, theirs_prec = SETTINGS[setting]
    steps = opts.steps if name == "small" else opts.base_steps
    rounds = opts.rounds if name == "small" else opts.base_rounds
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(run_child([sys.executable, __file__, "--child", "nmt", "--batches",
                               str(batches), "--shape", name, "--precision", ours_prec,
                               "--threads", str(opts.threads), "--count", str(steps)],
                              opts.threads))
        if FAIRSEQ_PY.exists():
            theirs.append(run_child([
                str(FAIRSEQ_PY), str(REPO / "bench" / "_fairseq_train_step.py"),
                str(batches), "--layers", str(shape["layers"]), "--d-model",
                str(shape["d_model"]), "--d-ff", str(shape["d_ff"]), "--heads",
                str(shape["heads"]), "--threads", str(opts.threads), "--precision",
                theirs_prec, "--count", str(steps), "--warmup-steps", str(opts.warmup)],
                opts.threads))
    entry: dict = {"nmt_precision": ours_prec, "nmt": rates(ours)}
    if theirs:
        entry["fairseq_precision"] = theirs_prec
        entry["fairseq"] = rates(theirs)
        for unit in ("cpu", "wall"):
            key = f"tokens_per_{unit}_s"
            entry[f"ratio_{unit}"] = entry["nmt"][key] / entry["fairseq"][key]
    return entry


def describe(name: str, setting: str, e: dict) -> str:
    """One human-readable result line."""
    n = e["nmt"]
    line = (f"{name:5s} {setting:4s} nmt[{e['nmt_precision']}] "
            f"{n['tokens_per_cpu_s']:6.0f} tok/cpu-s {n['tokens_per_wall_s']:6.0f} tok/wall-s "
            f"{n['peak_rss_mb']:5.0f} MB")
    if "fairseq" not in e:
        return line + " | fairseq venv missing"
    f = e["fairseq"]
    return (line + f" | fairseq[{e['fairseq_precision']}] {f['tokens_per_cpu_s']:6.0f} "
            f"tok/cpu-s {f['tokens_per_wall_s']:6.0f} tok/wall-s {f['peak_rss_mb']:5.0f} MB"
            f" | ratio cpu {e['ratio_cpu']:.2f}x wall {e['ratio_wall']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (1: CPU-time rates are robust)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps for small")
    parser.add_argument("--base-steps", type=int, default=3, help="timed steps for base")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3, help="alternating repeats (small)")
    parser.add_argument("--base-rounds", type=int, default=2, help="alternating repeats (base)")
    parser.add_argument("--shapes", default="small,base")
    parser.add_argument("--settings", default="fp32,best")
    record.add_argument(parser, "train-cpu")
    parser.add_argument("--child", choices=["nmt"], help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        result = nmt_child(opts.batches, SHAPES[opts.shape], opts.threads, opts.precision,
                           opts.warmup, opts.count or opts.steps)
        print(json.dumps(result))
        return
    results: dict[str, dict] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        batches = Path(tmp) / "batches.npz"
        make_batches(batches, max(opts.steps, opts.base_steps) + opts.warmup,
                     opts.max_tokens, opts.vocab)
        for name in opts.shapes.split(","):
            for setting in opts.settings.split(","):
                entry = measure(name, setting, batches, opts)
                results[f"{name}/{setting}"] = entry
                print(describe(name, setting, entry), flush=True)
    load = [load_before, os.getloadavg()[0]]
    print(f"load average (1 min) before/after: {load[0]:.1f} / {load[1]:.1f} on "
          f"{os.cpu_count()} cores; rates are medians over all timed steps of "
          f"{opts.rounds} (small) / {opts.base_rounds} (base) alternating rounds", flush=True)
    from nmt.doctor import report as machine  # beside every figure
    doctor = machine(measure=False)
    record.write(records(results, opts, doctor), opts.record)
    print(json.dumps({"doctor": doctor,
                      "bench": "train_throughput", "device": "cpu", "threads": opts.threads,
                      "max_tokens": opts.max_tokens, "vocab": opts.vocab,
                      "load_avg": load, "results": {
                          k: v for k, v in results.items()}}))


def records(results: dict[str, dict], opts: argparse.Namespace, doctor: dict) -> list[dict]:
    """train-cpu records (bench/results/README.md): per shape and setting, nmt's and
    fairseq's tokens/s (wall; CPU time beside it) on the same batches."""
    run = record.run_id()
    found = []
    threads = f"{opts.threads} thread{'s' if opts.threads > 1 else ''}"
    for key, entry in results.items():
        shape, _ = key.split("/")
        measure = f"tokens/s, {threads}, nmt {entry['nmt_precision']}" + (
            "" if shape == "small" else f", {shape}")
        for system in ("nmt", "fairseq"):
            if system not in entry:
                continue
            rates = entry[system]
            settings = {"bench": "train_throughput", "measure": measure, "shape": shape,
                        "precision": entry[f"{system}_precision"], "threads": opts.threads,
                        "max_tokens": opts.max_tokens, "vocab": opts.vocab}
            figures = {"tokens_per_s": rates["tokens_per_wall_s"],
                       "tokens_per_cpu_s": rates["tokens_per_cpu_s"],
                       "peak_rss_mb": rates["peak_rss_mb"], "steps": rates["steps"]}
            found.append(record.make("train-cpu", system, settings, figures, doctor, run=run))
    return found


if __name__ == "__main__":
    main()
