"""Linear-layer kernels on this CPU at decoder shapes: fp32 / bf16 packed oneDNN versus the
int8 ones torch offers, microseconds per call (best of interleaved rounds).

Rows x in -> out for the `small` model's linears (256 -> 768 fused QKV, 256 -> 256, 256 ->
1024 and 1024 -> 256 feed-forward, 256 -> 8000 vocabulary) at 4..1024 rows (beam 4 x 1..256
sentences). Kernels:
- fp32 / bf16: torch.ops.mkldnn._linear_pointwise with the weight packed once (what
  nmt/inference/packed_linear.py runs);
- fbgemm / onednn: quantized::linear_dynamic with int8 per-channel weights packed by that
  engine (activations quantized per tensor inside the call: what nmt/inference/int8_linear.py runs);
- onednn_static: onednn::qlinear_pointwise (torch.compile's x86 int8 op) with the uint8
  activation quantized in Python first;
- int_mm: torch._int_mm on int8 activations quantized per row in Python, then rescaled.
Run it with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
to time the AVX2 code paths on an AVX-512 machine. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nmt.inference.int8_linear import _prepack, quantize_weight

SHAPES = [(256, 768), (256, 256), (256, 1024), (1024, 256), (256, 8000)]
ROWS = [4, 16, 64, 256, 1024]


def timer(fn) -> float:
    """Seconds per call of `fn`, over at least 20 ms."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed > 0.02:
            return elapsed / calls


def kernels(k: int, n: int) -> dict:
    """name -> function of x (rows, k) for one weight (n, k)."""
    torch.manual_seed(0)
    w, b = torch.randn(n, k) / k ** 0.5, torch.randn(n)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    q, scale = quantize_weight(w)
    fns = {"fp32": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")}
    try:  # oneDNN's bf16 linear needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        wb, bb = w.bfloat16(), b.bfloat16()
        packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb, None)
        fns["bf16"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed_bf16,
                                                                   bb, "none", [], "")
    except RuntimeError:
        pass
    for engine in ("fbgemm", "onednn"):
        params = _prepack(engine, q, scale, b)
        fns[engine] = lambda x, p=params: torch.ops.quantized.linear_dynamic(x, p, False)
    qw = torch.ops.onednn.qlinear_prepack(q, None)
    zeros = torch.zeros(n, dtype=torch.long)

    def onednn_static(x: torch.Tensor) -> torch.Tensor:
        lo, hi = (float(v) for v in torch.aminmax(x))
        s = max(max(hi, 0.0) - min(lo, 0.0), 1e-8) / 255
        zp = int(round(-min(lo, 0.0) / s))
        qx = torch.clamp(torch.round(x / s) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, s, zp, qw, scale, zeros, b, 1.0, 0,
                                                  torch.float32, "none", [], "")

    qt = q.t().contiguous()

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xs = x.abs().amax(1, keepdim=True).clamp_(min=1e-8) / 127  # (rows, 1)
        acc = torch._int_mm(torch.round(x / xs).to(torch.int8), qt)  # (rows, n) int32
        return torch.addcmul(b, acc.float(), xs * scale)

    fns["onednn_static"] = onednn_static
    fns["int_mm"] = int_mm
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    results = []
    names = None
    for k, n in SHAPES:
        fns = kernels(k, n)
        names = list(fns)
        for rows in ROWS:
            x = torch.randn(rows, k)
            best = {name: float("inf") for name in fns}
            for _ in range(opts.rounds):  # interleaved: every kernel once per round
                for name, fn in fns.items():
                    try:
                        best[name] = min(best[name], timer(lambda fn=fn, x=x: fn(x)))
                    except RuntimeError:
                        best[name] = float("nan")
            us = {name: round(t * 1e6, 1) for name, t in best.items()}
            results.append({"rows": rows, "in": k, "out": n, "us": us})
            print(f"{rows:5d} x {k:4d} -> {n:4d}: " + "  ".join(
                f"{name} {t:8.1f}" for name, t in us.items()), flush=True)
    env = {key: os.environ.get(key, "") for key in
           ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")}
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "int8_kernels", "threads": opts.threads, "kernels": names,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "env": env,
                      "results": results, "load_average_1_5_15": list(os.getloadavg())}))


if __name__ == "__main__":
    main()
