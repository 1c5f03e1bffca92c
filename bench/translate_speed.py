"""Translation speed: `nmt translate` vs CTranslate2 and fairseq, same weights, CPU, beam 4.

Rows: nmt fp32, `auto`, `int8` (nmt/inference/int8_linear.py) and fp32 unpacked; CTranslate2 float32
and int8 (the checkpoint exported with `nmt export ct2`, run by bench/ct2_translate_speed.py
in bench/.venv-ct2, its `score_batch` log-probs checked against nmt's first); fairseq (below).
A peer whose virtual environment is absent is skipped with a note. `--repeats N` runs every
system once per round, interleaved, and keeps each one's fastest round (wall and CPU time):
on a shared machine compare sentences per CPU-second. `--smoke`: 40 sentences, nmt only.

Measures sentences/s and target tokens/s (EOS included) over the 1,000 Multi30k test
sentences (test_2016_flickr.en) with beam 4, length penalty 0.6, max length 0*src + 50,
length-sorted batches of --max-tokens source tokens on both sides.

The model is --checkpoint if given (a trained one gives realistic output lengths),
otherwise the `small` shape (3+3 layers, d_model 256) with random init, seed 0, and a
Multi30k sentencepiece vocabulary (8,000 pieces) trained here. Random-init outputs mostly
run to the maximum length: a worst case for both systems, not a realistic mix.

fairseq parity: our state dict is converted to fairseq's TransformerModel names (fused QKV
split into q/k/v_proj). fairseq's sinusoids differ from the paper's (sin|cos halves,
positions offset by padding_idx + 1), so the fairseq model uses *learned* positions whose
table is filled with our sinusoids at the right offset; its dictionary order differs
(<s> <pad> </s> <unk>), so embedding rows are permuted; fairseq starts decoding with </s>,
so its (untied) decoder input embedding row of </s> holds our BOS embedding, and the output
projection is untied too. The helper checks the teacher-forced log-probs agree. Note that
fairseq's length penalty is |Y|^alpha (ours GNMT's ((5+|Y|)/6)^alpha) and its stopping
rule differs (it waits for `beam` finished hypotheses), so outputs may differ slightly.

Precision: nmt is timed at fp32 (like for like) and at its default `--precision auto` (bf16
weights where the CPU computes bf16 natively, e.g. AVX512-BF16; else fp32 again), both with its
linears packed for oneDNN (nmt/inference/packed_linear.py, what `nmt translate` does on a CPU),
and once more at fp32 with packing off (NMT_PACKED_LINEAR=0: torch's default MKL path, the one
fairseq runs on) to show what the packing contributes. fairseq runs fp32, its fastest mode on a
CPU: measured here (Multi30k test, 1 thread), `fairseq-generate --cpu --bf16` leaves the model
in fp32 (same output, same time, 27.6 s vs 29.0 s) and `--fp16` is 2.9x slower (82.9 s). The
target line compares the defaults.

Quality check: every system's output is scored (sacreBLEU, detokenized, against
test_2016_flickr.de), so a faster setting that translates worse would show.

Both sides run one after the other with --threads each and report wall time AND process
CPU time: on a machine shared with other work, wall time measures the load more than the
code, so the CPU-time ratio is the fairer comparison (the JSON also records the load
average at the end).

Trained-model setup (realistic output lengths, ~13 pieces per sentence): the model
`make demo` leaves (15 minutes of training on Multi30k, 5 checkpoints averaged), then
  .venv/bin/python bench/translate_speed.py --checkpoint runs/multi30k-en-de/average.pt
A barely trained model (say 88 updates) mostly babbles to its length limit (~42 pieces per
sentence): a long-output case that weights the per-token matmuls over per-step overheads.
Run: .venv/bin/python bench/translate_speed.py [--checkpoint RUN/checkpoint_last.pt]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
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

from loss_speed import status_bytes  # noqa: E402  (bench/: /proc/self/status fields)

from nmt.checkpoint import load_model, model_payload, save_checkpoint  # noqa: E402
from nmt.config import DecodeConfig, model_preset  # noqa: E402
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab  # noqa: E402
from nmt.errors import UsageError  # noqa: E402
from nmt.inference import packed_linear  # noqa: E402
from nmt.inference.translate import Translator, translate_stream  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402
from nmt.precision import resolve_precision  # noqa: E402
from nmt.score import corpus_scores  # noqa: E402

DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data")) / "multi30k"
FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
CT2_PY = REPO / "bench" / ".venv-ct2" / "bin" / "python"
# fairseq index -> our index: <s> <pad> </s> <unk> then the same pieces.
SPECIALS = [BOS_ID, PAD_ID, EOS_ID, UNK_ID]


def build_model(cache: Path, vocab_size: int, seed: int) -> Path:
    """Random-init `small` model with a Multi30k vocabulary, cached."""
    cache.mkdir(parents=True, exist_ok=True)
    spm = cache / f"spm{vocab_size}.model"
    if not spm.exists():
        train_vocab([DATA / "train.en", DATA / "train.de"], spm, vocab_size, threads=2)
    path = cache / f"small_seed{seed}_v{vocab_size}.pt"
    if not path.exists():
        proto = spm.read_bytes()
        cfg = model_preset("small", vocab_size=len(Vocab(proto)))
        torch.manual_seed(seed)
        model = Transformer(cfg)
        save_checkpoint(model_payload(step=0, model_config=cfg.to_dict(), vocab=proto,
                                      model=model.state_dict(),
                                      meta={"src_lang": "en", "tgt_lang": "de"}), path)
    return path


def to_fairseq(model: Transformer) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Our state dict under fairseq TransformerModel names (see module docstring)."""
    cfg = model.cfg
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fair_to_ours = SPECIALS + list(range(4, cfg.vocab_size))
    emb = sd["embed.weight"][fair_to_ours]  # (V, D) in fairseq order
    dec_in = emb.clone()
    dec_in[2] = sd["embed.weight"][BOS_ID]  # fairseq feeds </s> where we feed BOS
    d = cfg.d_model
    table = model.enc_positions.table  # (max_positions, D) paper sinusoids
    pos = torch.zeros(cfg.max_positions + 2, d)
    pos[2:] = table  # fairseq position of token i is padding_idx + 1 + i
    out = {"encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": dec_in,
           "decoder.output_projection.weight": emb.clone(),
           "encoder.embed_positions.weight": pos, "decoder.embed_positions.weight": pos.clone()}

    def split(prefix: str, src: str, names: tuple[str, ...]) -> None:
        for kind in ("weight", "bias"):
            for name, chunk in zip(names, sd[f"{src}.{kind}"].split(d, dim=0), strict=True):
                out[f"{prefix}.{name}.{kind}"] = chunk.clone()

    def copy(dst: str, src: str) -> None:
        for kind in ("weight", "bias"):
            out[f"{dst}.{kind}"] = sd[f"{src}.{kind}"]

    for i in range(cfg.encoder_layers):
        f, o = f"encoder.layers.{i}", f"encoder.{i}"
        split(f"{f}.self_attn", f"{o}.self_attn.qkv", ("q_proj", "k_proj", "v_proj"))
        copy(f"{f}.self_attn.out_proj", f"{o}.self_attn.out")
        copy(f"{f}.self_attn_layer_norm", f"{o}.res_attn.norm")
        copy(f"{f}.fc1", f"{o}.ffn.fc1")
        copy(f"{f}.fc2", f"{o}.ffn.fc2")
        copy(f"{f}.final_layer_norm", f"{o}.res_ffn.norm")
    for i in range(cfg.decoder_layers):
        f, o = f"decoder.layers.{i}", f"decoder.{i}"
        split(f"{f}.self_attn", f"{o}.self_attn.qkv", ("q_proj", "k_proj", "v_proj"))
        copy(f"{f}.self_attn.out_proj", f"{o}.self_attn.out")
        copy(f"{f}.self_attn_layer_norm", f"{o}.res_self.norm")
        copy(f"{f}.encoder_attn.q_proj", f"{o}.cross_attn.q")
        split(f"{f}.encoder_attn", f"{o}.cross_attn.kv", ("k_proj", "v_proj"))
        copy(f"{f}.encoder_attn.out_proj", f"{o}.cross_attn.out")
        copy(f"{f}.encoder_attn_layer_norm", f"{o}.res_cross.norm")
        copy(f"{f}.fc1", f"{o}.ffn.fc1")
        copy(f"{f}.fc2", f"{o}.ffn.fc2")
        copy(f"{f}.final_layer_norm", f"{o}.res_ffn.norm")
    return out, fair_to_ours


def export_for_fairseq(model: Transformer, vocab: Vocab, lines: list[str], cfg: DecodeConfig,
                       path: Path) -> None:
    """Weights, sources in fairseq ids, search settings and a parity check batch."""
    state, fair_to_ours = to_fairseq(model)
    ours_to_fair = [0] * len(fair_to_ours)
    for f, o in enumerate(fair_to_ours):
        ours_to_fair[o] = f
    ids = [ids[: model.cfg.max_positions - 1] for ids in vocab.encode(lines)]
    sources = [[ours_to_fair[i] for i in (*s, EOS_ID)] for s in ids if s]
    check_ids = ids[:8]
    src = torch.full((8, max(map(len, check_ids)) + 1), PAD_ID)
    for r, s in enumerate(check_ids):
        src[r, : len(s) + 1] = torch.tensor([*s, EOS_ID])
    tgt = [ids[8 + r][:10] for r in range(8)]  # any target prefix of 10 pieces
    tgt_in = torch.tensor([[BOS_ID, *t, *[4] * (10 - len(t))] for t in tgt])  # (8, 11)
    with torch.no_grad():
        logp = torch.log_softmax(model(src, tgt_in).float(), -1)  # (8, 11, V) our order
    prev = [[2, *(ours_to_fair[i] for i in row[1:])] for row in tgt_in.tolist()]
    check = {"src": [[ours_to_fair[i] for i in (*s, EOS_ID)] for s in check_ids],
             "prev": prev, "logp": logp.tolist()}
    torch.save({"config": model.cfg.to_dict(), "state": state, "sources": sources,
                "ours_to_fair": ours_to_fair, "check": check,
                "search": {"beam": cfg.beam, "lenpen": cfg.alpha, "max_len_a": cfg.max_len_a,
                           "max_len_b": cfg.max_len_b, "max_tokens": cfg.max_tokens}}, path)



def time_ours(checkpoint: Path, lines: list[str], refs: list[str], cfg: DecodeConfig,
              precision: str, packed: bool = True, passes: int = 1) -> dict[str, object]:
    """`nmt translate`'s stream path over `lines` at `precision` (after a 20-line warm-up),
    with the linears packed for oneDNN or (packed=False) on torch's default path.

    With `passes` > 1 one translator goes over `lines` that many times and the last pass
    is timed: the steady state of a long input (many batches), where memory carried from
    batch to batch shows. `rss_growth_mb` is the resident memory added between the end of
    the first pass and the end of the last: about 0 unless something accumulates."""
    os.environ["NMT_PACKED_LINEAR"] = "1" if packed else "0"
    packed_linear.available.cache_clear()
    translator = Translator.load([checkpoint], cfg, device="cpu", precision=precision)
    data = ("\n".join(lines) + "\n").encode()
    translate_stream(io.BytesIO(("\n".join(lines[:20]) + "\n").encode()), io.BytesIO(),
                     translator)  # warm-up
    rss_first = None
    for _ in range(passes - 1):
        translate_stream(io.BytesIO(data), io.BytesIO(), translator)
        rss_first = status_bytes("VmRSS") / 2 ** 20 if rss_first is None else rss_first
    sink = io.BytesIO()
    start, cpu_start = time.perf_counter(), time.process_time()
    stats = translate_stream(io.BytesIO(data), sink, translator)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    rss_end = status_bytes("VmRSS") / 2 ** 20  # resident MiB (Linux /proc)
    hyps = sink.getvalue().decode("utf-8").splitlines()
    os.environ.pop("NMT_PACKED_LINEAR")
    packed_linear.available.cache_clear()
    return {"system": "nmt", "precision": precision, "packed_linears": packed,
            "bleu": corpus_scores(hyps, refs, digits=2)["bleu"], "hyps": hyps,
            "resolved_precision": resolve_precision(precision, torch.device("cpu")),
            "sentences": stats.sentences, "tgt_tokens": stats.tgt_tokens,
            "seconds": seconds, "sentences_per_s": stats.sentences / seconds,
            "tokens_per_s": stats.tgt_tokens / seconds, "cpu_seconds": cpu,
            "sentences_per_cpu_s": stats.sentences / cpu,
            "tokens_per_cpu_s": stats.tgt_tokens / cpu, "passes": passes, "rss_mb": rss_end,
            "rss_growth_mb": None if rss_first is None else rss_end - rss_first}



def ct2_request(checkpoint: Path, lines: list[str], cfg: DecodeConfig, cache: Path
                ) -> Path | None:
    """Export `checkpoint` with `nmt export ct2` (float32 weights; CTranslate2 quantizes
    at load time for int8) and write the helper's request: sources as pieces, search
    settings, and a parity batch with nmt's teacher-forced per-token log-probs."""
    try:
        from nmt.inference.export.ct2 import export_ct2
    except ImportError:
        return None
    model_dir = cache / "ct2_model"
    try:
        export_ct2(checkpoint, model_dir, force=True)
    except UsageError as err:  # ctranslate2 missing in this venv
        print(f"ctranslate2 rows skipped: {err}", file=sys.stderr)
        return None
    model, vocab, _ = load_model(checkpoint, "cpu")
    ids = [s[: model.cfg.max_positions - 1] for s in vocab.encode(lines)]
    src, tgt = ids[:8], [ids[8 + r][:10] for r in range(8)]  # any targets do for parity
    log_probs = []
    with torch.no_grad():
        for s, t in zip(src, tgt, strict=True):
            lp = torch.log_softmax(model(torch.tensor([[*s, EOS_ID]]),
                                         torch.tensor([[BOS_ID, *t]])).float(), -1)[0]
            log_probs.append(lp.gather(1, torch.tensor([*t, EOS_ID])[:, None])[:, 0].tolist())
    request = {"model_dir": str(model_dir), "sources": [vocab.pieces(s) for s in ids],
               "check": {"sources": [vocab.pieces(s) for s in src],
                         "targets": [vocab.pieces(t) for t in tgt], "log_probs": log_probs},
               "beam": cfg.beam, "alpha": cfg.alpha, "max_len_b": cfg.max_len_b,
               "max_tokens": cfg.max_tokens}
    path = cache / "ct2_request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    return path


def time_ct2(request: Path, threads: int, vocab: Vocab, refs: list[str], passes: int = 1
             ) -> dict[str, dict]:
    """CTranslate2 float32 and int8 rows from the helper in bench/.venv-ct2 (the same
    warm-up and `passes` as nmt's rows)."""
    proc = subprocess.run([str(CT2_PY), str(REPO / "bench" / "ct2_translate_speed.py"),
                           str(request), "--threads", str(threads), "--passes", str(passes)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"CTranslate2 side failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    piece_id = {p: i for i, p in enumerate(vocab.pieces(range(len(vocab))))}
    for row in rows.values():
        row["hyps"] = vocab.decode([[piece_id[p] for p in h] for h in row["hyps"]])
        row["bleu"] = corpus_scores(row["hyps"], refs, digits=2)["bleu"]
    return rows


def time_fairseq(checkpoint: Path, lines: list[str], cfg: DecodeConfig, cache: Path,
                 threads: int, refs: list[str]) -> dict[str, object]:
    """The fairseq row from the helper in bench/.venv-fairseq."""
    model, vocab, _ = load_model(checkpoint, "cpu")
    export = cache / "fairseq_export.pt"
    export_for_fairseq(model, vocab, lines, cfg, export)
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    proc = subprocess.run([str(FAIRSEQ_PY), str(REPO / "bench" / "fairseq_translate_speed.py"),
                           str(export), "--threads", str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"fairseq side failed:\n{proc.stderr[-3000:]}")
    fair = json.loads(proc.stdout.strip().splitlines()[-1])
    fair["hyps"] = vocab.decode(fair.pop("hyps"))
    fair["bleu"] = corpus_scores(fair["hyps"], refs, digits=2)["bleu"]
    return fair


def keep_best(best: dict[str, dict], name: str, row: dict) -> None:
    """Keep the faster (wall time) of two timings of one system; CPU time is kept as the
    minimum over repeats too."""
    old = best.get(name)
    if old is None:
        best[name] = row
        return
    cpu = min(old["cpu_seconds"], row["cpu_seconds"])
    if row["seconds"] < old["seconds"]:
        best[name] = row
    keep = best[name]
    keep["cpu_seconds"] = cpu
    keep["sentences_per_cpu_s"] = keep["sentences"] / cpu
    keep["tokens_per_cpu_s"] = keep["tgt_tokens"] / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/nmt_bench_translate"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="Rounds; every system once per round (interleaved), best kept.")
    parser.add_argument("--passes", type=int, default=1,
                        help="Passes over the input by one translator (nmt and CTranslate2), "
                             "the last timed: the steady state of a long input; >1 also "
                             "reports nmt's resident-memory growth.")
    parser.add_argument("--systems", default="fp32,auto,int8,fp32_unpacked,ct2,fairseq",
                        help="Comma list among fp32, auto, int8, fp32_unpacked, ct2, fairseq.")
    parser.add_argument("--skip-fairseq", action="store_true")
    parser.add_argument("--skip-ct2", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="Cheap check: 40 sentences, one round, nmt rows only.")
    opts = parser.parse_args()
    systems = opts.systems.split(",")
    if opts.smoke:
        opts.sentences, opts.repeats, systems = 40, 1, ["fp32", "auto", "int8"]
    if opts.skip_fairseq or not FAIRSEQ_PY.exists():
        systems = [s for s in systems if s != "fairseq"]
    if opts.skip_ct2 or not CT2_PY.exists():
        systems = [s for s in systems if s != "ct2"]
    for peer, python in (("fairseq", FAIRSEQ_PY), ("ct2", CT2_PY)):
        if peer in opts.systems.split(",") and peer not in systems and not opts.smoke:
            print(f"{peer} rows skipped: {python} not found (see its helper's docstring)",
                  file=sys.stderr)
    torch.set_num_threads(opts.threads)
    opts.cache.mkdir(parents=True, exist_ok=True)
    checkpoint = opts.checkpoint or build_model(opts.cache, opts.vocab_size, opts.seed)
    lines = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").split("\n")
    lines = lines[: opts.sentences]
    refs = (DATA / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=50,
                       max_tokens=opts.max_tokens, buffer_size=len(lines))
    _, vocab, _ = load_model(checkpoint, "cpu")
    request = None
    if "ct2" in systems:
        request = ct2_request(checkpoint, lines, cfg, opts.cache)
        if request is None:
            systems.remove("ct2")
    nmt_runs = {"fp32": ("fp32", True), "auto": ("auto", True), "int8": ("int8", True),
                "fp32_unpacked": ("fp32", False)}
    best: dict[str, dict] = {}
    for _ in range(opts.repeats):  # interleaved: A, B, C, A, B, C, ...
        for name in systems:
            if name in nmt_runs:
                precision, packed = nmt_runs[name]
                keep_best(best, name, time_ours(checkpoint, lines, refs, cfg, precision,
                                                packed, opts.passes))
            elif name == "ct2":
                for compute_type, row in time_ct2(request, opts.threads, vocab, refs,
                                                          opts.passes).items():
                    keep_best(best, f"ct2_{compute_type}", row)
            elif name == "fairseq":
                keep_best(best, "fairseq", time_fairseq(checkpoint, lines, cfg, opts.cache,
                                                        opts.threads, refs))
    report(best, opts, checkpoint)


def report(best: dict[str, dict], opts: argparse.Namespace, checkpoint: Path) -> None:
    """The table (stdout), ratios against CTranslate2 and fairseq, and one JSON line."""
    base = best.get("fp32", {}).get("hyps")
    print(f"{'system':<24}{'sent/s':>9}{'sent/CPU-s':>12}{'tok/s':>9}{'BLEU':>7}"
          f"{'same as nmt fp32':>18}")
    for name, row in best.items():
        label = name if row["system"] != "nmt" else \
            f"nmt {name} ({row['resolved_precision']})"
        same = "" if base is None else \
            f"{sum(a == b for a, b in zip(row['hyps'], base, strict=True)) / len(base):.3f}"
        row["same_as_nmt_fp32"] = same
        print(f"{label:<24}{row['sentences_per_s']:>9.1f}{row['sentences_per_cpu_s']:>12.1f}"
              f"{row['tokens_per_s']:>9.0f}{row['bleu']:>7.2f}{same:>18}")
    for name, row in best.items():
        if row.get("rss_growth_mb") is not None:
            print(f"nmt {name}: {row['rss_mb']:.0f} MiB resident after {row['passes']} passes, "
                  f"{row['rss_growth_mb']:+.0f} MiB since the first")
    result: dict[str, object] = {"bench": "translate_speed", "checkpoint": str(checkpoint),
                                 "beam": 4, "alpha": 0.6, "max_len_b": 50,
                                 "threads": opts.threads, "repeats": opts.repeats,
                                 "sentences": opts.sentences}
    targets = [("int8", "ct2_int8"), ("fp32", "ct2_float32"), ("auto", "ct2_float32"),
               ("auto", "fairseq"), ("fp32", "fairseq")]
    for ours, peer in targets:
        if ours in best and peer in best:
            wall = best[ours]["sentences_per_s"] / best[peer]["sentences_per_s"]
            cpu = best[ours]["sentences_per_cpu_s"] / best[peer]["sentences_per_cpu_s"]
            print(f"nmt {ours} / {peer}: {wall:.2f}x sentences/s wall, {cpu:.2f}x per "
                  "CPU-second (target >= 1.0x)" if peer.startswith("ct2") else
                  f"nmt {ours} / {peer}: {wall:.2f}x sentences/s wall, {cpu:.2f}x per "
                  "CPU-second")
            result[f"speedup_{ours}_vs_{peer}"] = wall
            result[f"speedup_cpu_{ours}_vs_{peer}"] = cpu
    for row in best.values():
        row.pop("hyps", None)
    result.update({name: row for name, row in best.items()})
    result["load_average_1_5_15"] = list(os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
