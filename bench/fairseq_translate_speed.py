"""fairseq side of bench/translate_speed.py; run with bench/.venv-fairseq/bin/python.

Builds a fairseq 0.12 TransformerModel of the exported architecture, loads the converted
weights (see translate_speed.py for the mapping), checks that its teacher-forced log-probs
equal ours, then times fairseq's SequenceGenerator (the search behind fairseq-generate)
over the same length-sorted, max-tokens batches. Ends with one JSON line.

Usage: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 python fairseq_translate_speed.py EXPORT.pt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from argparse import Namespace

import torch


def build(export):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import TransformerModel, base_architecture

    cfg = export["config"]
    dictionary = Dictionary()  # <s>=0 <pad>=1 </s>=2 <unk>=3, as the export assumes
    for i in range(4, cfg["vocab_size"]):
        dictionary.add_symbol(f"p{i}")
    assert len(dictionary) == cfg["vocab_size"], len(dictionary)
    args = Namespace(
        encoder_embed_dim=cfg["d_model"], decoder_embed_dim=cfg["d_model"],
        encoder_ffn_embed_dim=cfg["d_ff"], decoder_ffn_embed_dim=cfg["d_ff"],
        encoder_layers=cfg["encoder_layers"], decoder_layers=cfg["decoder_layers"],
        encoder_attention_heads=cfg["heads"], decoder_attention_heads=cfg["heads"],
        dropout=cfg["dropout"], encoder_learned_pos=True, decoder_learned_pos=True,
        share_all_embeddings=False, share_decoder_input_output_embed=False,
        max_source_positions=cfg["max_positions"], max_target_positions=cfg["max_positions"],
        encoder_normalize_before=False, decoder_normalize_before=False)
    base_architecture(args)

    class Task:
        source_dictionary = dictionary
        target_dictionary = dictionary

    model = TransformerModel.build_model(args, Task())
    missing, unexpected = model.load_state_dict(export["state"], strict=False)
    missing = [k for k in missing if not k.endswith("version")]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing} unexpected {unexpected}")
    return model.eval(), dictionary


def left_pad(rows, pad):
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, width - len(r):] = torch.tensor(r)
    return out


def batches(lengths, max_tokens):
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export")
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    export = torch.load(opts.export, weights_only=False)
    model, dictionary = build(export)
    from fairseq.sequence_generator import SequenceGenerator

    with torch.no_grad():  # parity: teacher-forced log-probs in our vocabulary order
        chk = export["check"]
        src = left_pad(chk["src"], dictionary.pad())
        prev = torch.tensor(chk["prev"])
        lengths = torch.tensor([len(r) for r in chk["src"]])
        logits, _ = model(src, lengths, prev)
        logp = torch.log_softmax(logits.float(), -1)[:, :, export["ours_to_fair"]]
        max_diff = (logp - torch.tensor(chk["logp"])).abs().max().item()

    s = export["search"]
    gen = SequenceGenerator([model], dictionary, beam_size=s["beam"], max_len_a=s["max_len_a"],
                            max_len_b=s["max_len_b"], len_penalty=s["lenpen"])
    sources = export["sources"]
    groups = batches([len(r) for r in sources], s["max_tokens"])

    fair_to_ours = {f: o for o, f in enumerate(export["ours_to_fair"])}
    outputs: dict[int, list[int]] = {}

    def run(selected):
        tokens = 0
        for group in selected:
            rows = [sources[i] for i in group]
            sample = {"net_input": {"src_tokens": left_pad(rows, dictionary.pad()),
                                    "src_lengths": torch.tensor([len(r) for r in rows])}}
            with torch.no_grad():
                hyps = gen.generate([model], sample)
            tokens += sum(len(h[0]["tokens"]) for h in hyps)  # includes EOS
            for i, h in zip(group, hyps, strict=True):  # best, in our ids, no EOS
                outputs[i] = [fair_to_ours[t] for t in h[0]["tokens"].tolist()[:-1]]
        return tokens

    run(batches([len(sources[i]) for i in range(20)], s["max_tokens"]))  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = run(groups)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"system": "fairseq", "sentences": len(sources), "tgt_tokens": tokens,
                      "seconds": seconds, "sentences_per_s": len(sources) / seconds,
                      "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
                      "sentences_per_cpu_s": len(sources) / cpu,
                      "tokens_per_cpu_s": tokens / cpu, "logp_max_abs_diff": max_diff,
                      "hyps": [outputs[i] for i in range(len(sources))]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
