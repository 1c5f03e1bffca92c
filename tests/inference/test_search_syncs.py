"""Host syncs of the searches (nmt/inference/search.py) and of the cache reorders they drive
(nmt/inference/kv_cache.py), counted on a CPU.

On a GPU every read of a device value by the host (`.item()`, `.tolist()`, `bool(t)`,
`nonzero`, `torch.equal`, ...) and every blocking copy of host values to the device waits
for all queued work. A CPU has no such cost, so the CPU-side proxy here counts the torch
calls that would be one (`HostTraffic`) and holds the searches to one read per step (which
sentences are done: no search can go on without learning that), one before the first step
(the length budgets) and two after the last (the results), with no host-to-device copy in
between. The CUDA test at the end counts the real syncs where a GPU is visible.

The other tests pin what the sync-free code relies on: one-sample `torch.multinomial` is
`sample_one`'s draw, the length-penalty table is `length_penalty` bit for bit, and a
reorder told its layout (`regroup`) equals one that finds it out.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers.models import make_model, random_batch
from helpers.plain_cache import PlainCache
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import nmt.inference.search
from nmt.inference.decoding import ModelStepDecoder
from nmt.inference.kv_cache import GroupedCache
from nmt.inference.search import (
    EnsembleStepDecoder,
    FullStepDecoder,
    Hypothesis,
    beam_search,
    greedy_decode,
    length_penalty,
    max_output_lengths,
    prefix_tensor,
    sample_decode,
)
from nmt.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

# Calls that read tensor values on the host (a device-to-host copy and a sync on a GPU).
READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "__complex__",
         "cpu", "numpy", "__array__", "__repr__", "__format__", "equal", "allclose",
         "is_nonzero", "nonzero", "argwhere", "masked_select", "unique",
         "unique_consecutive"}
# torch.multinomial checks its input on the host before drawing: two reads.
READS_INSIDE = {"multinomial": 2}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
FACTORIES_FROM_DATA = {"tensor", "as_tensor", "asarray"}


class HostTraffic(TorchFunctionMode):
    """Records every torch call (Python API level) inside the block that would make a GPU
    wait for the host or the host for the GPU:

    - reads of values (`READS`, `READS_INSIDE`, boolean-mask indexing, `repeat_interleave`
      by a tensor without `output_size`), except of tensors born on the host: made from
      Python numbers without a device, or computed from such tensors only (e.g.
      `length_penalty(7, alpha)`), which a GPU run keeps on the host too;
    - copies of host values to the device: `.to(device)`, `torch.tensor(..., device=)`,
      indexing with a Python list, a Python scalar stored into a single element.

    `events` lists them in order as "read:NAME" / "copy:NAME"; `mark()` records how many
    came before a point (the searches' steps, see `counted`)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.marks: list[int] = []
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> host-born tensor

    def mark(self) -> None:
        self.marks.append(len(self.events))

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        leaves = tree_flatten((args, kwargs))[0]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        host_only = bool(tensors) and all(self._born_on_host(t) for t in tensors)
        for kind, count in self._classify(name, args, kwargs, tensors, host_only):
            self.events.extend([f"{kind}:{name}"] * count)
        out = func(*args, **kwargs)
        born_on_host = (host_only or (not tensors and name in FACTORIES_FROM_DATA
                                      and "device" not in kwargs))
        if born_on_host and name not in ("to", "cuda"):
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    self._host[id(leaf)] = weakref.ref(leaf)
        return out

    def _born_on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    @staticmethod
    def _classify(name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                  host_only: bool) -> Iterator[tuple[str, int]]:
        if name in READS and not host_only:
            yield "read", 1
        if name in READS_INSIDE and not host_only:
            yield "read", READS_INSIDE[name]
        if name == "repeat_interleave" and len(tensors) > 1 and "output_size" not in kwargs:
            yield "read", 1  # tensor repeats: the output size is read back
        if name in ("to", "cuda") and (name == "cuda" or "device" in kwargs or any(
                isinstance(a, torch.device | str | torch.Tensor) for a in args[1:])):
            yield "copy", 1
        if name in FACTORIES_FROM_DATA and "device" in kwargs:
            yield "copy", 1
        if name in INDEXING and len(args) > 1:
            parts = list(args[1]) if isinstance(args[1], tuple) else [args[1]]
            if any(isinstance(part, list) for part in parts):
                yield "copy", 1  # a list index is copied to the device
            if any(isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8)
                   for part in parts):
                yield "read", 1  # a boolean mask: nonzero
            if (name == "__setitem__" and len(args) > 2
                    and isinstance(args[2], bool | int | float)
                    and args[0].__getitem__(args[1]).dim() == 0):
                yield "copy", 1  # a host scalar copied into one element


@contextmanager
def counted(decoder: Any) -> Iterator[HostTraffic]:
    """`HostTraffic` over the block, with `mark()` at every step the decoder is fed."""
    traffic = HostTraffic()
    step, step_rows = decoder.step, getattr(decoder, "step_rows", None)

    def marked_step(tokens: torch.Tensor) -> torch.Tensor:
        traffic.mark()
        return step(tokens)

    def marked_step_rows(tokens: torch.Tensor, rows: torch.Tensor, n_rows: int
                         ) -> torch.Tensor:
        traffic.mark()
        assert step_rows is not None
        return step_rows(tokens, rows, n_rows)

    decoder.step = marked_step
    if step_rows is not None:
        decoder.step_rows = marked_step_rows
    try:
        with traffic:
            yield traffic
    finally:
        decoder.step = step
        if step_rows is not None:
            decoder.step_rows = step_rows


def per_step(traffic: HostTraffic) -> tuple[list[str], list[list[str]], list[str]]:
    """The events before the first step, between each step and the next, after the last."""
    events, marks = traffic.events, traffic.marks
    assert marks, "the decoder was never stepped"
    between = [events[a:b] for a, b in zip(marks, marks[1:], strict=False)]
    return events[: marks[0]], between, events[marks[-1]:]


def assert_one_read_per_step(traffic: HostTraffic, after_last: int = 3) -> None:
    """Before the first step one read (the budgets) and at most one copy to the device (the
    length-penalty table, when not cached yet); at most one read between two steps and
    `after_last` after the last (its own and the results'); no copy after the first step."""
    before, between, after = per_step(traffic)
    copies = [e for e in traffic.events[traffic.marks[0]:] if e.startswith("copy:")]
    assert not copies, f"host-to-device copies in the steps: {copies}"
    assert len([e for e in before if e.startswith("read:")]) <= 1, before
    assert len(before) <= 2, f"before the first step: {before}"
    worst = max(between, key=len, default=[])
    assert len(worst) <= 1, (f"{sum(map(len, between))} reads in {len(between)} steps, "
                             f"up to {worst} in one")
    assert len(after) <= after_last, f"after the last step: {after}"
    assert all(e.startswith("read:") for step in between for e in step)


# Sources of 2..9 pieces: budgets of 4..11 pieces (max_len_b 2), so sentences leave the
# batch at different steps and the decoder is compacted on the way.
LENGTHS = [5, 2, 9, 3, 7, 4, 8, 6, 3, 5]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return make_model(seed=3, dropout=0.0)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = random_batch(LENGTHS, seed=1)  # (10, 9)
    return src, max_output_lengths(src, 1.0, 2, cap=60)


class ShapeLog:
    """Wraps a step decoder to record the rows fed at each step and whether `step_rows`
    (dead groups left in place) or a plain `step` fed them."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.fed: list[tuple[str, int]] = []  # ("step" or "rows", rows the decoder holds)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.fed.append(("step", tokens.numel()))
        return self.decoder.step(tokens)

    def step_rows(self, tokens: torch.Tensor, rows: torch.Tensor, n_rows: int
                  ) -> torch.Tensor:
        self.fed.append(("rows", n_rows))
        return self.decoder.step_rows(tokens, rows, n_rows)

    def __getattr__(self, name: str) -> Any:  # reorder, regroup, reserve
        return getattr(self.decoder, name)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["grouped", "plain", "ensemble"])
def test_beam_search_reads_the_host_once_per_step(model: Transformer, kind: str) -> None:
    """Beam 4, nbest 2, ten sentences leaving at different steps, the decoder compacted:
    one host read per step (was five or more: the EOS column list index and the length
    penalty copied to the device every step, `torch.equal` and `.all()` in every cache
    reorder, `any`, `nonzero` twice, `all` and `tolist` when a sentence finished)."""
    src, max_lens = batch()
    if kind == "ensemble":
        decoder: Any = EnsembleStepDecoder([ModelStepDecoder(model, src),
                                            ModelStepDecoder(make_model(seed=4), src)])
    else:
        decoder = ModelStepDecoder(model, src,
                                   cache=PlainCache if kind == "plain" else GroupedCache)
    log = ShapeLog(decoder)
    with counted(log) as traffic:
        hyps = beam_search(log, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
    assert_one_read_per_step(traffic)
    assert len(traffic.marks) == len(log.fed) > 5
    assert [len(h) for h in hyps] == [2] * len(LENGTHS)
    # The paths exercised: sentences left (dead groups skipped), then a compaction.
    assert any(how == "rows" for how, _ in log.fed)
    sizes = [n for _, n in log.fed]
    assert sizes[0] == len(LENGTHS) and max(sizes) == 4 * len(LENGTHS) > sizes[-1]


@torch.no_grad()
def test_beam_search_with_prefixes_reads_the_host_once_per_step(model: Transformer) -> None:
    """Forced target prefixes (`_force`) read nothing (was `nonzero` every prefix step)."""
    src, max_lens = batch()
    prefixes = [[7, 8, 9], [], [10], [11, 12], [], [13], [], [14, 15, 16], [17], []]
    decoder = ModelStepDecoder(model, src)
    with counted(decoder) as traffic:
        hyps = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=1, min_len=1,
                           prefix=prefix_tensor(prefixes, torch.device("cpu")))
    assert_one_read_per_step(traffic)
    for want, got in zip(prefixes, hyps, strict=True):
        assert got[0].tokens[: len(want)] == want


@torch.no_grad()
@pytest.mark.parametrize("how", ["greedy", "sampling"])
def test_greedy_and_sampling_read_the_host_once_per_step(model: Transformer, how: str
                                                         ) -> None:
    """Greedy and sampling share the restrictions and the prefix forcing; sampling draws
    with `sample_one` (torch.multinomial reads its input back twice a step)."""
    src, max_lens = batch()
    prefix = prefix_tensor([[7, 8], [], [9]] + [[]] * 7, torch.device("cpu"))
    decoder = ModelStepDecoder(model, src)
    with counted(decoder) as traffic:
        if how == "greedy":
            hyps = greedy_decode(decoder, max_lens, alpha=0.6, min_len=1, prefix=prefix)
        else:
            hyps = sample_decode(decoder, max_lens, temperature=1.0, top_k=10, top_p=0.9,
                                 alpha=0.6, min_len=1, prefix=prefix,
                                 generator=torch.Generator().manual_seed(0))
    assert_one_read_per_step(traffic, 3 if how == "greedy" else 4)  # + the NaN check
    assert len(hyps) == len(LENGTHS) and hyps[0].tokens[:2] == [7, 8]


def test_the_counter_sees_what_it_counts() -> None:
    """HostTraffic itself: the reads and copies the old search made are all caught, host-born
    tensors are not."""
    x = torch.zeros(4, 6)
    with HostTraffic() as traffic:
        x[:, [0, 2]] = -1.0  # list index
        x[1, 1] = 2.0  # scalar into one element
        bool((x > 0).any())
        torch.equal(x, x)
        (x[:, 0] > 0).nonzero()
        x[:, 0].tolist()
        length_penalty(3, 0.6).to(x.device)  # computed on the host, then copied
        x[x > 0]  # boolean mask
        torch.multinomial(torch.ones(2, 3), 1)
        float(length_penalty(3, 0.6))  # a host value read on the host: free
        x[:, 1].fill_(0.5)
        x[2] = 1.0  # a row, not one element: a fill on the device
    assert traffic.events == [
        "copy:__setitem__", "copy:__setitem__", "read:__bool__", "read:equal",
        "read:nonzero", "read:tolist", "copy:to", "read:__getitem__", "read:multinomial",
        "read:multinomial"]


# --- What the sync-free code relies on ----------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_sample_one_is_torch_multinomial(seed: int) -> None:
    """The very same draws and generator state as one-sample torch.multinomial, also with
    zero-probability tokens and one-hot rows."""
    from nmt.inference.search import sample_one

    gen = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(37, 300, generator=gen) * 3
    logits[:, :4] = -math.inf
    logits[5, 5:] = -math.inf  # one token left
    probs = torch.softmax(logits, dim=-1)
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(3):
        want = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
        assert torch.equal(sample_one(probs, ours), want)
    assert torch.equal(ours.get_state(), theirs.get_state())
    assert (sample_one(probs, ours)[5] == 4).item()


def test_sampling_nan_distribution_raises() -> None:
    """torch.multinomial refused NaN probabilities; sample_decode still does."""

    class NaNDecoder(FullStepDecoder):
        def step(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.full((tokens.numel(), 8), math.nan)

        def reorder(self, new_order: torch.Tensor) -> None:
            raise AssertionError("sampling never reorders")

    with pytest.raises(ValueError, match="NaN"):
        sample_decode(NaNDecoder(), torch.tensor([3, 2]), temperature=1.0, top_k=0,
                      top_p=1.0, alpha=0.0, min_len=0)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.6, 1.0, 1.3, 2.5])
def test_penalty_table_is_length_penalty_bit_for_bit(alpha: float) -> None:
    """Each entry is `length_penalty(n, alpha)` exactly (a vectorised pow over a tensor of
    lengths differs in the last bit for some: the table must not be built that way)."""
    from nmt.inference.search import penalty_table

    table = penalty_table(alpha, 300, torch.device("cpu"))
    assert table.dtype == torch.float32 and not table.is_inference()
    for n in range(300):
        assert table[n].item() == length_penalty(n, alpha).item(), n


class Reorderer:
    """A step decoder whose `regroup` does not tell the layout: the cache finds each
    order's layout itself."""

    def __init__(self, decoder: ModelStepDecoder) -> None:
        self.step, self.step_rows = decoder.step, decoder.step_rows
        self.reorder, self.reserve = decoder.reorder, decoder.reserve

    def regroup(self, new_order: torch.Tensor, group_size: int,
                source: torch.Tensor | None) -> None:
        self.reorder(new_order)


def flat(hyps: list[list[Hypothesis]]) -> list[tuple[list[int], float, float]]:
    return [(h.tokens, h.score, h.log_prob) for sent in hyps for h in sent]


@torch.no_grad()
@pytest.mark.parametrize("compact_at", [0.0, 0.25, 1.0])
def test_regroup_equals_reorder(model: Transformer, compact_at: float,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Telling the cache each reorder's layout changes nothing, bit for bit, through
    expansion, beam reorders, dead groups and compactions; and every promise the search
    makes is true (NMT_CHECK_LAYOUT verifies each against the order)."""
    monkeypatch.setattr(nmt.inference.search, "COMPACT_AT", compact_at)
    src, max_lens = batch()

    def run(decoder: Any) -> list[list[Hypothesis]]:
        return beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=3, min_len=1)

    told = run(ModelStepDecoder(model, src))
    found = run(Reorderer(ModelStepDecoder(model, src)))
    assert flat(told) == flat(found)
    monkeypatch.setenv("NMT_CHECK_LAYOUT", "1")
    assert flat(run(ModelStepDecoder(model, src))) == flat(told)


@torch.no_grad()
def test_a_false_layout_promise_is_caught(model: Transformer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes that cannot make the promised groups raise ValueError always; an order that
    breaks its promise otherwise raises under NMT_CHECK_LAYOUT (trusted without it)."""
    from nmt.inference.kv_cache import GroupedCache, Regroup

    src, _ = batch()

    def expanded() -> GroupedCache:
        decoder = ModelStepDecoder(model, src[:3])
        decoder.step(torch.full((3,), 2))
        state = decoder.state.reorder(torch.arange(3).repeat_interleave(2))  # g = 2
        assert isinstance(state, GroupedCache) and state.group_size == 2
        return state

    with pytest.raises(ValueError, match="groups of 2"):
        expanded().reorder(torch.arange(4), Regroup(2, None))  # 2 groups, 3 promised
    across = torch.tensor([2, 3, 0, 1, 4, 5])  # groups 0 and 1 swap places
    expanded().reorder(across, Regroup(2, None))  # trusted: no read of the order
    monkeypatch.setenv("NMT_CHECK_LAYOUT", "1")
    with pytest.raises(RuntimeError, match="promised"):
        expanded().reorder(across, Regroup(2, None))
    expanded().reorder(across, Regroup(2, torch.tensor([1, 0, 2])))  # the truth passes


# --- On a GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (none visible on this machine)")
@torch.no_grad()
def test_cuda_beam_search_syncs_once_per_step() -> None:
    """The real count: torch's sync debug mode warns at every synchronizing CUDA call; a
    beam search makes one per step plus three per search (the budgets, the results)."""
    src, max_lens = batch()
    src, max_lens = src.cuda(), max_lens.cuda()
    cuda_model = make_model(seed=3, dropout=0.0).cuda()
    # Warm up (kernels, the cached length-penalty table); encoding syncs once, outside.
    beam_search(ModelStepDecoder(cuda_model, src), max_lens, beam=4, alpha=0.6, nbest=2,
                min_len=1)
    log = ShapeLog(ModelStepDecoder(cuda_model, src))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            beam_search(log, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the per-call warnings count: sync debug mode also warns once that it is a
    # prototype ("Synchronization debug mode is a prototype feature ...").
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) <= len(log.fed) + 3, [str(w.message) for w in syncs[:5]]
