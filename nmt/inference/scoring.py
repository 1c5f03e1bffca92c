"""Forced decoding: the log-probability a model (or ensemble) gives a known translation.

Feeds each target through the same step decoders the search uses (incremental decoding,
ensemble averaging, the model's precision and packed linears), so a translation's score
here equals the log-probability beam search reported for it, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from nmt.errors import UsageError
from nmt.inference.search import EnsembleStepDecoder, normalised
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

if TYPE_CHECKING:
    from nmt.inference.translate import Engine


def score_ids(translator: Engine, sources: Sequence[Sequence[int]],
              targets: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[float, int]]:
    """(log-probability, pieces counted) of each target (piece ids, EOS added here) given
    its source, in input order; batched by padded source tokens. Sources longer than the
    translator's limit are truncated, as translation does; a target that does not fit the
    model's positions is a UsageError naming it."""
    from nmt.inference.translate import source_batches

    limit = translator.max_positions - 1
    for i, tgt in enumerate(targets):
        if len(tgt) + 1 > limit:
            raise UsageError(f"target {i} has {len(tgt)} pieces; the model scores at most "
                             f"{limit - 1}")
    srcs = [list(s[: translator.max_src_len]) for s in sources]
    out: list[tuple[float, int]] = [(0.0, 0)] * len(srcs)
    for batch in source_batches([len(s) for s in srcs], max_tokens):
        scored = _score_batch(translator, [srcs[i] for i in batch],
                              [list(targets[i]) for i in batch])
        for i, result in zip(batch, scored, strict=True):
            out[i] = result
    return out


def _score_batch(translator: Engine, sources: list[list[int]], targets: list[list[int]]
                 ) -> list[tuple[float, int]]:
    """Scores of one batch: every row steps through BOS + its target, collecting the
    log-probability of the next target piece (then EOS) at each step."""
    device = translator.device
    width = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(sources):
        src[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        src[row, len(ids)] = EOS_ID
    steps = max(len(t) for t in targets) + 1  # pieces + EOS
    gold = torch.full((len(targets), steps), PAD_ID, dtype=torch.long)  # next piece per step
    for row, ids in enumerate(targets):
        gold[row, : len(ids) + 1] = torch.tensor([*ids, EOS_ID], dtype=torch.long)
    src, gold = src.to(device), gold.to(device)  # (B, S), (B, T)
    feed = torch.cat([torch.full_like(gold[:, :1], BOS_ID), gold[:, :-1]], dim=1)  # (B, T)
    feed = feed.masked_fill(feed == PAD_ID, EOS_ID)  # rows already done: any real token
    total = torch.zeros(len(targets), dtype=torch.float64, device=device)
    with torch.inference_mode(), ExitStack() as members:
        decoder = EnsembleStepDecoder([members.enter_context(w.decoder(src))
                                       for w in translator.workspaces])
        for t in range(steps):
            log_probs = normalised(decoder.step(feed[:, t]))  # (B, V) float32
            picked = log_probs.gather(1, gold[:, t : t + 1].clamp(min=0)).squeeze(1)  # (B,)
            total += picked.double().masked_fill(gold[:, t] == PAD_ID, 0.0)
    return [(float(lp), len(tgt) + 1) for lp, tgt in zip(total.tolist(), targets, strict=True)]
