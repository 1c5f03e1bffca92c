"""fairseq side of bench/train_throughput.py; run with bench/.venv-fairseq's python.

Builds fairseq's TransformerModel with the architecture given (post-norm, all embeddings
shared, same widths/heads/layers, dropout 0.1), label_smoothed_nll_loss (eps 0.1) summed
over non-pad tokens, torch Adam(0.9, 0.98, 1e-9), and times forward + backward + step +
zero_grad on the batches in the .npz (nmt ids: PAD 0 BOS 2 EOS 3, remapped to fairseq's
1 0 2). torch's Adam is at least as fast as fairseq's own Python Adam, so this favours
fairseq slightly.

--precision bf16 reproduces what `fairseq-train --bf16` does (trainer.py + FP16Optimizer
with bf16, which does not flatten): the model is cast to bfloat16, the optimizer holds an
fp32 master copy of every parameter, gradients are copied to it as fp32 before the Adam
step and the updated weights copied back; no loss scaling. Prints one JSON line with
per-step tokens, CPU seconds and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batches")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--d-ff", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--count", type=int, default=1 << 30, help="timed steps")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(1)

    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, base_architecture

    data = np.load(opts.batches)
    vocab = int(data["vocab"])
    dictionary = Dictionary()  # <s>=0 <pad>=1 </s>=2 <unk>=3, then our pieces 4..
    for i in range(4, vocab):
        dictionary.add_symbol(f"p{i}")
    args = argparse.Namespace(
        encoder_embed_dim=opts.d_model, decoder_embed_dim=opts.d_model,
        encoder_ffn_embed_dim=opts.d_ff, decoder_ffn_embed_dim=opts.d_ff,
        encoder_layers=opts.layers, decoder_layers=opts.layers,
        encoder_attention_heads=opts.heads, decoder_attention_heads=opts.heads,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
        share_all_embeddings=True, encoder_normalize_before=False,
        decoder_normalize_before=False, max_source_positions=1024,
        max_target_positions=1024)
    base_architecture(args)

    class Task:
        source_dictionary = dictionary
        target_dictionary = dictionary

    model = TransformerModel.build_model(args, Task())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    bf16 = opts.precision == "bf16"
    if bf16:  # fairseq-train --bf16: bf16 model, fp32 master weights in the optimizer
        model = model.to(dtype=torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        master = [torch.nn.Parameter(p.detach().float()) for p in params]
        optimizer = torch.optim.Adam(master, lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    remap = torch.arange(vocab)
    remap[0], remap[2], remap[3] = 1, 0, 2  # nmt PAD/BOS/EOS -> fairseq pad/bos/eos

    n = min(int(data["count"]), opts.warmup_steps + opts.count)
    tokens, cpu, wall = [], [], []
    for i in range(n):
        src = remap[torch.from_numpy(data[f"src{i}"])]
        tgt_in = remap[torch.from_numpy(data[f"tgt_in{i}"])]
        tgt_out = remap[torch.from_numpy(data[f"tgt_out{i}"])]
        src_lengths = src.ne(1).sum(1)
        c0, w0 = time.process_time(), time.perf_counter()
        logits, _ = model(src, src_lengths, tgt_in)
        lprobs = model.get_normalized_probs((logits, None), log_probs=True)
        loss, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), tgt_out.view(-1),
                                          0.1, ignore_index=1, reduce=True)
        ntok = int(tgt_out.ne(1).sum())
        (loss / ntok).backward()
        if bf16:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()
            optimizer.step()
            with torch.no_grad():
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
                    p.grad = None
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        c1, w1 = time.process_time(), time.perf_counter()
        if i >= opts.warmup_steps:
            tokens.append(int(src.ne(1).sum()) + ntok)
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    print(json.dumps({"toolkit": "fairseq", "precision": opts.precision, "tokens": tokens,
                      "cpu_s": cpu, "wall_s": wall,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
