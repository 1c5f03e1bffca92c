"""The `nmt export hf` model in transformers next to `nmt translate`: BLEU and sentences/s
on Multi30k test2016 (1,000 lines), same weights, same threads, beam 4 each.

nmt runs as `nmt translate` does (its length penalty, GNMT's, alpha 0.6; max length
source + 50). transformers runs `pipeline("translation")` (transformers 4.x; with 5.x, which
removed the task, `model.generate`) with the exported generation config: num_beams 4,
length_penalty 0.6 (its length ** alpha), max_length 512; batches of --batch lines. The
export happens first (timed apart). Both are scored with sacreBLEU against
test_2016_flickr.de. Name the CPU beside the figures.
Run: .venv/bin/python bench/hf_compare.py --checkpoint runs/multi30k-en-de/average.pt
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "multi30k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="transformers' batch (lines)")
    parser.add_argument("--lines", type=int, default=1000)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    import transformers

    from nmt import Translator
    from nmt.inference.export.hf import export_hf
    from nmt.score import corpus_scores

    sources = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").split("\n")
    refs = (DATA / "test_2016_flickr.de").read_text(encoding="utf-8").split("\n")
    sources, refs = sources[:opts.lines], refs[:opts.lines]
    translator = Translator.load(opts.checkpoint, precision="fp32", quiet=True)
    translator.translate(sources[:20])  # warm-up
    start = time.perf_counter()
    ours = translator.translate(sources)
    nmt_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        export_hf(opts.checkpoint, Path(tmp) / "model")
        export_s = time.perf_counter() - start
        directory = str(Path(tmp) / "model")
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        removed = "translation" in getattr(transformers.pipelines, "REMOVED_TASKS", {})
        if removed:
            def run(batch: list[str]) -> list[str]:
                with torch.no_grad():
                    out = model.generate(**tokenizer(batch, return_tensors="pt",
                                                     padding=True))
                return tokenizer.batch_decode(out, skip_special_tokens=True)
        else:
            pipe = transformers.pipeline("translation", model=model, tokenizer=tokenizer,
                                         device="cpu")

            def run(batch: list[str]) -> list[str]:
                return [r["translation_text"] for r in pipe(batch, batch_size=len(batch))]
        run(sources[:20])  # warm-up
        start = time.perf_counter()
        theirs = [text for i in range(0, len(sources), opts.batch)
                  for text in run(sources[i:i + opts.batch])]
        hf_s = time.perf_counter() - start
    scores = {name: corpus_scores(hyps, refs)["bleu"] for name, hyps in
              (("nmt", ours), ("transformers", theirs))}
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"nmt translate:        BLEU {scores['nmt']:.2f}, "
          f"{len(sources) / nmt_s:.1f} sentences/s")
    print(f"transformers {transformers.__version__} "
          f"({'generate' if removed else 'pipeline'}): BLEU {scores['transformers']:.2f}, "
          f"{len(sources) / hf_s:.1f} sentences/s")
    print(f"identical outputs: {same}/{len(sources)}; export took {export_s:.1f} s")
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "hf_compare", "checkpoint": str(opts.checkpoint),
                      "threads": opts.threads, "lines": len(sources),
                      "transformers": transformers.__version__,
                      "nmt": {"bleu": scores["nmt"], "sentences_per_s": len(sources) / nmt_s},
                      "hf": {"bleu": scores["transformers"],
                             "sentences_per_s": len(sources) / hf_s,
                             "runner": "generate" if removed else "pipeline"},
                      "identical": same, "export_seconds": export_s}))


if __name__ == "__main__":
    main()
