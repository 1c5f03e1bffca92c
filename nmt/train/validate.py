"""Validation during training: loss and perplexity on the valid split, optionally BLEU.

Every rank scores its shard of the valid batches and the sums are all-reduced; decoding
for BLEU (beam search with translate's settings, `--valid-beam`) runs on rank 0 only (the
others wait at the next collective).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from nmt.config import DecodeConfig, TrainConfig
from nmt.data.batching import batch_by_tokens, collate
from nmt.data.dataset import ParallelData
from nmt.data.vocab import Vocab
from nmt.precision import autocast, resolve_precision
from nmt.train.distributed import DistEnv
from nmt.train.loss import label_smoothed_nll


@torch.no_grad()
def validate(model: torch.nn.Module, data: ParallelData, vocab: Vocab, cfg: TrainConfig,
             device: torch.device, env: DistEnv, bleu: bool = False,
             data_dir: Path | None = None) -> dict[str, float]:
    """{"loss", "nll", "ppl"} per target token (nats), plus "bleu" and "chrf" when asked
    (on rank 0 only: the caller broadcasts them)."""
    was_training = model.training
    model.eval()
    n = len(data)
    limit = max(cfg.max_len, int(max(data.src.lengths.max(initial=0),
                                     data.tgt.lengths.max(initial=0))) + 1)
    batches = batch_by_tokens(data.src.lengths, data.tgt.lengths, max(cfg.max_tokens, limit),
                              limit).batches
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, tokens
    for batch_ids in batches[env.rank::env.world_size]:
        batch = collate([data.src[i] for i in batch_ids], [data.tgt[i] for i in batch_ids])
        batch = batch.to(device)
        with autocast(device, resolve_precision(cfg.precision, device)):
            logits = model(batch.src, batch.tgt_in)
            loss, nll = label_smoothed_nll(logits, batch.tgt_out, cfg.label_smoothing,
                                           model.config.pad_id)
        sums += torch.stack([loss.double(), nll.double(),
                             torch.tensor(float(batch.tgt_tokens), device=device,
                                          dtype=torch.float64)])
    if env.active:
        torch.distributed.all_reduce(sums)
    loss_sum, nll_sum, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    metrics = {"loss": loss_sum / tokens, "nll": nll_sum / tokens,
               "ppl": math.exp(min(nll_sum / tokens, 50.0))}
    if bleu and env.is_main and n:
        metrics.update(decode_scores(model, data, vocab, cfg, device, data_dir))
    model.train(was_training)
    return metrics


def decode_scores(model: torch.nn.Module, data: ParallelData, vocab: Vocab, cfg: TrainConfig,
                  device: torch.device, data_dir: Path | None = None) -> dict[str, float]:
    """sacreBLEU and chrF of the valid split's translations against DATA/valid.tgt (or the
    decoded target ids when the text file is absent): beam search with translate's
    settings (beam 4, alpha 0.6, source + 50), --valid-beam to change the beam (1:
    greedy). Batches of --max-tokens source tokens, shrunk by the beam so the decoder
    holds about as many rows as a training batch."""
    from nmt.inference.decoding import search_ids
    from nmt.score import corpus_scores

    search = DecodeConfig(beam=cfg.valid_beam or DecodeConfig().beam)

    n = len(data)
    hyps: list[str] = [""] * n
    batches = batch_by_tokens(data.src.lengths, np.zeros(n, np.int64),
                              max(cfg.max_tokens // search.beam, 1), 10 ** 9,
                              oversize_alone=True).batches
    for batch_ids in batches:
        batch = collate([data.src[i] for i in batch_ids], [data.tgt[i] for i in batch_ids])
        with autocast(device, resolve_precision(cfg.precision, device)):
            out = search_ids(model, batch.src.to(device), search)
        for i, text in zip(batch_ids.tolist(), vocab.decode(out), strict=True):
            hyps[i] = text
    ref_path = Path(data_dir) / "valid.tgt" if data_dir is not None else None
    if ref_path is not None and ref_path.is_file():
        refs = ref_path.read_text(encoding="utf-8").splitlines()[:n]
    else:
        refs = vocab.decode([data.tgt[i].tolist() for i in range(n)])
    return corpus_scores(hyps, refs, ("bleu", "chrf"))
