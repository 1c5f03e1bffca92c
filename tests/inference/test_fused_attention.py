"""The decoder step's C attention kernel (nmt/model/fused_attention.py) against PyTorch's
ops: every shape, dtype, mask and thread count a search meets; its build cached and its
absence harmless."""

from __future__ import annotations

import pytest
import torch
from helpers.native import without_kernels

from nmt.inference import fused_attention
from nmt.inference.layer_step import additive_mask, attend_entries, attend_one

pytestmark = pytest.mark.isa  # compiled for the vector ISA in use: CI runs these at AVX2 too

needs_kernel = pytest.mark.skipif(not fused_attention.enabled(),
                                  reason="no C compiler here: the kernel cannot be built")


def reference(q, k_t, v, mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in float64."""
    scores = q.double() @ k_t.double() * q.size(-1) ** -0.5
    if mask is not None:
        scores = scores + mask.double()
    return scores.softmax(-1) @ v.double()


def operands(b: int, heads: int, g: int, length: int, d: int, dtype: torch.dtype,
             masked: str, seed: int = 0):
    """q as a strided view (the fused QKV split), keys stored (.., len, d) and handed over
    transposed, values, and a mask: none, a per-query slot mask (the grouped cache's) or a
    per-entry padding mask (the encoder's), additive in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, g, 3 * heads * d, generator=gen).to(dtype)
    q = qkv[..., : heads * d].view(b, g, heads, d).transpose(1, 2)  # (b, heads, g, d)
    keys = torch.randn(b, heads, length, d, generator=gen).to(dtype)
    v = torch.randn(b, heads, length, d, generator=gen).to(dtype)
    mask = None
    if masked == "slots":
        allowed = torch.rand(b, 1, g, length, generator=gen) > 0.6
        allowed[..., -1] = True  # the newest position: always the row's own
        mask = additive_mask(allowed, dtype)  # (b, 1, g, len)
    elif masked == "padding":
        lengths = torch.randint(1, length + 1, (b,), generator=gen)
        allowed = (torch.arange(length) < lengths[:, None])[:, None, None, :]
        mask = additive_mask(allowed, dtype)  # (b, 1, 1, len)
    return q, keys.transpose(-1, -2), v, mask


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("masked", ["none", "slots", "padding"])
@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 64, 203])
def test_kernel_equals_the_softmax_written_out(dtype, tol, masked, length) -> None:
    q, k_t, v, mask = operands(5, 4, 4, length, 64, dtype, masked)
    assert fused_attention.applies(q, k_t, v, mask)
    got = attend_one(q, k_t, v, mask)  # the kernel
    assert got.shape == (5, 4, 4, 64) and got.dtype == dtype
    want = reference(q, k_t, v, mask)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # the merge of the heads after it is a view, not a copy
    assert got.transpose(1, 2).is_contiguous()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_pytorchs_path(dtype, monkeypatch) -> None:
    """The same operands through the kernel and through PyTorch's ops (the path without
    it): equal to float rounding."""
    q, k_t, v, mask = operands(7, 8, 4, 37, 64, dtype, "slots", seed=3)
    fused = attend_one(q, k_t, v, mask)
    monkeypatch.setattr(fused_attention.KERNEL, "library", lambda: None)  # not loaded
    assert not fused_attention.applies(q, k_t, v, mask)
    plain = attend_one(q, k_t, v, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), plain.float(), atol=tol, rtol=tol)


@needs_kernel
def test_threads_give_the_same_bits() -> None:
    """Each (entry, head) is one thread's whole work, so the thread count cannot change a
    bit of the output: workers and threads translate alike."""
    q, k_t, v, mask = operands(16, 4, 4, 40, 64, torch.float32, "slots", seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend_one(q, k_t, v, mask)
        torch.set_num_threads(2)
        two = attend_one(q, k_t, v, mask)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_a_hidden_key_is_never_read() -> None:
    """Keys the mask hides do not enter the result, even when they hold NaN (the grouped
    cache's slots of other hypotheses may hold anything)."""
    q, k_t, v, _ = operands(2, 2, 4, 9, 64, torch.float32, "none", seed=7)
    allowed = torch.zeros(2, 1, 4, 9, dtype=torch.bool)
    allowed[..., :4] = True
    mask = additive_mask(allowed, torch.float32)
    poisoned_k, poisoned_v = k_t.clone(), v.clone()
    poisoned_k[..., 4:] = float("nan")
    poisoned_v[..., 4:, :] = float("nan")
    got = attend_one(q, poisoned_k, poisoned_v, mask)
    want = reference(q[..., :], k_t[..., :4], v[..., :4, :], None)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def test_operands_it_cannot_take_go_to_pytorch() -> None:
    """Keys transposed in memory, a boolean mask or float64: PyTorch's path, same result."""
    q, k_t, v, mask = operands(3, 2, 4, 11, 64, torch.float32, "slots")
    contiguous_t = k_t.contiguous()  # transposed in memory: d not contiguous
    assert not fused_attention.applies(q, contiguous_t, v, mask)
    boolean = mask == 0
    assert not fused_attention.applies(q, k_t, v, boolean)
    want = reference(q, k_t, v, mask)
    for got in (attend_one(q, contiguous_t, v, mask), attend_one(q, k_t, v, boolean)):
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    assert not fused_attention.applies(q.double(), k_t.double(), v.double(), None)
    per_head = mask.expand(-1, 2, -1, -1).contiguous()  # a mask that differs by head
    assert not fused_attention.applies(q, k_t, v, per_head)
    torch.testing.assert_close(attend_one(q, k_t, v, per_head).double(), want,
                               atol=2e-6, rtol=2e-6)


def test_without_its_library_decoding_goes_on_in_silence(tmp_path) -> None:
    """No library built: nothing on stderr, and attention still computed (PyTorch's path)."""
    code = (
        "import torch\n"
        "from nmt.inference import fused_attention as f\n"
        "from nmt.inference.layer_step import attend_one\n"
        "q, k, v = torch.randn(2, 2, 4, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)\n"
        "print(f.enabled(), f.enabled())\n"
        "print(attend_one(q, k.contiguous().transpose(-1, -2), v, None).shape)\n")
    out = without_kernels(code, tmp_path)
    assert out == ["False False", "torch.Size([2, 2, 4, 64])"]


@needs_kernel
def test_its_first_use_may_come_under_autocast() -> None:
    """Validation during bf16 training decodes under autocast: the load-time check must
    not be computed (and fail) in bf16 there."""
    fused_attention.KERNEL.forget()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        assert fused_attention.enabled()
    assert fused_attention.enabled()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", ["slots", "padding", "none"])
def test_an_entry_list_reads_those_entries_in_place(dtype, masked, monkeypatch) -> None:
    """With `entries`, query entry i attends over cache entry entries[i] (keys, values and
    mask), the others never read: bit for bit what the whole batch gives those entries,
    even where the skipped entries hold NaN; any other PyTorch path gathers them first."""
    q, k_t, v, mask = operands(6, 4, 4, 13, 64, dtype, masked, seed=11)
    whole = attend_one(q, k_t, v, mask)  # (6, heads, g, d)
    entries = torch.tensor([4, 1, 5])
    poisoned_k, poisoned_v = k_t.clone(), v.clone()
    for e in (0, 2, 3):
        poisoned_k[e], poisoned_v[e] = float("nan"), float("nan")
    got = fused_attention.attend(q[entries], poisoned_k, poisoned_v, mask, entries)
    assert got is not None and torch.equal(got, whole[entries])
    rows = q[entries].transpose(1, 2).reshape(12, 1, 4 * 64)  # the fed rows (e * g, 1, ...)
    want = whole[entries].transpose(1, 2).reshape(12, 1, 4 * 64)
    assert torch.equal(attend_entries(rows, poisoned_k, poisoned_v, mask, entries, 4), want)
    with monkeypatch.context() as patch:  # PyTorch's path (no kernel): gathered first
        patch.setattr(fused_attention.KERNEL, "library", lambda: None)
        gathered = attend_entries(rows, poisoned_k, poisoned_v, mask, entries, 4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gathered.float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="entries"):
        fused_attention.attend(q[entries], k_t, v, mask, entries.int())
