"""Quality of `nmt translate --precision int8` against fp32 (and bf16), same checkpoint.

Translates a test set at each precision (beam 4, alpha 0.6, max length source + 50, the
defaults of `nmt translate`) and reports sacreBLEU against the reference, the BLEU of each
output against the fp32 output, and the share of lines identical to fp32. Sets: Multi30k
test2016 and WMT14 newstest2014 (3,003 lines of news: out of domain for a Multi30k model,
which translates it badly, but int8 and fp32 are still compared on newstest-sized input).
Run: .venv/bin/python bench/int8_quality.py --checkpoint RUN/average.pt [--sets test2016]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import sacrebleu
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt.config import DecodeConfig  # noqa: E402
from nmt.inference.translate import Engine, translate_stream  # noqa: E402

DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))
SETS = {"test2016": ("multi30k/test_2016_flickr.en", "multi30k/test_2016_flickr.de"),
        "newstest2014": ("wmt14/newstest2014.en", "wmt14/newstest2014.de")}


def translate(checkpoint: Path, precision: str, lines: list[str]) -> tuple[list[str], float]:
    """Outputs of `nmt translate`'s pipeline and process CPU seconds."""
    translator = Engine.load([checkpoint], DecodeConfig(buffer_size=len(lines)),
                                 device="cpu", precision=precision)
    sink = io.BytesIO()
    cpu = time.process_time()
    translate_stream(io.BytesIO(("\n".join(lines) + "\n").encode()), sink, translator)
    return sink.getvalue().decode("utf-8").split("\n")[:-1], time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--sets", default="test2016,newstest2014")
    parser.add_argument("--precisions", default="fp32,int8,bf16")
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    result: dict[str, object] = {"bench": "int8_quality", "checkpoint": str(opts.checkpoint)}
    for name in opts.sets.split(","):
        src, ref = (DATA / part for part in SETS[name])
        lines = src.read_text(encoding="utf-8").split("\n")[:-1]
        refs = ref.read_text(encoding="utf-8").split("\n")[:-1]
        outputs = {}
        for precision in opts.precisions.split(","):
            hyps, cpu = translate(opts.checkpoint, precision, lines)
            outputs[precision] = hyps
            row = {"bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                   "cpu_seconds": round(cpu, 1)}
            if precision != "fp32" and "fp32" in outputs:
                base = outputs["fp32"]
                row["bleu_vs_fp32_output"] = round(
                    sacrebleu.corpus_bleu(hyps, [base]).score, 2)
                row["same_as_fp32"] = round(
                    sum(a == b for a, b in zip(hyps, base, strict=True)) / len(base), 3)
                row["delta_bleu"] = round(row["bleu"] - result[f"{name}_fp32"]["bleu"], 2)
            result[f"{name}_{precision}"] = row
            print(f"{name} {precision}: {row}", flush=True)
    result["load_average_1_5_15"] = list(os.getloadavg())
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({**result, "doctor": machine(measure=False)}))


if __name__ == "__main__":
    main()
