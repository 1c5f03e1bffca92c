"""`nmt serve` under load: sentences/s and latency at several concurrencies, next to
`nmt translate` on the same lines, model and threads.

Starts `nmt serve -m en-de=CHECKPOINT --workers W --threads T` on a free loopback port
(each W of --workers in turn, within every round), then for each
request size (1 and 20 lines) and concurrency (1, 8, 32) sends --requests requests of
consecutive Multi30k test2016 lines (LibreTranslate's POST /translate, JSON), from that many
client threads, and records every request's latency. The baselines, measured right after
the cells in each round: the same lines translated as one file by `nmt translate --stats`
(sentences/s of its translation time); the same with `--buffer-size` 32 and 640, that is
with as many sentences in flight as the concurrency-32 cells keep (what no batching of
those requests can beat: the engine itself at that batch size); and, for the latency
target, one line at a time through the Python API (its median per-line time). Targets
(issue 21): at concurrency 32 the server delivers >= 80 % of `nmt translate`'s sentences/s;
at concurrency 1 a 1-line request's p50 latency <= its translate time + 15 ms.

`--rounds` (default 3) repeats every cell and baseline; each ratio is taken within a round
and the medians are reported: on a shared VM the speed drifts by 10-20 % over minutes.
With several --workers values (e.g. 1,2), each cell of the largest is also divided by the
same cell of the smallest, round by round (issue 32: 2 workers >= 1.6x one at 20 lines x
32, a lone 1-line request no slower).

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
import statistics
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


def translate_file(checkpoint: Path, lines: list[str], threads: int, workers: int = 1,
                   buffer_size: int | None = None) -> float:
    """`nmt translate --stats` sentences/s on `lines` (its translation time) with `workers`
    processes of `threads` threads; with `buffer_size`, only that many lines are read
    ahead, sorted and batched at a time: the engine with as many sentences in flight as a
    server load that keeps that many."""
    extra = ["--buffer-size", str(buffer_size)] if buffer_size else []
    done = subprocess.run([sys.executable, "-m", "nmt.cli.main", "translate", "-m", str(checkpoint),
                           "--stats", "--workers", str(workers), "--threads-per-worker",
                           str(threads), *extra], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=True)
    summary = [line for line in done.stderr.splitlines() if "sentences/s" in line][-1]
    return float(summary.split("sentences/s")[0].split(":")[-1].strip().split()[-1])


def per_line_ms(checkpoint: Path, lines: list[str], threads: int, workers: int = 1) -> float:
    """Median time of translating one line alone through the Python API (with `workers`
    processes of `threads` threads)."""
    code = ("import json,sys,time,torch\n"
            f"torch.set_num_threads({threads})\n"
            "from nmt import Translator\n"
            f"t = Translator.load({str(checkpoint)!r}, quiet=True, workers={workers}, "
            f"threads={threads})\n"
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
    """The CPU's model name and its vector flags that matter here (lscpu), for every figure
    (bench/translate_speed.py names its CPU with it too)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("Model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("Flags")), [])
    vector = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                          "amx_int8") if f in flags]
    return f"{model} ({', '.join(vector)})"


def in_flight_of(cell: dict) -> int:
    """Sentences a cell keeps in flight: each client waits for its answer."""
    return cell["lines"] * cell["concurrency"]


def start_server(opts: argparse.Namespace, lines: list[str], workers: int
                 ) -> tuple[subprocess.Popen, str]:
    """`nmt serve` on a free loopback port, ready and warmed up by one request."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "nmt.cli.main", "serve", "-m", f"en-de={opts.checkpoint}",
         "--port", str(port), "--threads", str(opts.threads), "--workers", str(workers),
         "--max-lines", "64"],
        cwd=REPO, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            break
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"nmt serve exited with {server.returncode}") from None
            time.sleep(0.2)
    post(url, lines[:20])  # warm-up
    return server, url


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    server.wait(120)


def run_round(opts: argparse.Namespace, lines: list[str], workers: int) -> dict[str, object]:
    """A fresh server through every cell, then, with the server stopped, the baselines
    (measured on this VM: a live server holding the memory of large batches, about 3 GB,
    slowed `nmt translate` beside it from about 190 to 135 sentences/s, and so did a plain
    process holding 2.6 GB): the file through `nmt translate`, `nmt translate` with each
    concurrency-32 cell's sentences in flight as its buffer, and one line alone through
    the Python API. The last cell repeats the first (1 line alone) after the load."""
    cells = []
    server, url = start_server(opts, lines, workers)
    try:
        for size, concurrency in [(1, 1), (1, 8), (1, 32), (20, 1), (20, 8), (20, 32), (1, 1)]:
            # At least 5 rounds of the clients: one round at concurrency 32 is a batch or
            # two, too few to measure.
            requests = opts.requests or max(200 if size == 1 else 40, 5 * concurrency)
            if opts.smoke:
                requests = concurrency
            cell = load_cell(url, lines, size, concurrency, requests)
            if cells and (size, concurrency) == (1, 1):
                cell["after_load"] = True
            cells.append(cell)
            print(f"{size:>2} lines x {concurrency:>2} concurrent: "
                  f"{cell['sentences_per_s']:7.1f} sentences/s, p50 {cell['p50_ms']:7.1f} "
                  f"ms, p95 {cell['p95_ms']:7.1f} ms, p99 {cell['p99_ms']:7.1f} ms"
                  + (" (again, after the load)" if cell.get("after_load") else ""),
                  flush=True)
    finally:
        stop_server(server)
    sample = lines[:100] if opts.smoke else lines
    file_rate = translate_file(opts.checkpoint, sample, opts.threads, workers)
    in_flight = {in_flight_of(c): translate_file(opts.checkpoint, sample, opts.threads,
                                                 workers, buffer_size=in_flight_of(c))
                 for c in cells if c["concurrency"] == 32}
    alone_ms = per_line_ms(opts.checkpoint, lines[:20 if opts.smoke else 200], opts.threads,
                           workers)
    print(f"nmt translate: file {file_rate:.1f} sentences/s; "
          + "; ".join(f"--buffer-size {n}: {rate:.1f}/s" for n, rate in in_flight.items())
          + f"; one line alone: {alone_ms:.1f} ms (median)", flush=True)
    return {"cells": cells, "translate_file_sentences_per_s": file_rate,
            "translate_in_flight_sentences_per_s": in_flight, "one_line_alone_ms": alone_ms}


def summarise(rounds: list[dict]) -> dict[str, object]:
    """Each cell's median over the rounds, and the targets, each ratio taken within a
    round (against that round's baselines) and then its median: this VM's speed drifts by
    10-20 % over minutes, more than the effects measured."""
    cells = []
    for i, first in enumerate(rounds[0]["cells"]):
        runs = [r["cells"][i] for r in rounds]
        cells.append({**{k: first[k] for k in ("lines", "concurrency", "requests")},
                      "after_load": bool(first.get("after_load")),
                      **{k: statistics.median([c[k] for c in runs])
                         for k in ("sentences_per_s", "p50_ms", "p95_ms", "p99_ms")}})
    ratios: dict[str, list[float]] = {}
    for r in rounds:
        for c in r["cells"]:
            if c["concurrency"] != 32:
                continue
            name = f"{c['lines']}x32"
            in_flight = r["translate_in_flight_sentences_per_s"][in_flight_of(c)]
            ratios.setdefault(f"{name}_vs_file", []).append(
                c["sentences_per_s"] / r["translate_file_sentences_per_s"])
            ratios.setdefault(f"{name}_vs_same_in_flight", []).append(
                c["sentences_per_s"] / in_flight)
            ratios.setdefault(f"translate_{in_flight_of(c)}_in_flight_vs_file", []).append(
                in_flight / r["translate_file_sentences_per_s"])
        one, again = (c for c in r["cells"] if c["lines"] == 1 and c["concurrency"] == 1)
        ratios.setdefault("c1_p50_minus_alone_ms", []).append(
            one["p50_ms"] - r["one_line_alone_ms"])
        ratios.setdefault("c1_after_load_p50_minus_alone_ms", []).append(
            again["p50_ms"] - r["one_line_alone_ms"])
    return {"cells": cells, "ratios": {k: statistics.median(v) for k, v in ratios.items()},
            "ratios_per_round": ratios,
            "translate_file_sentences_per_s": statistics.median(
                [r["translate_file_sentences_per_s"] for r in rounds]),
            "one_line_alone_ms": statistics.median([r["one_line_alone_ms"] for r in rounds])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per worker.")
    parser.add_argument("--workers", default="1",
                        help="Comma list of worker counts; each gets its own server per round "
                             "(e.g. 1,2: the second is compared with the first).")
    parser.add_argument("--requests", type=int, default=0,
                        help="Requests per cell (default: 200 of 1 line, 40 of 20 lines, "
                        "at least 5 per client).")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Times every cell and baseline is measured (medians kept).")
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rounds = 1
    lines = [line for line in TEST_EN.read_text(encoding="utf-8").split("\n") if line]
    counts = [int(w) for w in opts.workers.split(",")]
    rounds: dict[int, list[dict]] = {w: [] for w in counts}
    for index in range(opts.rounds):
        for workers in counts:  # interleaved: every count once per round
            print(f"round {index + 1} of {opts.rounds}, {workers} worker(s)", flush=True)
            rounds[workers].append(run_round(opts, lines, workers))
    report: dict[str, object] = {"bench": "serve_load", "cpu": cpu_name(),
                                 "threads": opts.threads, "checkpoint": str(opts.checkpoint)}
    for workers in counts:
        summary = summarise(rounds[workers])
        report[f"workers_{workers}"] = {"rounds": rounds[workers], **summary}
        print_summary(summary, workers, opts.rounds)
    if len(counts) > 1:
        report["scaling"] = scaling(rounds[counts[0]], rounds[counts[-1]], counts)
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({**report, "doctor": machine(measure=False)}))


def print_summary(summary: dict, workers: int, count: int) -> None:
    """The medians of one worker count's rounds and its targets against nmt translate."""
    ratios = summary["ratios"]
    print(f"{workers} worker(s), medians of {count} round(s):")
    for cell in summary["cells"]:
        print(f"{cell['lines']:>2} lines x {cell['concurrency']:>2} concurrent: "
              f"{cell['sentences_per_s']:7.1f} sentences/s, p50 {cell['p50_ms']:7.1f} ms, "
              f"p95 {cell['p95_ms']:7.1f} ms, p99 {cell['p99_ms']:7.1f} ms"
              + (" (again, after the load)" if cell["after_load"] else ""))
    print(f"nmt translate (file): {summary['translate_file_sentences_per_s']:.1f} "
          f"sentences/s; one line alone: {summary['one_line_alone_ms']:.1f} ms")
    for size in (1, 20):
        print(f"target 1, {size:>2} lines x 32: {ratios[f'{size}x32_vs_file']:.0%} of nmt "
              f"translate's file (goal >= 80 %); {ratios[f'{size}x32_vs_same_in_flight']:.0%}"
              f" of nmt translate --buffer-size {size * 32}, which itself gives "
              f"{ratios[f'translate_{size * 32}_in_flight_vs_file']:.0%} of the file")
    extra = ratios["c1_p50_minus_alone_ms"]
    print(f"target 2: a lone 1-line request's p50 is {extra:+.1f} ms over its translate time "
          f"(goal <= +15 ms: {'met' if extra <= 15 else 'missed'}); after the load "
          f"{ratios['c1_after_load_p50_minus_alone_ms']:+.1f} ms")


def scaling(few: list[dict], many: list[dict], counts: list[int]) -> dict[str, float]:
    """Each cell of the largest worker count over the same cell of the smallest, taken
    round by round, medians: sentences/s (higher is better) and p50 (lower is better)."""
    out: dict[str, float] = {}
    for i, cell in enumerate(few[0]["cells"]):
        name = f"{cell['lines']}x{cell['concurrency']}" + (
            "_again" if cell.get("after_load") else "")
        out[f"{name}_sentences_ratio"] = statistics.median(
            m["cells"][i]["sentences_per_s"] / f["cells"][i]["sentences_per_s"]
            for f, m in zip(few, many, strict=True))
        out[f"{name}_p50_ratio"] = statistics.median(
            m["cells"][i]["p50_ms"] / f["cells"][i]["p50_ms"]
            for f, m in zip(few, many, strict=True))
    print(f"{counts[-1]} workers / {counts[0]}: 20 lines x 32 "
          f"{out['20x32_sentences_ratio']:.2f}x sentences/s (goal >= 1.6x); a lone line's p50 "
          f"{out['1x1_p50_ratio']:.2f}x (goal <= 1.0x, within noise)")
    return out


if __name__ == "__main__":
    main()
