"""Output projection + label-smoothed loss: reference vs chunked, time and peak memory.

reference: `F.linear(features, weight)` then `label_smoothed_nll` (what nmt/train/loop.py
runs: (rows, V) logits in the compute dtype, fp32 log-probs kept for the backward, and the
logits kept alive through the backward as the loop's `logits` variable keeps them).
fused: `projected_smoothed_loss(features, weight, target, eps, chunk_rows=...)` (only a
(chunk, V) block at a time; logits recomputed in backward); fused_compiled: the same with
`compiled=True` (torch.compile'd per-chunk softmax statistics and logit gradient).
One step = forward + backward of loss * (1 / rows) with fp32 features (a LayerNorm's
output under autocast) and the fp32 shared weight, eps 0.1, so both gradients are
produced.

Shapes: `small` (Multi30k `small` preset at max-tokens ~2048: 2,000 rows, V 8,000, d 256)
and `base` (4,096 rows, V 37,000, d 512), each in fp32 and bf16 autocast.

Timing: the variants take turns step by step in one process (interleaved, the order
rotating, so load from other jobs hits all alike), after one warm-up step each; median process CPU
time and wall time per step. Peak memory: each (shape, precision, variant) runs one step in
its own process: on CPU the rise of peak RSS (VmHWM, reset just before) over the RSS before
the step
(inputs and weights already allocated, one tiny step run first to get one-off library
setup out of the way), on CUDA `max_memory_allocated` over the memory
allocated before the step.

    .venv/bin/python bench/loss_speed.py [--device cpu|cuda] [--shapes small,base]
        [--precisions fp32,bf16] [--variants reference,fused,fused_compiled] [--steps 5]
        [--threads 1] [--chunk-rows 1024]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt.train.loss import (  # noqa: E402
    DEFAULT_CHUNK_ROWS,
    label_smoothed_nll,
    projected_smoothed_loss,
)

SHAPES = {"small": dict(rows=2000, vocab=8000, dim=256),
          "base": dict(rows=4096, vocab=37000, dim=512)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 0.1


def make_inputs(shape: dict, device: torch.device) -> tuple[torch.Tensor, ...]:
    """fp32 features (rows, d) and weight (V, d) with gradients, targets (rows,)."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab, dim = shape["rows"], shape["vocab"], shape["dim"]
    features = torch.randn(rows, dim, generator=gen).to(device).requires_grad_(True)
    weight = (torch.randn(vocab, dim, generator=gen) * dim ** -0.5).to(device)
    target = torch.randint(1, vocab, (rows,), generator=gen).to(device)
    return features, weight.requires_grad_(True), target


def step(variant: str, precision: str, inputs: tuple[torch.Tensor, ...],
         chunk_rows: int) -> float:
    """One forward + backward; returns the loss (a host sync, so the step is complete)."""
    features, weight, target = inputs
    features.grad = weight.grad = None
    ctx = (torch.autocast(features.device.type, dtype=DTYPES[precision])
           if precision in DTYPES else torch.autocast(features.device.type, enabled=False))
    with ctx:
        if variant.startswith("fused"):
            loss, _ = projected_smoothed_loss(features, weight, target, EPS, pad_id=0,
                                              chunk_rows=chunk_rows,
                                              compiled=variant == "fused_compiled")
            logits = None
        else:
            logits = F.linear(features, weight)  # (rows, V), alive through backward
            loss, _ = label_smoothed_nll(logits, target, EPS, 0)
    (loss * (1.0 / target.numel())).backward()
    del logits
    return loss.item()


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: now; VmHWM: peak), in bytes.

    Not ru_maxrss: Linux carries it over from the parent across exec, so a child started
    by a large parent would report the parent's peak."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0), so it measures what follows."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def memory_child(opts: argparse.Namespace) -> dict:
    """Peak memory of one step of one variant, in a fresh process."""
    device = torch.device(opts.device)
    inputs = make_inputs(SHAPES[opts.shape], device)
    if device.type == "cuda":
        step(opts.variant, opts.precision, inputs, opts.chunk_rows)  # warm-up: grads exist
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(opts.variant, opts.precision, inputs, opts.chunk_rows)
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before}
    # A tiny step first: the first step of a process also pays one-off library setup
    # (hundreds of MiB of transient RSS), which would hide the difference.
    tiny = make_inputs(dict(rows=8, vocab=50, dim=16), device)
    step(opts.variant, opts.precision, tiny, 4)
    reset_peak_rss()
    before = status_bytes("VmRSS")
    step(opts.variant, opts.precision, inputs, opts.chunk_rows)
    return {"peak_bytes": status_bytes("VmHWM") - before}


def peak_memory(shape: str, precision: str, variant: str, opts: argparse.Namespace) -> int:
    """Run `memory_child` in its own process (ru_maxrss is per process lifetime)."""
    cmd = [sys.executable, __file__, "--child", "--shape", shape, "--precision", precision,
           "--variant", variant, "--device", opts.device, "--chunk-rows", str(opts.chunk_rows)]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"memory child failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


def time_variants(shape: str, precision: str, opts: argparse.Namespace) -> dict[str, dict]:
    """The variants taking turns step by step; medians of CPU and wall seconds."""
    device = torch.device(opts.device)
    inputs = make_inputs(SHAPES[shape], device)
    variants = opts.variants.split(",")
    times: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": []} for v in variants}
    losses = {}
    for i in range(opts.steps + 1):
        shift = i % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            c0, w0 = time.process_time(), time.perf_counter()
            losses[variant] = step(variant, precision, inputs, opts.chunk_rows)
            c1, w1 = time.process_time(), time.perf_counter()
            if i > 0:  # the first step of each warms up
                times[variant]["cpu"].append(c1 - c0)
                times[variant]["wall"].append(w1 - w0)
    return {v: {"cpu_s": statistics.median(t["cpu"]), "wall_s": statistics.median(t["wall"]),
                "loss": losses[v]} for v, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="small,base")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--variants", default="reference,fused,fused_compiled")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.child:
        print(json.dumps(memory_child(opts)))
        return
    results: dict[str, dict] = {}
    print(f"{'shape':<6}{'prec':<6}{'variant':<16}{'cpu s':>8}{'wall s':>8}{'peak MiB':>10}"
          f"{'loss':>14}")
    for shape in opts.shapes.split(","):
        for precision in opts.precisions.split(","):
            rows = time_variants(shape, precision, opts)
            for variant, row in rows.items():
                if not opts.skip_memory:
                    row["peak_mib"] = peak_memory(shape, precision, variant, opts) / 2 ** 20
                peak = f"{row['peak_mib']:.0f}" if "peak_mib" in row else "-"
                print(f"{shape:<6}{precision:<6}{variant:<16}{row['cpu_s']:>8.3f}"
                      f"{row['wall_s']:>8.3f}{peak:>10}{row['loss']:>14.3f}", flush=True)
            ratios = {f"{v}_over_reference_cpu": rows[v]["cpu_s"] / rows["reference"]["cpu_s"]
                      for v in rows if v != "reference" and "reference" in rows}
            results[f"{shape}/{precision}"] = {**SHAPES[shape], **rows, **ratios}
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "loss_speed", "device": opts.device, "threads": opts.threads,
                      "chunk_rows": opts.chunk_rows, "steps": opts.steps,
                      "load_avg": list(os.getloadavg()), "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
