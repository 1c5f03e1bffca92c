"""Incremental decoding (nmt/inference/decoding.py, nmt/inference/kv_cache.py) on tiny
Transformers: the cache equals full re-decoding through expansion, reordering, growth and
shrinking; search through the model adapter keeps the invariants (a sentence alone equals it
inside a batch, incremental equals full re-decoding, lazy compaction equals eager); memory is
handed on explicitly through a DecodingWorkspace; the fast grouped cache equals the plain
reference cache (nmt/inference/plain_cache.py) step by step and through whole searches."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import VOCAB, make_model, random_batch
from helpers.plain_cache import PlainCache

import nmt.inference.search
from nmt.config import model_preset
from nmt.errors import UsageError
from nmt.inference import fused_attention
from nmt.inference.decoding import (
    DecodingWorkspace,
    ModelStepDecoder,
    decode_step,
    greedy_search,
    init_state,
    likely_positions,
)
from nmt.inference.kv_cache import INITIAL_CAPACITY, GroupedCache, Regroup
from nmt.inference.search import FullStepDecoder, beam_search, max_output_lengths
from nmt.model.transformer import Transformer
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]


def incremental_logits(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    state = init_state(model, model.encode(src))
    steps = [decode_step(model, tgt[:, t], state) for t in range(tgt.size(1))]
    return torch.stack(steps, dim=1)  # (batch, tgt_len, vocab)


def lp(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


# --- The cache against full re-decoding ------------------------------------------------


@torch.no_grad()
def test_incremental_decoding_equals_full_decode_with_reorder_and_expand():
    model = make_model(seed=1)
    src = random_batch([7, 4, 5], seed=5)
    tgt = random_batch([21, 21, 21], seed=6, bos=True)
    assert tgt.size(1) > INITIAL_CAPACITY  # the cache grows
    full = model(src, tgt)
    torch.testing.assert_close(incremental_logits(model, src, tgt), full, rtol=1e-4, atol=1e-5)

    # Expand B -> B*beam, then reorder now and then: across sentences (at step 3), within
    # each sentence's beam (steps 10-12: cross-attention K/V kept, cache buffers reused
    # ping-pong), and a shrink to fewer rows after the cache has grown (step 18). Every row
    # must keep matching the full decode of the sentence and prefix it now holds.
    beam = 2
    expand = torch.arange(3).repeat_interleave(beam)  # rows 0 0 1 1 2 2
    state = init_state(model, model.encode(src)).reorder(expand)
    source_of_row = expand
    reorders = {3: torch.tensor([1, 0, 5, 4, 2, 3]), 10: torch.tensor([1, 1, 2, 3, 5, 5]),
                11: torch.tensor([1, 0, 3, 2, 5, 4]), 12: torch.tensor([0, 0, 2, 2, 4, 4]),
                18: torch.tensor([4, 0, 2])}
    for t in range(tgt.size(1)):
        if t in reorders:
            state = state.reorder(reorders[t])
            source_of_row = source_of_row.index_select(0, reorders[t])
        logits = decode_step(model, tgt.index_select(0, source_of_row)[:, t], state)
        torch.testing.assert_close(logits, full.index_select(0, source_of_row)[:, t],
                                   rtol=1e-4, atol=1e-5)
    assert state.position == tgt.size(1) and len(source_of_row) == 3


@torch.no_grad()
@pytest.mark.parametrize("variant", [{}, {"pre_norm": True}, {"learned_positions": True},
                                     {"d_k": 8, "d_v": 24}])
def test_incremental_equals_full_decode_for_every_variant(variant: dict) -> None:
    model = make_model(seed=3, **variant)
    src = random_batch([5, 3], seed=11)
    tgt = random_batch([4, 2], seed=12, bos=True)
    torch.testing.assert_close(incremental_logits(model, src, tgt), model(src, tgt),
                               rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_need_attention_stores_cross_attention_without_changing_logits():
    model = make_model(seed=2)
    src = random_batch([6, 3], seed=7)
    tgt = random_batch([4, 4], seed=8, bos=True)
    enc = model.encode(src)
    plain, probe = init_state(model, enc), init_state(model, enc, attention_layer=0)
    for t in range(tgt.size(1)):
        expected = decode_step(model, tgt[:, t], plain)
        got = decode_step(model, tgt[:, t], probe, need_attention=True)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        attn = probe.attention
        assert attn is not None and attn.shape == (2, model.config.heads, src.size(1))
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, model.config.heads))
        assert torch.all(attn[1, :, 3:] == 0)  # padding gets no attention
    assert plain.attention is None


def test_step_under_autocast_is_finite():
    model = make_model()
    src = random_batch([6, 4], seed=15)
    tgt = random_batch([5, 3], seed=16, bos=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        step = decode_step(model, tgt[:, 0], init_state(model, model.encode(src)))
    assert torch.isfinite(step).all()


def test_too_long_target_raises_usage_error():
    model = make_model(max_positions=8)
    state = init_state(model, model.encode(random_batch([4], seed=18)))
    state.position = 8
    with pytest.raises(UsageError, match="max_positions"):
        decode_step(model, torch.tensor([BOS_ID]), state)


@torch.no_grad()
def test_reorder_consumes_the_old_state():
    model = make_model()
    state = init_state(model, model.encode(random_batch([4, 3], seed=23)))
    new = state.reorder(torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="consumed"):
        decode_step(model, torch.tensor([BOS_ID, BOS_ID]), state)
    with pytest.raises(RuntimeError, match="consumed"):
        state.reorder(torch.tensor([0, 1]))
    assert decode_step(model, torch.tensor([BOS_ID, BOS_ID]), new).shape == (2, VOCAB)


# --- The fast cache against the plain reference -----------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("variant", [{}, {"pre_norm": True}, {"d_k": 8, "d_v": 24}])
def test_grouped_cache_equals_plain_cache_step_by_step(variant: dict) -> None:
    """The grouped layout (slots, ancestry mask, lazy group copies, growth) gives the same
    logits and attention as the plain per-row cache through every kind of reorder the
    search makes: expansion, permutations within beams, across sentences, duplicates,
    shrinking, a change of layout, and steps that feed only some rows."""
    model = make_model(seed=4, **variant)
    src = random_batch([7, 4, 5], seed=9)
    enc = model.encode(src)
    caches = {name: init_state(model, enc, attention_layer=1, cache=kind)
              for name, kind in (("grouped", GroupedCache), ("plain", PlainCache))}
    beam, steps = 3, 2 * INITIAL_CAPACITY + 3  # grows twice
    expand = torch.arange(3).repeat_interleave(beam)
    reorders = {0: expand, 4: torch.tensor([1, 0, 2, 5, 3, 4, 8, 7, 6]),
                7: torch.tensor([0, 0, 1, 3, 3, 3, 8, 8, 6]),
                9: torch.tensor([6, 7, 8, 0, 1, 2, 3, 4, 5]),  # sentences swap places
                12: torch.tensor([3, 4, 5, 6, 7, 8]),  # the first sentence leaves
                16: torch.tensor([0, 1, 2]),  # then the one not fed at steps 14-15
                20: torch.tensor([2, 0, 1, 1]),  # not whole beams: one row per group
                25: torch.tensor([1, 0, 3, 2])}
    # sentence 2 done at step 14: fed no more (its slots are never read again)
    live = {14: torch.tensor([0, 1, 2]), 15: torch.tensor([0, 1, 2])}
    gen = torch.Generator().manual_seed(5)
    rows, layouts = 3, []
    for t in range(steps):
        if t in reorders:
            caches = {name: c.reorder(reorders[t]) for name, c in caches.items()}
            rows = reorders[t].numel()
            layouts.append(caches["grouped"].group_size)
        if t in live:
            ids = torch.randint(4, VOCAB, (live[t].numel(),), generator=gen)
            out = {name: decode_step(model, ids, c, need_attention=True, live=live[t])
                   for name, c in caches.items()}
        else:
            ids = torch.randint(4, VOCAB, (rows,), generator=gen)
            out = {name: decode_step(model, ids, c, need_attention=True)
                   for name, c in caches.items()}
        torch.testing.assert_close(out["grouped"], out["plain"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches["grouped"].attention, caches["plain"].attention,
                                   rtol=1e-5, atol=1e-6)
        if fused_attention.enabled():  # the C kernel's key layout survives every reorder
            assert caches["grouped"].cross_k[0].stride(-2) == 1
    assert layouts == [3, 3, 3, 3, 3, 3, 1, 1]  # grouped beams, then the per-row fallback
    assert caches["grouped"].capacity >= steps


@torch.no_grad()
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_over_grouped_cache_equals_plain_cache(alpha: float) -> None:
    """The whole search, compaction of finished sentences included, finds the same
    hypotheses with the same scores over either cache."""
    model = tiny_model(seed=13)
    sources = SOURCES + [[7, 7, 8], [30, 31], [12, 13, 14, 15, 16]]
    src = padded(sources)
    max_lens = max_output_lengths(src, 1.0, 6, cap=63)
    found = {}
    for name, cache in (("grouped", GroupedCache), ("plain", PlainCache)):
        with ModelStepDecoder(model, src, cache=cache) as decoder:
            found[name] = beam_search(decoder, max_lens, beam=4, alpha=alpha, nbest=3,
                                       min_len=1)
    for fast, plain in zip(found["grouped"], found["plain"], strict=True):
        assert [h.tokens for h in fast] == [h.tokens for h in plain]
        for x, y in zip(fast, plain, strict=True):  # float32 sums of ~20 steps' log-probs
            assert x.score == pytest.approx(y.score, rel=2e-6, abs=1e-5)
    assert len({tuple(h[0].tokens) for h in found["plain"]}) > 3  # outputs differ by input


@torch.no_grad()
def test_caches_reserve_a_likely_length_and_grow_past_it() -> None:
    """The decoder preallocates for about 1.5x the sources, not the search's far bound;
    hypotheses forced longer than that grow the caches and find what the plain cache
    (no preallocation) finds."""
    model = tiny_model(seed=13)
    src = padded([SOURCES[0], [17], [6, 21]])  # (3, 8)
    max_lens = max_output_lengths(src, 1.0, 40, cap=60)
    likely = likely_positions(src.size(1))
    assert INITIAL_CAPACITY < likely < int(max_lens.max()) + 2
    found = {}
    for name, cache in (("grouped", GroupedCache), ("plain", PlainCache)):
        with ModelStepDecoder(model, src, cache=cache) as decoder:
            if name == "grouped":
                decoder.reserve(int(max_lens.max()) + 2)
                assert decoder.state.capacity == likely
            found[name] = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2,
                                      min_len=2 * likely)
            if name == "grouped":
                assert decoder.state.capacity > 2 * likely
    for fast, plain in zip(found["grouped"], found["plain"], strict=True):
        assert [h.tokens for h in fast] == [h.tokens for h in plain]
        assert all(len(h.tokens) >= 2 * likely for h in fast)
        for x, y in zip(fast, plain, strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-5)


# --- Search invariants on a real (tiny, random-init, sharpened) Transformer ----------


def tiny_model(seed: int = 0, vocab: int = 40) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(model_preset("tiny", vocab_size=vocab, max_positions=64)).eval()
    with torch.no_grad():
        model.embed.weight.mul_(4.0)  # decisive, input-dependent outputs
    return model


def padded(sources: list[list[int]]) -> torch.Tensor:
    src = torch.full((len(sources), max(map(len, sources)) + 1), PAD_ID)
    for i, ids in enumerate(sources):
        src[i, : len(ids) + 1] = torch.tensor([*ids, EOS_ID])
    return src  # (batch, src_len)


SOURCES = [[5, 9, 11, 7, 30, 12, 8], [17], [6, 6, 21, 33], [4, 39, 25, 10, 13, 18, 27, 22, 9]]


@torch.no_grad()
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_model_sentence_alone_equals_inside_batch(alpha: float) -> None:
    model = tiny_model()
    src = padded(SOURCES)
    max_lens = max_output_lengths(src, 1.0, 3, cap=63)
    batch = beam_search(ModelStepDecoder(model, src), max_lens, beam=4, alpha=alpha, nbest=2,
                        min_len=1)
    assert len({tuple(h[0].tokens) for h in batch}) > 1  # outputs depend on the input
    for i, ids in enumerate(SOURCES):
        one = padded([ids])
        alone = beam_search(ModelStepDecoder(model, one), max_output_lengths(one, 1.0, 3),
                            beam=4, alpha=alpha, nbest=2, min_len=1)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batch[i]]
        for x, y in zip(alone, batch[i], strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-4)


@torch.no_grad()
def test_model_incremental_equals_full_redecoding() -> None:
    """Scores from the KV-cached search equal teacher-forced re-decoding of the output."""
    model = tiny_model(seed=3)
    src = padded(SOURCES)
    hyps = beam_search(ModelStepDecoder(model, src), max_output_lengths(src, 1.0, 5),
                       beam=3, alpha=0.6, nbest=3, min_len=1)
    enc = model.encode(src)
    for i, sent in enumerate(hyps):
        for h in sent:
            tgt_in = torch.tensor([[BOS_ID, *h.tokens]])  # (1, T)
            one = type(enc)(states=enc.states[i : i + 1],
                            padding_mask=enc.padding_mask[i : i + 1])
            logp = torch.log_softmax(model.decode(tgt_in, one).float(), dim=-1)[0]  # (T, V)
            gold = torch.tensor([*h.tokens, EOS_ID])
            full = logp.gather(1, gold.unsqueeze(1)).sum().item()
            assert h.log_prob == pytest.approx(full, abs=1e-4)
            assert h.score == pytest.approx(full / lp(len(h.tokens) + 1, 0.6), abs=1e-4)
    # Greedy on the cache equals step-by-step argmax of full re-decoding.
    greedy = greedy_search(model, src, 1.0, 5)
    for i, tokens in enumerate(greedy):
        one = type(enc)(states=enc.states[i : i + 1], padding_mask=enc.padding_mask[i : i + 1])
        prefix = [BOS_ID]
        limit = int(max_output_lengths(src[i : i + 1], 1.0, 5))
        while len(prefix) <= limit:
            logits = model.decode(torch.tensor([prefix]), one)[0, -1].float()
            logits[[PAD_ID, BOS_ID]] = -math.inf
            nxt = int(logits.argmax())
            if nxt == EOS_ID:
                break
            prefix.append(nxt)
        assert tokens == prefix[1:]


@torch.no_grad()
def test_beam_cache_is_grouped_per_sentence_and_reorders_without_copies() -> None:
    """Performance layout: encoder K/V once per sentence, step 0 computed once per sentence,
    and beam reordering moves no key/value (only the ancestry table), yet the search
    result equals that of a decoder that re-decodes every prefix in full."""
    model = tiny_model(seed=5)
    src = padded(SOURCES)
    beam = 3
    dec = ModelStepDecoder(model, src)
    sizes: list[int] = []
    step, reorder = dec.step, dec.reorder
    buffers: list[tuple[int, int, int]] = []  # (rows before, rows after, buffer kept?)

    def counting_step(tokens: torch.Tensor) -> torch.Tensor:
        sizes.append(tokens.numel())
        return step(tokens)

    def tracking_reorder(new_order: torch.Tensor, layout: Regroup | None = None) -> None:
        before, ptr = dec.state.rows, dec.state.self_k[0].data_ptr()
        reorder(new_order, layout)
        buffers.append((before, dec.state.rows, int(dec.state.self_k[0].data_ptr() == ptr)))

    dec.step, dec.reorder = counting_step, tracking_reorder  # type: ignore[method-assign]
    max_lens = max_output_lengths(src, 1.0, 4)
    hyps = beam_search(dec, max_lens, beam=beam, alpha=0.6, nbest=beam, min_len=1)
    assert sizes[0] == len(SOURCES) and sizes[1] == len(SOURCES) * beam
    assert dec.state.group_size == beam
    assert dec.state.cross_k[0].size(0) == dec.state.rows // beam  # one copy per sentence
    within = [kept for before, after, kept in buffers[1:] if before == after]
    assert within and all(within)  # same-size reorders reuse the very same K/V buffers
    assert any(after < before for before, after, _ in buffers)  # finished sentences left

    class FullRedecoder(FullStepDecoder):
        """Reference StepDecoder: re-decodes each row's whole prefix, no cache at all."""

        def __init__(self) -> None:
            self.enc = model.encode(src)
            self.rows = torch.arange(len(SOURCES))
            self.prefix = torch.full((len(SOURCES), 0), BOS_ID)

        def step(self, tokens: torch.Tensor) -> torch.Tensor:
            self.prefix = torch.cat([self.prefix, tokens[:, None]], dim=1)  # (N, t+1)
            enc = type(self.enc)(states=self.enc.states[self.rows],
                                 padding_mask=self.enc.padding_mask[self.rows])
            logits = model.decode(self.prefix, enc)[:, -1].float()  # (N, V)
            return torch.log_softmax(logits, dim=-1)

        def reorder(self, new_order: torch.Tensor) -> None:
            self.rows, self.prefix = self.rows[new_order], self.prefix[new_order]

    reference = beam_search(FullRedecoder(), max_lens, beam=beam, alpha=0.6, nbest=beam,
                            min_len=1)
    for got, want in zip(hyps, reference, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        for x, y in zip(got, want, strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-4)


@torch.no_grad()
def test_model_step_rows_equals_full_step_on_those_rows() -> None:
    """Leaving finished rows out of a step (`step_rows`) changes nothing for the others."""
    model = tiny_model(seed=7)
    src = padded(SOURCES)
    beam = 3
    full, part = ModelStepDecoder(model, src), ModelStepDecoder(model, src)
    expand = torch.arange(len(SOURCES)).repeat_interleave(beam)
    live = torch.tensor([0, 1, 2, 6, 7, 8])  # sentences 0 and 2; 1 and 3 finished
    gen = torch.Generator().manual_seed(0)
    for t in range(6):
        tokens = torch.randint(4, 40, (len(SOURCES) * (1 if t == 0 else beam),), generator=gen)
        want = full.step(tokens).clone()  # (rows, V)
        if t <= 1:
            got = part.step(tokens)
        else:
            got = part.step_rows(tokens[live], live, len(SOURCES) * beam)  # (6, V)
            want = want[live]
        assert torch.allclose(got, want, atol=1e-5)
        order = expand if t == 0 else torch.randperm(beam, generator=gen).repeat(
            len(SOURCES)) + torch.arange(len(SOURCES)).repeat_interleave(beam) * beam
        full.reorder(order)
        part.reorder(order)


@torch.no_grad()
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_lazy_compaction_equals_eager(alpha: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping finished sentences in the decoder until compaction is exact: compacting at
    every finish, at 25 % and never give identical hypotheses and scores."""
    model = tiny_model(seed=11)
    sources = SOURCES + [[7, 7, 8], [30, 31], [12, 13, 14, 15, 16]]
    src = padded(sources)
    max_lens = max_output_lengths(src, 1.0, 4, cap=63)
    results = []
    for compact_at in (0.0, 0.25, 1.0):
        monkeypatch.setattr(nmt.inference.search, "COMPACT_AT", compact_at)
        hyps = beam_search(ModelStepDecoder(model, src), max_lens, beam=4, alpha=alpha,
                           nbest=2, min_len=1)
        results.append([[(h.tokens, h.score, h.log_prob) for h in sent] for sent in hyps])
    assert results[0] == results[1] == results[2]
    assert len({tuple(r[0][0]) for r in results[0]}) > 1


# --- Explicit memory lifetime: DecodingWorkspace -----------------------------------------


@torch.no_grad()
def test_workspace_hands_its_logits_buffer_to_the_next_decoder() -> None:
    """A closed decoder drops its caches and leaves its logits buffer to the workspace's
    next one, which decodes exactly as a fresh one would; a second live decoder never
    shares it; the workspace never holds more than that one buffer."""
    model = tiny_model(seed=2)
    src = padded(SOURCES)
    max_lens = max_output_lengths(src, 1.0, 4, cap=63)
    settings = {"beam": 4, "alpha": 0.6, "nbest": 1, "min_len": 1}
    workspace = DecodingWorkspace(model)
    assert workspace.projection is None  # nothing packed: the plain output matmul
    with workspace.decoder(src) as first_decoder:
        first = beam_search(first_decoder, max_lens, **settings)
        logits = first_decoder._logits
    assert logits is not None and workspace._logits is logits  # given back on leaving
    assert first_decoder.state.self_k == [] == first_decoder.state.self_v  # caches dropped
    # nothing else kept (the vocabulary's moments only once a shortlist asks for them; the
    # native step's plan holds weight addresses, no memory of a batch's)
    assert vars(workspace).keys() == {"model", "projection", "native", "_logits", "_moments"}
    assert workspace._moments is None
    with workspace.decoder(src) as dec:
        assert workspace._logits is None  # lent out: a second live decoder allocates anew
        with workspace.decoder(src) as other:
            assert other._logits is None
        second = beam_search(dec, max_lens, **settings)
        assert dec._logits is logits
    with pytest.raises(RuntimeError, match="consumed"):
        dec.step(torch.full((4,), BOS_ID))  # closed: it cannot step
    dec.close()  # idempotent
    fresh = beam_search(ModelStepDecoder(model, src), max_lens, **settings)
    as_tuples = [[(h.tokens, h.score, h.log_prob) for h in s] for s in first]
    assert as_tuples == [[(h.tokens, h.score, h.log_prob) for h in s] for s in second]
    assert as_tuples == [[(h.tokens, h.score, h.log_prob) for h in s] for s in fresh]


@torch.no_grad()
def test_decoder_closed_on_error_still_returns_its_buffer() -> None:
    model = tiny_model(seed=4)
    workspace = DecodingWorkspace(model)
    with pytest.raises(ValueError, match="nbest"), workspace.decoder(padded(SOURCES)) as dec:
        dec.step(torch.full((len(SOURCES),), BOS_ID))  # the logits buffer exists now
        beam_search(dec, torch.tensor([3, 3, 3, 3]), beam=2, alpha=0.0, nbest=3, min_len=1)
    assert workspace._logits is not None  # given back although the search failed
    assert dec.state.consumed


@torch.no_grad()
def test_greedy_search_takes_its_defaults_from_decode_config() -> None:
    from nmt.config import DecodeConfig

    model = tiny_model(seed=6)
    src = padded(SOURCES)
    defaults = DecodeConfig()
    assert greedy_search(model, src) == greedy_search(
        model, src, defaults.max_len_a, defaults.max_len_b, defaults.min_len)
