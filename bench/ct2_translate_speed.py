"""CTranslate2 side of bench/translate_speed.py; run with bench/.venv-ct2/bin/python.

Loads a model directory written by `nmt export ct2`, checks that its teacher-forced
per-token log-probs (`score_batch`) equal those nmt computed (passed in the request), then
times `translate_batch` over the same sentences with the same search settings: beam 4,
length penalty 0.6 (CTranslate2's is length ** alpha, nmt's GNMT's), at most max_len_b
pieces, at least 1, length-sorted batches of max-tokens padded source tokens (CTranslate2's
"tokens" batch type counts the same way). Each compute type asked for is timed after a
warm-up (and --passes - 1 untimed passes over all of them), in turn, best of --repeats;
wall and process CPU time. Ends with one JSON line.

Usage: python ct2_translate_speed.py REQUEST.json --threads 1 --compute-types float32,int8
[--device cuda] (bench/gpu_translate_speed.py runs it on the GPU)
(REQUEST.json: {"model_dir", "sources": [[piece, ...], ...], "check": {"sources",
"targets", "log_probs"}, "beam", "alpha", "max_len_b", "max_tokens"})
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    import ctranslate2

    parser = argparse.ArgumentParser()
    parser.add_argument("request")
    parser.add_argument("--threads", type=int, default=1)
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
    results: dict[str, dict] = {}
    for compute_type in opts.compute_types.split(","):
        translator = ctranslate2.Translator(req["model_dir"], device=opts.device,
                                            compute_type=compute_type,
                                            intra_threads=opts.threads, inter_threads=1)
        check = req["check"]
        scored = translator.score_batch(check["sources"], check["targets"])
        diff = max(abs(a - b) for got, want in zip(scored, check["log_probs"], strict=True)
                   for a, b in zip(got.log_probs, want, strict=True))

        def run(batch: list[list[str]], translator=translator) -> list:
            return translator.translate_batch(
                batch, beam_size=req["beam"], length_penalty=req["alpha"],
                max_decoding_length=req["max_len_b"], min_decoding_length=1,
                max_batch_size=req["max_tokens"], batch_type="tokens")

        run(sources[:20])  # warm-up
        for _ in range(opts.passes - 1):
            run(sources)
        best = None
        for _ in range(opts.repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = run(sources)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if best is None or seconds < best[0]:
                best = (seconds, cpu, out)
        seconds, cpu, out = best
        hyps = [r.hypotheses[0] for r in out]
        tokens = sum(len(h) + 1 for h in hyps)  # EOS included, as nmt counts
        results[compute_type] = {
            "system": "ctranslate2", "compute_type": compute_type,
            "version": ctranslate2.__version__, "sentences": len(sources),
            "tgt_tokens": tokens, "seconds": seconds, "sentences_per_s": len(sources) / seconds,
            "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
            "sentences_per_cpu_s": len(sources) / cpu, "tokens_per_cpu_s": tokens / cpu,
            "logp_max_abs_diff": diff, "hyps": hyps}
    print(json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
