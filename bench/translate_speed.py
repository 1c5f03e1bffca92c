"""Translation speed: `nmt translate` vs fairseq's generator, same weights, CPU, beam 4.

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
weights where the CPU computes bf16 natively, e.g. AVX512-BF16; else fp32 again), both with
its linears packed for oneDNN (nmt/packed_linear.py, what `nmt translate` does on a CPU), and
once more at fp32 with packing off (NMT_PACKED_LINEAR=0: torch's default MKL path, the one
fairseq runs on) to show what the packing contributes.
fairseq runs fp32, its fastest mode on a CPU: measured here (Multi30k test, 1 thread),
`fairseq-generate --cpu --bf16` leaves the model in fp32 (same output, same time, 27.6 s vs
29.0 s) and `--fp16` is 2.9x slower (82.9 s). The target line compares the defaults.

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

import sacrebleu
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt import packed_linear  # noqa: E402
from nmt.checkpoint import FORMAT, load_model, save_checkpoint  # noqa: E402
from nmt.config import DecodeConfig, model_preset  # noqa: E402
from nmt.model import Transformer  # noqa: E402
from nmt.precision import resolve_precision  # noqa: E402
from nmt.translate import Translator, translate_stream  # noqa: E402
from nmt.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab  # noqa: E402

DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data")) / "multi30k"
FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
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
        save_checkpoint({"format": FORMAT, "step": 0, "model_config": cfg.to_dict(),
                         "vocab": proto, "model": model.state_dict(),
                         "meta": {"src_lang": "en", "tgt_lang": "de"}}, path)
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


def bleu(hyps: list[str], refs: list[str]) -> float:
    """Detokenized sacreBLEU (13a) of `hyps` against `refs`."""
    return round(sacrebleu.corpus_bleu(hyps, [refs[: len(hyps)]]).score, 2)


def time_ours(checkpoint: Path, lines: list[str], refs: list[str], cfg: DecodeConfig,
              precision: str, packed: bool = True) -> dict[str, object]:
    """`nmt translate`'s stream path over `lines` at `precision` (after a 20-line warm-up),
    with the linears packed for oneDNN or (packed=False) on torch's default path."""
    os.environ["NMT_PACKED_LINEAR"] = "1" if packed else "0"
    packed_linear.available.cache_clear()
    translator = Translator.load([checkpoint], cfg, device="cpu", precision=precision)
    data = ("\n".join(lines) + "\n").encode()
    translate_stream(io.BytesIO(("\n".join(lines[:20]) + "\n").encode()), io.BytesIO(),
                     translator)  # warm-up
    sink = io.BytesIO()
    start, cpu_start = time.perf_counter(), time.process_time()
    stats = translate_stream(io.BytesIO(data), sink, translator)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    hyps = sink.getvalue().decode("utf-8").splitlines()
    os.environ.pop("NMT_PACKED_LINEAR")
    packed_linear.available.cache_clear()
    return {"system": "nmt", "precision": precision, "packed_linears": packed,
            "bleu": bleu(hyps, refs),
            "resolved_precision": resolve_precision(precision, torch.device("cpu")),
            "sentences": stats.sentences, "tgt_tokens": stats.tgt_tokens,
            "seconds": seconds, "sentences_per_s": stats.sentences / seconds,
            "tokens_per_s": stats.tgt_tokens / seconds, "cpu_seconds": cpu,
            "sentences_per_cpu_s": stats.sentences / cpu,
            "tokens_per_cpu_s": stats.tgt_tokens / cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/nmt_bench_translate"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-fairseq", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    checkpoint = opts.checkpoint or build_model(opts.cache, opts.vocab_size, opts.seed)
    lines = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").split("\n")
    lines = lines[: opts.sentences]
    refs = (DATA / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=50,
                       max_tokens=opts.max_tokens, buffer_size=len(lines))
    runs = {"fp32": time_ours(checkpoint, lines, refs, cfg, "fp32"),
            "auto": time_ours(checkpoint, lines, refs, cfg, "auto"),
            "fp32_unpacked": time_ours(checkpoint, lines, refs, cfg, "fp32", packed=False)}
    for name, ours in runs.items():
        print(f"nmt {name:>13} ({ours['resolved_precision']}): {ours['sentences_per_s']:.1f} "
              f"sentences/s, {ours['tokens_per_s']:.0f} target tokens/s "
              f"({ours['seconds']:.1f} s wall); {ours['sentences_per_cpu_s']:.1f} "
              f"sentences/CPU-s ({ours['cpu_seconds']:.1f} CPU-s); BLEU {ours['bleu']}")
    result: dict[str, object] = {"bench": "translate_speed", "checkpoint": str(checkpoint),
                                 "beam": 4, "alpha": 0.6, "max_len_b": 50,
                                 "threads": opts.threads, "nmt": runs["auto"],
                                 "nmt_fp32": runs["fp32"],
                                 "nmt_fp32_unpacked": runs["fp32_unpacked"]}
    if not opts.skip_fairseq:
        model, vocab, _ = load_model(checkpoint, "cpu")
        export = opts.cache / "fairseq_export.pt"
        opts.cache.mkdir(parents=True, exist_ok=True)
        export_for_fairseq(model, vocab, lines, cfg, export)
        env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
        proc = subprocess.run([str(FAIRSEQ_PY), str(REPO / "bench" / "fairseq_translate_speed.py"),
                               str(export), "--threads", str(opts.threads)], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"fairseq side failed:\n{proc.stderr[-3000:]}")
        fair = json.loads(proc.stdout.strip().splitlines()[-1])
        fair["bleu"] = bleu(vocab.decode(fair.pop("hyps")), refs)
        print(f"fairseq: {fair['sentences_per_s']:.1f} sentences/s, "
              f"{fair['tokens_per_s']:.0f} target tokens/s ({fair['seconds']:.1f} s wall); "
              f"{fair['sentences_per_cpu_s']:.1f} sentences/CPU-s "
              f"({fair['cpu_seconds']:.1f} CPU-s); BLEU {fair['bleu']}; "
              f"log-prob parity max |diff| {fair['logp_max_abs_diff']:.2e}")
        labels = {"auto": ("nmt default (auto)", ""), "fp32": ("like for like (fp32)", "_fp32"),
                  "fp32_unpacked": ("fp32, packing off", "_fp32_unpacked")}
        for name, ours in runs.items():
            ratio = ours["sentences_per_s"] / fair["sentences_per_s"]
            cpu_ratio = ours["sentences_per_cpu_s"] / fair["sentences_per_cpu_s"]
            label, suffix = labels[name]
            print(f"speed-up, {label}: {ratio:.2f}x sentences/s wall, {cpu_ratio:.2f}x per "
                  "CPU-second (target >= 1.5x)")
            result[f"speedup_sentences{suffix}"] = ratio
            result[f"speedup_sentences_cpu{suffix}"] = cpu_ratio
        result["fairseq"] = fair
    result["load_average_1_5_15"] = list(os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
