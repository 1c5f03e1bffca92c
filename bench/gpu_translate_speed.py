"""Beam search speed on one GPU: `nmt translate`'s library path vs CTranslate2, same weights.

nmt: `Engine.load([checkpoint], cfg, device, precision)` + `translate_stream` (what
`nmt translate` runs) over newstest2014.en (3,003 lines, ../shared/data/wmt14), beam 4,
alpha 0.6, at each of --precisions (bf16, fp16, fp32 on CUDA), after a 20-line warm-up;
every line is in one read-ahead buffer, so batches are length-sorted over the whole test
set as CTranslate2 sorts them.
CTranslate2: the checkpoint exported with `nmt export ct2` (float32 weights, converted at
load to each --ct2-compute-types), run by bench/ct2_translate_speed.py with `--device` on
the same GPU, in bench/.venv-ct2 when present (else this interpreter, if it imports
ctranslate2; the `dev` extra installs it); its teacher-forced log-probs are checked
against nmt's first (`logp_max_abs_diff`). The same search limits on both sides: beam 4,
length penalty 0.6 (CTranslate2's is length ** alpha, nmt's GNMT's), at least 1 piece,
at most --max-len pieces (CTranslate2 takes an absolute cap only, so nmt uses
max_len_a 0, max_len_b --max-len), batches of --max-tokens padded source tokens.
CTranslate2's GPU wheels load CUDA 12 cuBLAS / cuDNN 9 at run time; when they are not
found its rows fail with the helper's message and the nmt rows still print.

Figures: sentences/s and target tokens/s (EOS included), sacreBLEU against
newstest2014.de (a faster setting that translates worse would show), and the ratio
CTranslate2 / nmt in sentences/s for each matching precision (float32~fp32,
bfloat16~bf16, float16~fp16): issue 14's target is at most 1.2.

    .venv/bin/python bench/gpu_translate_speed.py --checkpoint RUN/average.pt
    .venv/bin/python bench/gpu_translate_speed.py --random-arch base   # no trained model
    .venv/bin/python bench/gpu_translate_speed.py --smoke   # CPU: tiny random model, 20 lines
A trained checkpoint gives realistic output lengths (a Multi30k one from `make demo` works:
the comparison needs the same weights on both sides, not a good WMT model); a random one
babbles to --max-len on both sides, a long-output worst case.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from results import record  # noqa: E402  (bench/results/record.py)
from translate_speed import ct2_request  # noqa: E402  (bench/: the CPU comparison)

from nmt.checkpoint import model_payload, save_checkpoint  # noqa: E402
from nmt.config import DecodeConfig, max_tokens_for, model_preset  # noqa: E402
from nmt.data.vocab import Vocab, train_vocab  # noqa: E402
from nmt.inference.translate import Engine, translate_stream  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402
from nmt.score import corpus_scores  # noqa: E402

SHARED = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))
CT2_VENV_PY = REPO / "bench" / ".venv-ct2" / "bin" / "python"
CT2_HELPER = REPO / "bench" / "ct2_translate_speed.py"
# nmt precision -> the CTranslate2 compute type it is compared with
MATCHING = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def ct2_python() -> str | None:
    """The interpreter that runs CTranslate2: bench/.venv-ct2's, else this one if it has
    ctranslate2, else None."""
    if CT2_VENV_PY.exists():
        return str(CT2_VENV_PY)
    if importlib.util.find_spec("ctranslate2") is not None:
        return sys.executable
    return None


def random_checkpoint(cache: Path, arch: str, vocab_size: int, texts: list[Path]) -> Path:
    """A random-init (seed 0) model of preset `arch` with a `vocab_size`-piece vocabulary
    learnt from `texts`, cached in `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{arch}_random_v{vocab_size}.pt"
    if path.exists():
        return path
    spm = cache / f"spm{vocab_size}.model"
    vocab = train_vocab(texts, spm, vocab_size)
    cfg = model_preset(arch, vocab_size=len(vocab))
    torch.manual_seed(0)
    model = Transformer(cfg)
    save_checkpoint(model_payload(step=0, model_config=cfg.to_dict(), vocab=spm.read_bytes(),
                                  model=model.state_dict(),
                                  meta={"src_lang": "en", "tgt_lang": "de"}), path)
    return path



def time_nmt(checkpoint: Path, lines: list[str], refs: list[str], cfg: DecodeConfig,
             device: str, precision: str) -> dict:
    """sentences/s of `translate_stream` over `lines` at `precision`, after a warm-up."""
    translator = Engine.load([checkpoint], cfg, device=device, precision=precision)
    data = ("\n".join(lines) + "\n").encode("utf-8")
    warm = ("\n".join(lines[:20]) + "\n").encode("utf-8")
    translate_stream(io.BytesIO(warm), io.BytesIO(), translator)
    cuda = translator.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(translator.device)
        torch.cuda.reset_peak_memory_stats(translator.device)
    sink = io.BytesIO()
    start = time.perf_counter()
    stats = translate_stream(io.BytesIO(data), sink, translator)
    if cuda:
        torch.cuda.synchronize(translator.device)
    seconds = time.perf_counter() - start
    hyps = sink.getvalue().decode("utf-8").splitlines()
    row = {"system": "nmt", "precision": precision, "sentences": stats.sentences,
           "tgt_tokens": stats.tgt_tokens, "seconds": seconds,
           "sentences_per_s": stats.sentences / seconds,
           "tokens_per_s": stats.tgt_tokens / seconds,
           "bleu": corpus_scores(hyps, refs, digits=2)["bleu"]}
    if cuda:
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(translator.device) / 2 ** 30
    del translator
    return row


def time_ct2(python: str, request: Path, device: str, compute_types: list[str],
             vocab: Vocab, refs: list[str]) -> tuple[dict[str, dict], str | None]:
    """CTranslate2 rows from bench/ct2_translate_speed.py, or ({}, why not)."""
    proc = subprocess.run([python, str(CT2_HELPER), str(request), "--device", device,
                           "--compute-types", ",".join(compute_types)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {}, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
    # one configuration per compute type (the helper keys rows "float32@1x1/8192")
    rows = {row["compute_type"]: row
            for row in json.loads(proc.stdout.strip().splitlines()[-1]).values()}
    piece_id = {p: i for i, p in enumerate(vocab.pieces(range(len(vocab))))}
    for row in rows.values():
        hyps = vocab.decode([[piece_id[p] for p in h] for h in row.pop("hyps")])
        row["bleu"] = corpus_scores(hyps, refs, digits=2)["bleu"]
    return rows, None


def report(nmt_rows: dict[str, dict], ct2_rows: dict[str, dict], meta: dict) -> dict:
    """Print the table and ratios; return the JSON record."""
    print(f"{'system':<24}{'sent/s':>9}{'tok/s':>10}{'BLEU':>7}{'seconds':>9}")
    for name, row in [*((f"nmt {k}", v) for k, v in nmt_rows.items()),
                      *((f"ct2 {k}", v) for k, v in ct2_rows.items())]:
        print(f"{name:<24}{row['sentences_per_s']:>9.1f}{row['tokens_per_s']:>10.0f}"
              f"{row['bleu']:>7.2f}{row['seconds']:>9.2f}")
    ratios = {}
    for precision, compute_type in MATCHING.items():
        if precision in nmt_rows and compute_type in ct2_rows:
            ratio = (ct2_rows[compute_type]["sentences_per_s"]
                     / nmt_rows[precision]["sentences_per_s"])
            ratios[f"ct2_{compute_type}_over_nmt_{precision}"] = ratio
            print(f"CTranslate2 {compute_type} / nmt {precision}: {ratio:.2f}x sentences/s "
                  "(target <= 1.2)")
    if meta.get("ct2_skipped"):
        print(f"CTranslate2 rows skipped: {meta['ct2_skipped']}")
    return {"bench": "gpu_translate_speed", **meta, "nmt": nmt_rows, "ct2": ct2_rows,
            "ratios": ratios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="the model to time")
    parser.add_argument("--random-arch", choices=["tiny", "small", "base", "big"],
                        help="instead of --checkpoint: a random-init model of this preset "
                             "(vocabulary of --random-vocab pieces learnt from the source "
                             "and reference); its output mostly runs to --max-len")
    parser.add_argument("--random-vocab", type=int, default=8000)
    parser.add_argument("--source", type=Path, default=SHARED / "wmt14" / "newstest2014.en")
    parser.add_argument("--reference", type=Path,
                        default=SHARED / "wmt14" / "newstest2014.de")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--precisions", default="bf16,fp16,fp32")
    parser.add_argument("--ct2-compute-types", default="bfloat16,float16,float32")
    parser.add_argument("--skip-ct2", action="store_true")
    parser.add_argument("--lines", type=int, default=0, help="first N lines (0: all)")
    parser.add_argument("--max-len", type=int, default=256,
                        help="most target pieces per sentence, both systems")
    parser.add_argument("--max-tokens", type=int, default=max_tokens_for("cuda"),
                        help="padded source tokens per batch, both systems")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/nmt_bench_gpu_translate"))
    record.add_argument(parser, "gpu-translate")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, random-init tiny model, 20 lines, max-len 12, fp32")
    opt = parser.parse_args(argv)
    if opt.smoke:
        opt.device, opt.precisions, opt.ct2_compute_types = "cpu", "fp32", "float32"
        opt.lines, opt.max_len = 20, 12
        opt.checkpoint, opt.random_arch, opt.random_vocab = None, "tiny", 1000
        torch.set_num_threads(1)  # a shared CI machine: no OpenMP threads spinning
    elif (opt.checkpoint is None) == (opt.random_arch is None):
        parser.error("give one of --checkpoint and --random-arch (or --smoke)")
    return opt


def main() -> None:
    opt = parse_args()
    lines = opt.source.read_text(encoding="utf-8").splitlines()
    refs = opt.reference.read_text(encoding="utf-8").splitlines()
    if opt.lines:
        lines = lines[: opt.lines]
    checkpoint = opt.checkpoint or random_checkpoint(
        opt.cache, opt.random_arch, opt.random_vocab, [opt.source, opt.reference])
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=opt.max_len,
                       max_tokens=opt.max_tokens, buffer_size=len(lines))
    nmt_rows = {p: time_nmt(checkpoint, lines, refs, cfg, opt.device, p)
                for p in opt.precisions.split(",")}
    meta: dict = {"smoke": opt.smoke, "checkpoint": str(checkpoint),
                  "source": str(opt.source), "lines": len(lines), "beam": cfg.beam,
                  "alpha": cfg.alpha, "max_len": opt.max_len, "max_tokens": opt.max_tokens,
                  "device": (torch.cuda.get_device_name() if opt.device == "cuda" else "cpu"),
                  "torch": torch.__version__}
    ct2_rows: dict[str, dict] = {}
    python = None if opt.skip_ct2 else ct2_python()
    if opt.skip_ct2:
        meta["ct2_skipped"] = "--skip-ct2"
    elif python is None:
        meta["ct2_skipped"] = f"no {CT2_VENV_PY} and ctranslate2 is not importable here"
    else:
        request = ct2_request(checkpoint, lines, cfg, opt.cache)
        if request is None:
            meta["ct2_skipped"] = "export to CTranslate2 failed (see above)"
        else:
            from nmt.checkpoint import load_model

            vocab = load_model(checkpoint, "cpu")[1]
            ct2_rows, why = time_ct2(python, request, opt.device,
                                     opt.ct2_compute_types.split(","), vocab, refs)
            if why:
                meta["ct2_skipped"] = why
    from nmt.doctor import report as machine  # beside every figure
    doctor = machine(measure=False)
    print(json.dumps({**report(nmt_rows, ct2_rows, meta), "doctor": doctor}))
    record.write(records(nmt_rows, ct2_rows, meta, opt, doctor), opt.record)


def records(nmt_rows: dict[str, dict], ct2_rows: dict[str, dict], meta: dict,
            opt: argparse.Namespace, doctor: dict) -> list[dict]:
    """One gpu-translate record (bench/results/README.md) per nmt precision and
    CTranslate2 compute type."""
    run = record.run_id()
    model = str(opt.checkpoint) if opt.checkpoint else f"random {opt.random_arch}"
    found = []
    for system, rows in (("nmt", nmt_rows), ("ctranslate2", ct2_rows)):
        for precision, row in rows.items():
            settings = {"precision": precision, "model": model, "source": meta["source"],
                        "lines": meta["lines"], "beam": meta["beam"], "alpha": meta["alpha"],
                        "max_len": meta["max_len"], "max_tokens": meta["max_tokens"],
                        "device": meta["device"], "smoke": meta["smoke"]}
            figures = {"sentences_per_s": row["sentences_per_s"],
                       "tokens_per_s": row["tokens_per_s"], "bleu": row.get("bleu")}
            found.append(record.make("gpu-translate", system, settings, figures, doctor,
                                     run=run))
    return found


if __name__ == "__main__":
    main()
