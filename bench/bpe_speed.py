"""Speed and peak memory of `nmt bpe`'s encode+binarize on Multi30k train repeated to 1M lines.

Builds a DATA dir in a temp folder (train.src/.tgt = Multi30k train.en/.de repeated to
--lines lines each), trains the joint BPE model once (timed on its own), then binarizes
both sides with the same code `nmt bpe` runs, once per --threads value. Each phase runs
in a child process so its peak RSS (getrusage maxrss) is its own.

Units, explicitly: `sentences` = lines per side x 2 (every source and every target line is
one sentence to encode); `pairs` = lines per side. Wall-clock rates depend on what else
the machine runs (the load average is recorded); sentences per CPU second (user + system
time of the binarizing process, all threads) does not. Prints a table, then one JSON line.

    .venv/bin/python bench/bpe_speed.py [--lines 1000000] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data")) / "multi30k"


def _maxrss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child_train(data: Path, vocab_size: int, sample: int, threads: int) -> dict:
    from nmt.data.vocab import train_vocab

    start = time.perf_counter()
    train_vocab([data / "train.src", data / "train.tgt"], data / "spm.model", vocab_size,
                sample=sample, threads=threads)
    return {"seconds": time.perf_counter() - start}


def _child_binarize(data: Path, threads: int, chunk_lines: int) -> dict:
    from nmt.data.binarize import binarize_file
    from nmt.data.vocab import Vocab

    vocab = Vocab.from_file(data / "spm.model")
    (data / "bin").mkdir(exist_ok=True)
    baseline = _maxrss_mib(resource.RUSAGE_SELF)  # interpreter + imports (torch) + model
    cpu_start = _cpu_seconds()
    start = time.perf_counter()
    tokens = 0
    for side in ("src", "tgt"):
        stats = binarize_file(vocab, data / f"train.{side}", data / "bin" / f"train.{side}",
                              threads=threads, chunk_lines=chunk_lines)
        tokens += stats.tokens
    return {"seconds": time.perf_counter() - start, "lines_per_side": stats.lines,
            "tokens": tokens, "baseline_rss_mib": baseline,
            "cpu_seconds": _cpu_seconds() - cpu_start}


def _run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                         capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _make_corpus(data: Path, lines: int) -> None:
    for side, lang in (("src", "en"), ("tgt", "de")):
        base = (MULTI30K / f"train.{lang}").read_text(encoding="utf-8").split("\n")[:-1]
        with open(data / f"train.{side}", "w", encoding="utf-8") as handle:
            written = 0
            while written < lines:
                block = base[: lines - written]
                handle.write("\n".join(block) + "\n")
                written += len(block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines per side")
    parser.add_argument("--threads", default=f"1,{os.cpu_count()}",
                        help="comma-separated thread counts for binarize")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--sample", type=int, default=2_000_000)
    parser.add_argument("--chunk-lines", type=int, default=None)
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:  # child process: one phase, prints its own JSON result
        phase, data = args.child[0], Path(args.child[1])
        if phase == "train":
            result = _child_train(data, int(args.child[2]), int(args.child[3]),
                                  int(args.child[4]))
        else:
            result = _child_binarize(data, int(args.child[2]), int(args.child[3]))
        result["peak_rss_mib"] = _maxrss_mib(resource.RUSAGE_SELF)
        print(json.dumps(result))
        return

    from nmt.data.binarize import CHUNK_LINES

    chunk = args.chunk_lines or CHUNK_LINES
    if not (MULTI30K / "train.en").is_file():
        sys.exit(f"bench: Multi30k not found at {MULTI30K} (set NMT_SHARED_DATA)")
    threads_list = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory(prefix="nmt-bpe-bench-") as tmp:
        data = Path(tmp)
        _make_corpus(data, args.lines)
        cores = max(threads_list)
        train = _run_child(["train", str(data), str(args.vocab_size), str(args.sample),
                            str(cores)])
        print(f"train BPE ({args.vocab_size} pieces, sample {args.sample} of "
              f"{2 * args.lines} lines, {cores} threads): {train['seconds']:.1f} s, "
              f"peak RSS {train['peak_rss_mib']:.0f} MiB")
        runs = []
        for threads in threads_list:
            result = _run_child(["binarize", str(data), str(threads), str(chunk)])
            pairs = result["lines_per_side"]
            result.update(threads=threads, pairs_per_s=pairs / result["seconds"],
                          sentences_per_s=2 * pairs / result["seconds"],
                          tokens_per_s=result["tokens"] / result["seconds"],
                          sentences_per_cpu_s=2 * pairs / result["cpu_seconds"])
            runs.append(result)
            print(f"encode+binarize, {threads} thread(s): {result['seconds']:.1f} s for "
                  f"{pairs} pairs = {2 * pairs} sentences -> "
                  f"{result['sentences_per_s']:,.0f} sentences/s "
                  f"({result['pairs_per_s']:,.0f} pairs/s, "
                  f"{result['tokens_per_s'] / 1e6:.2f}M tokens/s), "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB "
                  f"({result['baseline_rss_mib']:.0f} MiB before encoding); "
                  f"{result['cpu_seconds']:.1f} CPU s = "
                  f"{result['sentences_per_cpu_s']:,.0f} sentences per CPU second")
    best = max(runs, key=lambda r: r["sentences_per_s"])
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({
        "doctor": machine(measure=False),
        "bench": "bpe_speed", "lines_per_side": args.lines, "sentences": 2 * args.lines,
        "sentences_definition": "lines per side x 2 (source and target)",
        "chunk_lines": chunk, "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "train_seconds": round(train["seconds"], 2),
        "train_peak_rss_mib": round(train["peak_rss_mib"], 1),
        "runs": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
                 for r in runs],
        "best_sentences_per_s": round(best["sentences_per_s"]),
        "best_pairs_per_s": round(best["pairs_per_s"]),
        "binarize_peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs), 1),
        "binarize_rss_growth_mib": round(max(r["peak_rss_mib"] - r["baseline_rss_mib"]
                                             for r in runs), 1),
        "peak_rss_children_mib": round(_maxrss_mib(resource.RUSAGE_CHILDREN), 1),
        "target_sentences_per_s": 50000,
        "meets_target": best["sentences_per_s"] >= 50000,
    }))


if __name__ == "__main__":
    main()
