"""`nmt serve` under load: sentences/s and latency at several concurrencies, next to
`nmt translate` on the same lines, model and threads.

Starts `nmt serve -m en-de=CHECKPOINT --threads T` on a free loopback port, then for each
request size (1 and 20 lines) and concurrency (1, 8, 32) sends --requests requests of
consecutive Multi30k test2016 lines (LibreTranslate's POST /translate, JSON), from that many
client threads, and records every request's latency. The baseline is the same lines
translated as one file by `nmt translate --stats` (sentences/s of its translation time) and,
for the latency target, one line at a time through the Python API (its median per-line
time). Targets (issue 21): at concurrency 32 the server delivers >= 80 % of `nmt translate`'s
sentences/s; at concurrency 1 a 1-line request's p50 latency <= its translate time + 15 ms.

The clients run on the same machine as the server (HTTP and JSON in Python cost CPU there
too): on a 2-core machine that is part of what is measured. Name the CPU beside figures.
Run: .venv/bin/python bench/serve_load.py --checkpoint runs/multi30k-en-de/average.pt
`--smoke`: a few requests per cell (a check that it runs). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_EN = REPO.parent / "shared" / "data" / "multi30k" / "test_2016_flickr.en"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, lines: list[str]) -> float:
    """One LibreTranslate request; its latency in seconds."""
    body = json.dumps({"q": lines, "source": "en", "target": "de"}).encode()
    request = urllib.request.Request(url + "/translate", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    elapsed = time.perf_counter() - start
    assert len(answer["translatedText"]) == len(lines)
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def load_cell(url: str, lines: list[str], size: int, concurrency: int, requests: int
              ) -> dict[str, float]:
    """`requests` requests of `size` lines from `concurrency` threads."""
    asks = [[lines[(i * size + k) % len(lines)] for k in range(size)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(lambda ask: post(url, ask), asks))
    wall = time.perf_counter() - start
    ms = [1000 * t for t in latencies]
    return {"lines": size, "concurrency": concurrency, "requests": requests,
            "sentences_per_s": requests * size / wall, "p50_ms": percentile(ms, 50),
            "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99)}


def translate_file(checkpoint: Path, lines: list[str], threads: int) -> float:
    """`nmt translate --stats` sentences/s on `lines` (its translation time)."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "translate", "-m", str(checkpoint),
                           "--stats"], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                          check=True)
    summary = [line for line in done.stderr.splitlines() if "sentences/s" in line][-1]
    return float(summary.split("sentences/s")[0].split(":")[-1].strip().split()[-1])


def per_line_ms(checkpoint: Path, lines: list[str], threads: int) -> float:
    """Median time of translating one line alone through the Python API."""
    code = ("import json,sys,time,torch\n"
            f"torch.set_num_threads({threads})\n"
            "from nmt import Translator\n"
            f"t = Translator.load({str(checkpoint)!r}, quiet=True)\n"
            "lines = json.loads(sys.stdin.read())\n"
            "t.translate(lines[:5])\n"
            "times = []\n"
            "for line in lines:\n"
            "    s = time.perf_counter(); t.translate([line]); "
            "times.append(time.perf_counter() - s)\n"
            "times.sort(); print(1000 * times[len(times) // 2])\n")
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(lines),
                          capture_output=True, text=True, cwd=REPO, check=True)
    return float(done.stdout.strip())


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("Model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("Flags")), [])
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(vector)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=0,
                        help="Requests per cell (default: 200 of 1 line, 40 of 20 lines, "
                        "at least 5 per client).")
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    lines = [line for line in TEST_EN.read_text(encoding="utf-8").split("\n") if line]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "-m", f"en-de={opts.checkpoint}",
         "--port", str(port), "--threads", str(opts.threads), "--max-lines", "64"],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    cells = []
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.2)
        post(url, lines[:20])  # warm-up
        for size in (1, 20):
            for concurrency in (1, 8, 32):
                # At least 5 rounds of the clients: one round at concurrency 32 is a
                # batch or two, too few to measure.
                requests = opts.requests or max(200 if size == 1 else 40, 5 * concurrency)
                if opts.smoke:
                    requests = concurrency
                cell = load_cell(url, lines, size, concurrency, requests)
                cells.append(cell)
                print(f"{size:>2} lines x {concurrency:>2} concurrent: "
                      f"{cell['sentences_per_s']:7.1f} sentences/s, p50 {cell['p50_ms']:7.1f} "
                      f"ms, p95 {cell['p95_ms']:7.1f} ms, p99 {cell['p99_ms']:7.1f} ms",
                      flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
        assert server.stderr is not None
        server.stderr.close()
    sample = lines[:100] if opts.smoke else lines
    file_rate = translate_file(opts.checkpoint, sample, opts.threads)
    alone_ms = per_line_ms(opts.checkpoint, lines[:20 if opts.smoke else 200], opts.threads)
    best32 = max(c["sentences_per_s"] for c in cells if c["concurrency"] == 32)
    one = next(c for c in cells if c["lines"] == 1 and c["concurrency"] == 1)
    print(f"nmt translate (file): {file_rate:.1f} sentences/s; one line alone: "
          f"{alone_ms:.1f} ms (median)")
    print(f"target 1: concurrency 32 gives {best32 / file_rate:.0%} of nmt translate "
          f"(goal >= 80 %)")
    print(f"target 2: 1-line p50 {one['p50_ms']:.1f} ms vs {alone_ms:.1f} ms + 15 ms "
          f"({'met' if one['p50_ms'] <= alone_ms + 15 else 'missed'})")
    print(json.dumps({"bench": "serve_load", "cpu": cpu_name(), "threads": opts.threads,
                      "checkpoint": str(opts.checkpoint), "cells": cells,
                      "translate_file_sentences_per_s": file_rate,
                      "one_line_alone_ms": alone_ms,
                      "c32_vs_translate": best32 / file_rate}))


if __name__ == "__main__":
    main()
