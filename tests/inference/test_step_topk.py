"""A beam search step's log-softmax and top-k as one C kernel (nmt/inference/step_topk.py)
against PyTorch's ops: every width, dtype, rule and thread count a search meets; the
search's results the same with the kernel on and off; its absence harmless."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_model, random_batch
from helpers.native import without_kernels

from nmt.inference import step_topk
from nmt.inference.decoding import ModelStepDecoder
from nmt.inference.search import (
    _force,
    _pinned,
    _restrict,
    _row_topk,
    beam_search,
    max_output_lengths,
    normalised,
)
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.isa  # compiled for the vector ISA in use: CI runs these at AVX2 too

needs_kernel = pytest.mark.skipif(not step_topk.enabled(),
                                  reason="no C compiler here: the kernel cannot be built")
FREE, NONE = step_topk.FREE, step_topk.NONE


def fused(logits: torch.Tensor, k: int, **rules) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_topk` through the kernel that `kernel_for` gives for these operands."""
    lib = step_topk.kernel_for(logits, k)
    assert lib is not None
    return step_topk.row_topk(lib, logits, k, **rules)


def logits_of(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Logits shaped like a model's: a spread of about 20 and a few clear favourites."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 3
    favourites = torch.randint(0, vocab, (rows, 3), generator=gen)
    x.scatter_add_(1, favourites, torch.full((rows, 3), 8.0))
    return x.to(dtype)


def check(got: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, k: int,
          ban_eos: bool, only: torch.Tensor | None, tol: float) -> None:
    """Values as the reference's; columns that hold those values (ties may come in
    another order) and are allowed; -inf slots at PAD."""
    values, columns = got
    want_v, want_c = step_topk.reference(logits, k, ban_eos=ban_eos, only=only)
    assert values.shape == columns.shape == want_v.shape
    torch.testing.assert_close(values, want_v, atol=tol, rtol=tol)
    finite = torch.isfinite(values)
    picked = torch.log_softmax(logits.float(), -1).gather(1, columns)
    torch.testing.assert_close(picked[finite], values[finite], atol=tol, rtol=tol)
    assert (columns[~finite] == PAD_ID).all()
    for row in range(values.size(0)):
        got_set = set(columns[row][finite[row]].tolist())
        assert len(got_set) == int(finite[row].sum())  # no column twice
        assert not got_set & {PAD_ID, BOS_ID}
        if ban_eos and (only is None or only[row] == FREE):
            assert EOS_ID not in got_set
    if logits.dtype == torch.float32:  # no ties in continuous data: the very columns
        assert torch.equal(columns[finite], want_c[finite])


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-6)])
@pytest.mark.parametrize("vocab", [5, 63, 64, 65, 300, 1000, 8003])
@pytest.mark.parametrize("k", [1, 5, 8])
def test_kernel_equals_log_softmax_then_topk(dtype, tol, vocab, k) -> None:
    k = min(k, vocab - 3)  # PAD, BOS and EOS may be banned
    logits = logits_of(7, vocab, dtype)
    for ban_eos in (False, True):
        check(fused(logits, k, ban_eos=ban_eos), logits, k, ban_eos, None, tol)


@needs_kernel
@pytest.mark.parametrize("ban_eos", [False, True])
def test_rows_pinned_to_one_column_or_none(ban_eos) -> None:
    logits = logits_of(6, 500, torch.float32, seed=1)
    only = torch.tensor([FREE, EOS_ID, 7, NONE, FREE, 499])
    got = fused(logits, 8, ban_eos=ban_eos, only=only)
    assert got is not None
    check(got, logits, 8, ban_eos, only, 2e-6)
    assert got[1][1, 0] == EOS_ID and torch.isinf(got[0][1, 1:]).all()
    assert torch.isinf(got[0][3]).all()


@needs_kernel
def test_a_banned_column_that_would_win_is_left_out() -> None:
    """PAD, BOS and EOS far above the rest: the blocks they sit in must still be ranked by
    their allowed columns, and the top k come from elsewhere."""
    logits = logits_of(4, 2000, torch.float32, seed=2)
    logits[:, [PAD_ID, BOS_ID, EOS_ID]] = 50.0
    check(fused(logits, 8, ban_eos=True), logits, 8, True, None, 2e-6)


@needs_kernel
def test_ties_keep_every_column_once() -> None:
    logits = torch.zeros(3, 700)
    logits[:, 100:140] = 1.0  # 40 equal favourites in one block and the next
    values, columns = fused(logits, 8, ban_eos=False)
    assert (columns >= 100).all() and (columns < 140).all()
    assert all(len(set(row.tolist())) == 8 for row in columns)
    torch.testing.assert_close(values, step_topk.reference(logits, 8, ban_eos=False)[0])


@needs_kernel
def test_threads_change_nothing() -> None:
    logits = logits_of(64, 3000, torch.float32, seed=3)
    lib = step_topk.kernel_for(logits, 8)
    one = step_topk.row_topk(lib, logits, 8, ban_eos=True, threads=1)
    two = step_topk.row_topk(lib, logits, 8, ban_eos=True, threads=2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_operands_it_does_not_take_are_left_to_the_caller() -> None:
    logits = logits_of(2, 300, torch.float32)
    assert step_topk.kernel_for(logits.double(), 8) is None
    assert step_topk.kernel_for(logits.t().contiguous().t(), 8) is None
    assert step_topk.kernel_for(logits, step_topk.MAX_K + 1) is None
    assert step_topk.kernel_for(logits[:, :5], 8) is None  # k > V
    assert (step_topk.kernel_for(logits, 8) is not None) == step_topk.enabled()


@pytest.mark.parametrize("case", range(6))
def test_pinned_rows_follow_restrict_then_force(case) -> None:
    """`_pinned`'s `only` allows exactly the columns `_restrict` then `_force` leave finite,
    for every mix of rows at their maximum, forced pieces (EOS, BOS, another, none) and
    the minimum-length ban."""
    gen = torch.Generator().manual_seed(case)
    rows, vocab = 12, 40
    at_max = torch.rand(rows, generator=gen) > 0.5 if case % 2 else None
    choices = torch.tensor([PAD_ID, PAD_ID, EOS_ID, BOS_ID, 7, 11])
    forced = choices[torch.randint(0, 6, (rows,), generator=gen)] if case >= 2 else None
    ban_eos = case in (1, 4, 5)
    log_probs = _restrict(torch.zeros(rows, vocab), at_max, ban_eos)
    if forced is not None:
        log_probs = _force(log_probs, forced)
    only = _pinned(at_max, forced, ban_eos)
    if only is None:
        assert at_max is None and forced is None
        return
    for row in range(rows):
        finite = set(torch.nonzero(torch.isfinite(log_probs[row])).flatten().tolist())
        if only[row] == FREE:
            allowed = set(range(vocab)) - {PAD_ID, BOS_ID} - ({EOS_ID} if ban_eos else set())
            assert finite == allowed
        elif only[row] == NONE:
            assert finite == set()
        else:
            assert finite == {int(only[row])}


def fallback(logits: torch.Tensor, k: int, ban_eos: bool, at_max, forced):
    """The search's path without the kernel."""
    log_probs = _restrict(normalised(logits.clone()), at_max, ban_eos)
    if forced is not None:
        log_probs = _force(log_probs, forced)
    return _row_topk(log_probs, k)


@needs_kernel
def test_kernel_and_fallback_rank_alike_under_every_rule() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = logits_of(10, 900, torch.float32, seed=4)
    at_max = torch.rand(10, generator=gen) > 0.6
    forced = torch.tensor([PAD_ID, PAD_ID, EOS_ID, 9, PAD_ID, BOS_ID, 33, PAD_ID, EOS_ID, 5])
    for ban_eos in (False, True):
        got = fused(logits, 8, ban_eos=ban_eos, only=_pinned(at_max, forced, ban_eos))
        want = fallback(logits, 8, ban_eos, at_max, forced)
        torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=2e-6)
        finite = torch.isfinite(want[0])
        assert torch.equal(got[1][finite], want[1][finite])


@needs_kernel
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
def test_beam_search_finds_the_same_with_the_kernel_and_without(precision, monkeypatch
                                                                ) -> None:
    """Whole searches: prefixes, a minimum length and budgets short enough to end at the
    maximum length; the same hypotheses, scores to float rounding."""
    model = make_model(seed=5).eval().to(precision)
    src = random_batch([9, 4, 7, 12, 3], seed=5)
    max_lens = max_output_lengths(src, 0.0, 6)
    prefix = torch.full((5, 2), PAD_ID)
    prefix[1, :2] = torch.tensor([9, 10])
    prefix[3, 0] = 17

    def search() -> list:
        with torch.inference_mode(), ModelStepDecoder(model, src) as decoder:
            return beam_search(decoder, max_lens, beam=3, alpha=0.6, nbest=2, min_len=3,
                               prefix=prefix)

    fused = search()
    monkeypatch.setattr(step_topk.KERNEL, "library", lambda: None)  # not loaded
    plain = search()
    assert [[h.tokens for h in s] for s in fused] == [[h.tokens for h in s] for s in plain]
    for mine, theirs in zip(fused, plain, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)
    assert fused[1][0].tokens[:2] == [9, 10] and fused[3][0].tokens[0] == 17


def test_without_its_library_search_goes_on_in_silence(tmp_path) -> None:
    """No library built: nothing on stderr, and candidates still ranked."""
    code = (
        "import torch\n"
        "from nmt.inference import step_topk as s\n"
        "from nmt.inference.search import _step_topk\n"
        "print(s.enabled(), s.enabled())\n"
        "print(_step_topk(torch.randn(3, 50), 8, None, None, False)[1].shape)\n")
    out = without_kernels(code, tmp_path)
    assert out == ["False False", "torch.Size([3, 8])"]
