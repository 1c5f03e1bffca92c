"""Decoding regression on real text: 300 Multi30k test2016 lines through a tiny model
trained here for a few seconds (real BPE vocabulary, 120 Adam steps on 4,000 training pairs:
enough for varied, mostly EOS-terminated German-looking output, so sentences finish at
different steps), checked with invariants rather than stored outputs:

- the Engine's pooled memory changes nothing: a second pass over the same lines
  (every batch reusing the memory the previous left) equals the first, and a fresh
  translator's batches equal both;
- a sentence decodes the same alone as inside its batch (beam 4, nbest 2);
- beam 1 at alpha 0 equals greedy search;
- the cached search's log-probabilities equal teacher-forced full re-decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoints import make_vocab

from nmt.checkpoint import FORMAT, save_checkpoint
from nmt.config import DecodeConfig, model_preset
from nmt.data.vocab import Vocab
from nmt.inference.decoding import DecodingWorkspace, ModelStepDecoder, greedy_search
from nmt.inference.search import Hypothesis, beam_search, max_output_lengths
from nmt.inference.translate import Engine, source_batches
from nmt.model.transformer import EncoderOutput, Transformer
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

LINES = 300
CFG = DecodeConfig(beam=4, alpha=0.6, nbest=2, max_len_b=5, max_tokens=600)


def train_tiny(vocab: Vocab, multi30k: Path, steps: int = 120) -> Transformer:
    """A tiny model fitted for `steps` Adam steps of 32 random training pairs (seeded)."""
    src_text = (multi30k / "train.en").read_text(encoding="utf-8").split("\n")[:4000]
    tgt_text = (multi30k / "train.de").read_text(encoding="utf-8").split("\n")[:4000]
    src_ids, tgt_ids = vocab.encode(src_text), vocab.encode(tgt_text)
    torch.manual_seed(7)
    model = Transformer(model_preset("tiny", vocab_size=len(vocab), max_positions=128,
                                     dropout=0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-3, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(0, len(src_ids), (32,), generator=gen).tolist()
        tgt = [tgt_ids[i][:30] for i in rows]
        logits = model(padded([src_ids[i][:30] for i in rows]),
                       padded([[BOS_ID, *t] for t in tgt], eos=False))
        gold = padded(tgt)  # (batch, tgt_len): pieces + EOS, as the decoder should output
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, list[list[int]]]:
    from conftest import shared_data_path

    multi30k = shared_data_path("multi30k")
    work = tmp_path_factory.mktemp("decoding_regression")
    proto = make_vocab(multi30k, work).read_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (module-scoped: runs before the one_thread fixture)
    try:
        model = train_tiny(Vocab(proto), multi30k)
    finally:
        torch.set_num_threads(threads)
    ckpt = work / "model.pt"
    save_checkpoint({"format": FORMAT, "step": 120, "model_config": model.config.to_dict(),
                     "vocab": proto, "model": model.state_dict()}, ckpt)
    translator = Engine.load([ckpt], CFG, device="cpu", precision="fp32")
    text = (multi30k / "test_2016_flickr.en").read_text(encoding="utf-8")
    sources = [ids for ids in translator.vocab.encode(text.split("\n")[:LINES]) if ids]
    assert len(sources) == LINES
    return translator, sources


def padded(rows: list[list[int]], eos: bool = True) -> torch.Tensor:
    """Right-padded (batch, longest) ids, each row followed by EOS when `eos`."""
    rows = [[*ids, EOS_ID] if eos else list(ids) for ids in rows]
    out = torch.full((len(rows), max(map(len, rows))), PAD_ID)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out  # (batch, len)


def translate_all(translator: Engine, sources: list[list[int]]) -> list[list[Hypothesis]]:
    """Every source through the translator in its length-sorted batches, input order."""
    results: list[list[Hypothesis]] = [[] for _ in sources]
    for batch in source_batches([len(s) for s in sources], CFG.max_tokens):
        for i, hyps in zip(batch, translator.translate_ids([sources[i] for i in batch]),
                           strict=True):
            results[i] = hyps
    return results


def plain(results: list[list[Hypothesis]]) -> list[list[tuple[list[int], float, float]]]:
    return [[(h.tokens, h.score, h.log_prob) for h in hyps] for hyps in results]


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
@torch.no_grad()
def test_pooled_memory_and_batches_change_nothing(setup) -> None:
    translator, sources = setup
    first = translate_all(translator, sources)
    assert len(source_batches([len(s) for s in sources], CFG.max_tokens)) > 5
    held = translator.workspaces[0]._logits  # None: the packed projection allocates its own
    again = translate_all(translator, sources)  # every batch on reused memory
    assert plain(again) == plain(first)
    # Nothing accumulates from batch to batch: the same one buffer, no cache kept.
    assert translator.workspaces[0]._logits is held
    assert vars(translator.workspaces[0]).keys() == {"model", "projection", "native",
                                                     "_logits", "_moments"}
    assert translator.workspaces[0]._moments is None  # made for a shortlist only
    max_lens = max_output_lengths(padded(sources), CFG.max_len_a, CFG.max_len_b)
    assert len({tuple(hyps[0].tokens) for hyps in first}) > LINES // 5  # input-dependent
    ended = sum(len(h[0].tokens) < n for h, n in zip(first, max_lens.tolist(), strict=True))
    assert ended > LINES // 2  # most chose EOS: sentences finish at different steps
    # Each sentence alone (a fresh decoder on fresh memory, no padding) agrees.
    model = translator.models[0]
    for i in range(0, LINES, 10):
        src = padded([sources[i]])
        with DecodingWorkspace(model).decoder(src) as decoder:  # packed, as the translator's
            alone = beam_search(decoder, max_lens[i : i + 1], beam=CFG.beam, alpha=CFG.alpha,
                                nbest=CFG.nbest, min_len=CFG.min_len)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in first[i]], i
        for x, y in zip(alone, first[i], strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-4)


@torch.no_grad()
def test_beam1_equals_greedy_and_incremental_equals_full(setup) -> None:
    translator, sources = setup
    model = translator.models[0]
    src = padded(sources[:100])
    max_lens = max_output_lengths(src, CFG.max_len_a, CFG.max_len_b)
    beam1 = beam_search(ModelStepDecoder(model, src), max_lens, beam=1, alpha=0.0, nbest=1,
                        min_len=CFG.min_len)
    greedy = greedy_search(model, src, CFG.max_len_a, CFG.max_len_b, CFG.min_len)
    assert [h[0].tokens for h in beam1] == greedy
    # Scores are log-softmax values summed as the search picked them (the restrictions
    # mask tokens out without renormalising), so full re-decoding must give the same sum.
    enc = model.encode(src)
    for i, hyps in enumerate(beam1[:40]):
        one = EncoderOutput(states=enc.states[i : i + 1],
                            padding_mask=enc.padding_mask[i : i + 1])
        tokens = hyps[0].tokens
        logits = model.decode(torch.tensor([[BOS_ID, *tokens]]), one)[0]  # (T, V)
        logp = torch.log_softmax(logits.float(), dim=-1)
        gold = torch.tensor([*tokens, EOS_ID])  # (T,)
        full = logp.gather(1, gold.unsqueeze(1)).sum().item()
        assert hyps[0].log_prob == pytest.approx(full, abs=1e-4), i
