"""Micro-benchmark of nmt.model.transformer on CPU: training step (forward + backward) tokens/s and
incremental beam-style decoding sentences/s, optionally against fairseq's transformer with
the identical architecture (run in bench/.venv-fairseq).

Usage:  .venv/bin/python bench/model_speed.py [--arch small] [--fairseq]
Prints a few lines, then one JSON line with every number. With --threads 1 (the default)
times are process CPU time, so other jobs on a shared machine distort them far less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
PRESETS = {  # mirrors nmt.config.MODEL_PRESETS, so the fairseq side needs no nmt import
    "tiny": (2, 64, 128, 4), "small": (3, 256, 1024, 4), "base": (6, 512, 2048, 8),
}


def clock() -> float:
    """Seconds for timing: CPU time of this process when torch runs one thread (robust on
    a shared, oversubscribed machine, where wall time swings 2x between runs), else wall
    time."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def batches(vocab: int, n_batches: int, batch: int, seed: int = 0) -> list[tuple]:
    """Length-bucketed random batches: (src (B,S), tgt_in (B,T), real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        s_len = int(torch.randint(10, 30, (1,), generator=gen))
        t_len = s_len + int(torch.randint(-3, 4, (1,), generator=gen))
        src = torch.randint(4, vocab, (batch, s_len), generator=gen)
        tgt = torch.randint(4, vocab, (batch, t_len), generator=gen)
        src_l = torch.randint(s_len - 3, s_len + 1, (batch,), generator=gen)
        tgt_l = torch.randint(t_len - 3, t_len + 1, (batch,), generator=gen)
        src_l[0], tgt_l[0] = s_len, t_len
        src[torch.arange(s_len)[None] >= src_l[:, None]] = 1  # fairseq pad 1; remapped below
        tgt[torch.arange(t_len)[None] >= tgt_l[:, None]] = 1
        out.append((src, tgt, int(src_l.sum() + tgt_l.sum())))
    return out


def build(kind: str, arch: str, vocab: int, pad: int) -> torch.nn.Module:
    layers, d_model, d_ff, heads = PRESETS[arch]
    if kind == "nmt":
        from nmt.config import model_preset
        from nmt.model.transformer import Transformer
        return Transformer(model_preset(arch, vocab_size=vocab, pad_id=pad))
    from argparse import Namespace

    from fairseq.models.transformer import TransformerModel, base_architecture

    class Dict:  # the few Dictionary methods fairseq's model builder calls
        def __len__(self) -> int:
            return vocab

        def pad(self) -> int:
            return pad

    args = Namespace(encoder_layers=layers, decoder_layers=layers, encoder_embed_dim=d_model,
                     decoder_embed_dim=d_model, encoder_ffn_embed_dim=d_ff,
                     decoder_ffn_embed_dim=d_ff, encoder_attention_heads=heads,
                     decoder_attention_heads=heads, share_all_embeddings=True, dropout=0.1,
                     max_source_positions=1024, max_target_positions=1024)
    base_architecture(args)
    d = Dict()
    return TransformerModel.build_model(args, Namespace(source_dictionary=d, target_dictionary=d))


def bench_train(kind: str, arch: str, vocab: int, n: int, nopad: bool = False) -> float:
    """Forward + backward (sum of log-softmax NLL) tokens/s, dropout on. `nopad` (nmt only)
    projects only non-padding positions to the vocabulary (decode_features + logits)."""
    torch.manual_seed(0)
    pad = 0 if kind == "nmt" else 1
    model = build(kind, arch, vocab, pad).train()
    data = batches(vocab, n + 2, 64)
    total, tokens = 0.0, 0
    for i, (src, tgt, ntok) in enumerate(data):
        src, tgt = src.clone(), tgt.clone()
        if pad == 0:
            src[src == 1], tgt[tgt == 1] = 0, 0
        start = clock()
        target = tgt
        if nopad:
            real = tgt.ne(pad)  # (batch, tgt_len)
            logits = model.logits(model.decode_features(tgt, model.encode(src))[real])
            target = tgt[real]
        elif kind == "nmt":
            logits = model(src, tgt)
        else:
            src_lengths = src.ne(pad).sum(1)
            logits = model(src, src_lengths, tgt)[0]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                 target.reshape(-1), ignore_index=pad,
                                                 reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up excluded
            total += clock() - start
            tokens += ntok
    return tokens / total


def bench_decode(kind: str, arch: str, vocab: int, n_sent: int, beam: int, steps: int) -> float:
    """Beam-search-shaped incremental decoding: expand to B*beam, then `steps` steps each
    feeding argmax tokens and reordering rows within each sentence's beam. Sentences/s."""
    if kind == "nmt":  # imported here: the fairseq side runs in its own environment
        from nmt.inference.decoding import decode_step, init_state
    torch.manual_seed(0)
    pad = 0 if kind == "nmt" else 1
    model = build(kind, arch, vocab, pad).eval()
    (src, _, _), = batches(vocab, 1, n_sent, seed=1)
    if pad == 0:
        src[src == 1] = 0
    expand = torch.arange(n_sent).repeat_interleave(beam)
    gen = torch.Generator().manual_seed(2)
    orders = [(torch.randint(0, beam, (n_sent * beam,), generator=gen)
               + expand * beam) for _ in range(steps)]
    with torch.inference_mode():
        start = clock()
        tokens = torch.full((n_sent * beam,), 2, dtype=torch.long)
        if kind == "nmt":
            state = init_state(model, model.encode(src)).reorder(expand)
            for t in range(steps):
                logits = decode_step(model, tokens, state)
                tokens = logits.argmax(-1).clamp(min=4)
                state = state.reorder(orders[t])
        else:
            enc = model.encoder(src, src_lengths=src.ne(pad).sum(1))
            enc = model.encoder.reorder_encoder_out(enc, expand)
            inc: dict = {}
            prev = tokens[:, None]
            for t in range(steps):
                logits = model.decoder(prev, encoder_out=enc, incremental_state=inc)[0][:, -1]
                tokens = logits.argmax(-1).clamp(min=4)
                model.decoder.reorder_incremental_state_scripting(inc, orders[t])
                enc = model.encoder.reorder_encoder_out(enc, orders[t])
                prev = torch.cat([prev.index_select(0, orders[t]), tokens[:, None]], 1)
        elapsed = clock() - start
    return n_sent / elapsed


def run(kind: str, arch: str, threads: int) -> dict:
    """All measures of one side, in this process."""
    torch.set_num_threads(threads)
    result = {
        "train_tokens_per_s": round(bench_train(kind, arch, 8000, 6), 1),
        "decode_sentences_per_s": round(bench_decode(kind, arch, 8000, 32, 4, 30), 2),
        # one sentence at a time (interactive use): per-step overhead dominates
        "decode1_sentences_per_s": round(max(bench_decode(kind, arch, 8000, 1, 4, 30)
                                             for _ in range(3)), 2),
    }
    if kind == "nmt":
        result["train_nopad_logits_tokens_per_s"] = round(
            bench_train(kind, arch, 8000, 6, nopad=True), 1)
    return result


def run_in(kind: str, arch: str, threads: int) -> dict:
    """One measurement in a fresh process: nmt in this venv, fairseq in its own."""
    python = sys.executable if kind == "nmt" else str(FAIRSEQ_PY)
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    out = subprocess.run([python, __file__, "--arch", arch, "--threads", str(threads),
                          "--only", kind], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="small", choices=sorted(PRESETS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating runs per side; the best is kept (shared CPUs)")
    parser.add_argument("--fairseq", action="store_true", help="also run fairseq (its venv)")
    parser.add_argument("--only", choices=["nmt", "fairseq"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run(args.only, args.arch, args.threads)))
        return
    kinds = ["nmt"] + (["fairseq"] if args.fairseq and FAIRSEQ_PY.exists() else [])
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):  # alternate so load changes hit both sides alike
        for kind in kinds:
            runs[kind].append(run_in(kind, args.arch, args.threads))
            print(f"{kind:8s} {runs[kind][-1]}", file=sys.stderr)
    result: dict = {"arch": args.arch, "threads": args.threads, "repeats": args.repeats}
    for kind in kinds:
        result[kind] = {key: max(r[key] for r in runs[kind]) for key in runs[kind][0]}
    if "fairseq" in result:
        for key in set(result["nmt"]) & set(result["fairseq"]):
            result[f"speedup_{key}"] = round(result["nmt"][key] / result["fairseq"][key], 3)
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({**result, "doctor": machine(measure=False)}))


if __name__ == "__main__":
    main()
