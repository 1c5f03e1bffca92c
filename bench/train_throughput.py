"""Training throughput on CPU: nmt vs fairseq on identical batches and architecture.

For the `small` and `base` shapes, times forward + backward + Adam step (fp32, dropout 0.1,
label smoothing 0.1, shared embeddings, post-norm) on the same length-bucketed batches of
random ids with Multi30k-like lengths, and reports non-padding source + target tokens/s
(median over steps) and peak RSS. Each measurement runs in its own process; fairseq runs
in bench/.venv-fairseq via bench/_fairseq_train_step.py. Ends with one JSON line.

    .venv/bin/python bench/train_throughput.py [--threads 2] [--steps 8]
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
FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
SHAPES = {"small": dict(layers=3, d_model=256, d_ff=1024, heads=4),
          "base": dict(layers=6, d_model=512, d_ff=2048, heads=8)}


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


def nmt_child(batches: str, shape: dict, threads: int, warmup_steps: int) -> dict:
    """Time nmt's training step (the same code as nmt/train/loop.py's micro-batch)."""
    import torch

    from nmt.config import ModelConfig, TrainConfig
    from nmt.model import Transformer
    from nmt.train.loss import label_smoothed_nll
    from nmt.train.schedule import build_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    data = np.load(batches)
    cfg = ModelConfig(vocab_size=int(data["vocab"]), encoder_layers=shape["layers"],
                      decoder_layers=shape["layers"], d_model=shape["d_model"],
                      d_ff=shape["d_ff"], heads=shape["heads"], dropout=0.1)
    model = Transformer(cfg).train()
    optimizer = build_optimizer(model.parameters(), TrainConfig(), torch.device("cpu"))
    times, tokens = [], []
    for i in range(int(data["count"])):
        src = torch.from_numpy(data[f"src{i}"])
        tgt_in = torch.from_numpy(data[f"tgt_in{i}"])
        tgt_out = torch.from_numpy(data[f"tgt_out{i}"])
        start = time.perf_counter()
        logits = model(src, tgt_in, has_pad=True)
        loss, _ = label_smoothed_nll(logits, tgt_out, 0.1, 0)
        ntok = int(tgt_out.ne(0).sum())
        (loss / ntok).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if i >= warmup_steps:
            times.append(elapsed)
            tokens.append(int(src.ne(0).sum()) + ntok)
    rates = [t / s for t, s in zip(tokens, times, strict=True)]
    return {"toolkit": "nmt", "tokens_per_s": statistics.median(rates),
            "total_tokens_per_s": sum(tokens) / sum(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "steps": len(times)}


def run_child(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps (+2 warm-up)")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=2, help="alternating repeats")
    parser.add_argument("--shapes", default="small,base")
    parser.add_argument("--child", choices=["nmt"], help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(nmt_child(opts.batches, SHAPES[opts.shape], opts.threads, 2)))
        return
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        batches = Path(tmp) / "batches.npz"
        make_batches(batches, opts.steps + 2, opts.max_tokens, opts.vocab)
        for name in opts.shapes.split(","):
            shape = SHAPES[name]
            ours, theirs = [], []
            for _ in range(opts.rounds):  # alternate so load changes hit both alike
                ours.append(run_child([sys.executable, __file__, "--child", "nmt", "--batches",
                                       str(batches), "--shape", name,
                                       "--threads", str(opts.threads)]))
                if FAIRSEQ_PY.exists():
                    theirs.append(run_child([
                        str(FAIRSEQ_PY), str(REPO / "bench" / "_fairseq_train_step.py"),
                        str(batches), "--layers", str(shape["layers"]), "--d-model",
                        str(shape["d_model"]), "--d-ff", str(shape["d_ff"]), "--heads",
                        str(shape["heads"]), "--threads", str(opts.threads)]))
            best = max(ours, key=lambda r: r["tokens_per_s"])
            entry = {"nmt_tokens_per_s": best["tokens_per_s"],
                     "nmt_peak_rss_mb": best["peak_rss_mb"]}
            if theirs:
                fb = max(theirs, key=lambda r: r["tokens_per_s"])
                entry.update(fairseq_tokens_per_s=fb["tokens_per_s"],
                             fairseq_peak_rss_mb=fb["peak_rss_mb"],
                             ratio=best["tokens_per_s"] / fb["tokens_per_s"])
            results[name] = entry
            print(f"{name}: nmt {entry['nmt_tokens_per_s']:.0f} tok/s "
                  f"({entry['nmt_peak_rss_mb']:.0f} MB)"
                  + (f" | fairseq {entry['fairseq_tokens_per_s']:.0f} tok/s "
                     f"({entry['fairseq_peak_rss_mb']:.0f} MB) | ratio {entry['ratio']:.2f}x"
                     if "ratio" in entry else " | fairseq venv missing"), flush=True)
    print(json.dumps({"bench": "train_throughput", "device": "cpu", "threads": opts.threads,
                      "max_tokens": opts.max_tokens, "results": results}))


if __name__ == "__main__":
    main()
