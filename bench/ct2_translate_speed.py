"""CTranslate2 side of bench/translate_speed.py; run with bench/.venv-ct2/bin/python.

Loads a model directory written by `nmt export ct2`, checks that its teacher-forced
per-token log-probs (`score_batch`) equal those nmt computed (passed in the request), then
times `translate_batch` over the same sentences with the same search settings: beam 4,
length penalty 0.6 (CTranslate2's is length ** alpha, nmt's GNMT's), at most max_len_b
pieces, at least 1, length-sorted batches of max-tokens padded source tokens (CTranslate2's
"tokens" batch type counts the same way).

Every configuration of `--grid` is timed: INTERxINTRA is CTranslate2's `inter_threads`
(replicas sharing the weights, each translating its own batches: what its documentation
recommends for throughput) x `intra_threads` (OpenMP threads per batch), at each
`--batch-tokens` (CTranslate2's `max_batch_size` in tokens: with several replicas, smaller
batches balance them better), so the peer gets its best configuration for the machine, not
one we pick. Each compute type is timed after a warm-up (and --passes - 1 untimed passes),
best of --repeats; wall and process CPU time. Ends with one JSON line: a row per
compute type x configuration, keyed "float32@2x1/4096".

Usage: python ct2_translate_speed.py REQUEST.json --grid 1x1,2x1,1x2 --compute-types
float32,int8 [--batch-tokens 4096,1024] [--device cuda] (bench/gpu_translate_speed.py runs
it on the GPU with --threads)
(REQUEST.json: {"model_dir", "sources": [[piece, ...], ...], "check": {"sources",
"targets", "log_probs"}, "beam", "alpha", "max_len_b", "max_tokens"})
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def grid_of(text: str, threads: int) -> list[tuple[int, int]]:
    """(inter, intra) pairs from "2x1,1x2"; empty text: one replica of `threads` threads."""
    if not text:
        return [(1, threads)]
    pairs = []
    for item in text.split(","):
        inter, intra = item.lower().split("x")
        pairs.append((int(inter), int(intra)))
    return pairs


def main() -> None:
    import ctranslate2

    parser = argparse.ArgumentParser()
    parser.add_argument("request")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra_threads of one replica when --grid is not given.")
    parser.add_argument("--grid", default="", help="INTERxINTRA list, e.g. 1x1,2x1,1x2.")
    parser.add_argument("--batch-tokens", default="",
                        help="Comma list of max_batch_size values (tokens); default: the "
                             "request's max_tokens.")
    parser.add_argument("--compute-types", default="float32,int8")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--passes", type=int, default=1,
                        help="Untimed passes over all sentences before each timed one (the "
                             "steady state of a long input, as translate_speed's --passes).")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    opts = parser.parse_args()
    with open(opts.request, encoding="utf-8") as handle:
        req = json.load(handle)
    sources = req["sources"]
    sizes = ([int(s) for s in opts.batch_tokens.split(",")] if opts.batch_tokens
             else [req["max_tokens"]])
    results: dict[str, dict] = {}
    for compute_type in opts.compute_types.split(","):
        for inter, intra in grid_of(opts.grid, opts.threads):
            translator = ctranslate2.Translator(req["model_dir"], device=opts.device,
                                                compute_type=compute_type,
                                                intra_threads=intra, inter_threads=inter)
            check = req["check"]
            scored = translator.score_batch(check["sources"], check["targets"])
            diff = max(abs(a - b) for got, want in zip(scored, check["log_probs"], strict=True)
                       for a, b in zip(got.log_probs, want, strict=True))
            for size in sizes:
                def run(batch: list[list[str]], translator=translator, size=size) -> list:
                    return translator.translate_batch(
                        batch, beam_size=req["beam"], length_penalty=req["alpha"],
                        max_decoding_length=req["max_len_b"], min_decoding_length=1,
                        max_batch_size=size, batch_type="tokens")

                run(sources[:20])  # warm-up
                for _ in range(opts.passes - 1):
                    run(sources)
                best = None
                for _ in range(opts.repeats):
                    start, cpu_start = time.perf_counter(), time.process_time()
                    out = run(sources)
                    seconds = time.perf_counter() - start
                    cpu = time.process_time() - cpu_start
                    if best is None or seconds < best[0]:
                        best = (seconds, cpu, out)
                seconds, cpu, out = best
                hyps = [r.hypotheses[0] for r in out]
                tokens = sum(len(h) + 1 for h in hyps)  # EOS included, as nmt counts
                results[f"{compute_type}@{inter}x{intra}/{size}"] = {
                    "system": "ctranslate2", "compute_type": compute_type,
                    "inter_threads": inter, "intra_threads": intra, "batch_tokens": size,
                    "version": ctranslate2.__version__, "sentences": len(sources),
                    "tgt_tokens": tokens, "seconds": seconds,
                    "sentences_per_s": len(sources) / seconds,
                    "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
                    "sentences_per_cpu_s": len(sources) / cpu,
                    "tokens_per_cpu_s": tokens / cpu, "logp_max_abs_diff": diff,
                    "hyps": hyps}
                print(f"{compute_type} inter {inter} intra {intra} batch {size}: "
                      f"{len(sources) / seconds:.1f} sentences/s", file=sys.stderr)
            del translator
    print(json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
