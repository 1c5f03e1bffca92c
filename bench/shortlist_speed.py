"""Shortlist speed where the output layer dominates: a WMT-sized vocabulary.

`base` (6+6 layers, d_model 512) with 37,000 pieces and random weights; a shortlist table of
20 targets per source piece drawn Zipf-distributed over the vocabulary (real translation
tables concentrate on frequent pieces; a uniform draw would make a batch's candidates
nearly the whole vocabulary) plus the 100 most frequent; 64 sentences of 25 random pieces,
decoded for exactly 20 steps (min = max length: random weights end at random places), beam
4, one thread. Times `Engine.translate_ids` with and without the shortlist at each
precision, best of 2. What it shows is the speed of the mechanism at this vocabulary, not
a quality: the BLEU cost is measured on a trained model (docs/performance.md).
Run: .venv/bin/python bench/shortlist_speed.py [--precisions fp32,int8,bf16]. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt.config import DecodeConfig, model_preset  # noqa: E402
from nmt.data.shortlist import Shortlist  # noqa: E402
from nmt.inference.backends import prepare  # noqa: E402
from nmt.inference.translate import Engine  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="fp32,int8,bf16")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    vocab = opts.vocab
    zipf = 1.0 / np.arange(1, vocab - 3)
    zipf /= zipf.sum()
    table = (4 + rng.choice(vocab - 4, size=(vocab, 20), p=zipf)).astype(np.int32)
    shortlist = Shortlist(table, np.arange(4, 104, dtype=np.int32), vocab)
    sources = [rng.integers(4, vocab, size=25).tolist() for _ in range(opts.sentences)]
    candidates = len(shortlist.candidates(sources))
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=0, max_len_b=opts.steps,
                       min_len=opts.steps)
    rows: dict[str, dict[str, float]] = {}
    for precision in opts.precisions.split(","):
        torch.manual_seed(0)
        model = Transformer(model_preset("base", vocab_size=vocab)).eval()
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
        projection = prepare(model, precision)
        engine = Engine([model], vocab=None, cfg=cfg, device=torch.device("cpu"),
                            projections=[projection], precision=precision)
        for name, listed in (("full", None), ("shortlist", shortlist)):
            engine.shortlist = listed
            engine.translate_ids(sources[:8])  # warm-up
            best = min(_timed(engine, sources) for _ in range(2))
            rows.setdefault(precision, {})[name] = len(sources) / best
            print(f"{precision} {name}: {len(sources) / best:.1f} sentences/s", flush=True)
        ratio = rows[precision]["shortlist"] / rows[precision]["full"]
        print(f"{precision}: shortlist {ratio:.2f}x ({candidates} of {vocab} pieces scored)",
              flush=True)
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "shortlist_speed", "vocab": vocab, "arch": "base",
                      "candidates": candidates, "sentences": opts.sentences,
                      "steps": opts.steps, "sentences_per_s": rows}))


def _timed(engine: Engine, sources: list[list[int]]) -> float:
    start = time.perf_counter()
    engine.translate_ids(sources)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
