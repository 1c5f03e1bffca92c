"""The CPU decoder step's attention as one C kernel (nmt/kernels/fused_attention.c).

Why: a step's attention in eager PyTorch is 6-8 dispatched ops per layer (scale, scores'
matmul, mask, softmax, the values' matmul, the copies around them), each a pass over
memory, and torch's batched matmul calls one small GEMM per (sentence, head) when the
cache's history is a strided view. The kernel does it in one call and one pass, skipping
the keys a mask hides (docs/performance.md has the measurements).

How: built at install, loaded for this CPU and checked once per process against the
PyTorch path on a small case (nmt/kernels); where no library applies, the PyTorch path runs
(the same results to float rounding).
"""

from __future__ import annotations

import array
import ctypes

import torch
from torch import Tensor

from nmt import kernels

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PARAMS = 30  # the parameter block's length: P_COUNT of the C source's enum


def enabled() -> bool:
    """Whether the kernel is built and checked here."""
    return KERNEL.enabled()


def keys_layout(keys: Tensor) -> Tensor:
    """The encoder's keys (b, heads, len, d_k) as `attend_one` reads them best, returned
    transposed (b, heads, d_k, len): stored as they are (d contiguous) where the kernel
    runs, else transposed in memory (the PyTorch path's matmul reads contiguous
    matrices)."""
    if keys.device.type == "cpu" and keys.dtype in DTYPES and enabled():
        return keys.contiguous().transpose(-1, -2)
    return keys.transpose(-1, -2).contiguous()


def applies(q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether `attend` takes these operands (see there) instead of returning None."""
    return _kernel_for(q, k_t, v, mask) is not None


def attend(q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None,
           entries: Tensor | None = None) -> Tensor | None:
    """softmax(q k^T / sqrt(d_k) + mask) v for q (b, heads, g, d_k), keys given
    transposed k_t (b, heads, d_k, len) (stored (b, heads, len, d_k)), v (b, heads, len,
    d_v), `mask` None or additive (0 / -inf) broadcastable to (b, 1, g, len). With
    `entries` (b',) long, q has b' entries and q's entry i reads entry entries[i] of the
    keys, values and mask (the sentences a step still feeds, the others left in place).
    Returns (b or b', heads, g, d_v) as a view of a (b or b', g, heads, d_v) tensor, so that
    merging the heads is a free reshape; None when the kernel cannot take the operands
    without copying (see `_kernel_for`) or is off: then the caller computes it another
    way."""
    lib = _kernel_for(q, k_t, v, mask)
    if lib is None:
        return None
    if entries is not None and not (entries.dtype == torch.long and entries.is_contiguous()
                                    and entries.shape == q.shape[:1] and entries.is_cpu):
        raise ValueError(f"attend: entries must be ({q.size(0)},) long on the CPU, "
                         f"got {tuple(entries.shape)} {entries.dtype}")
    return _run(lib, q, k_t, v, mask, torch.get_num_threads(), entries)


def _kernel_for(q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None
                ) -> ctypes.CDLL | None:
    """The library when it can take these operands as they are: CPU, one dtype it knows,
    vectors contiguous along d, an additive (not boolean) mask the same for every head;
    and the kernel on."""
    if q.device.type != "cpu" or q.dtype not in DTYPES:
        return None
    if k_t.dtype != q.dtype or v.dtype != q.dtype or q.stride(-1) != 1:
        return None
    if k_t.stride(-2) != 1 or v.stride(-1) != 1:
        return None
    if mask is not None and (mask.dtype != q.dtype or mask.dim() != 4 or mask.size(1) != 1):
        return None
    return KERNEL.library()


def _run(lib: ctypes.CDLL, q: Tensor, k_t: Tensor, v: Tensor, mask: Tensor | None,
         threads: int, entries: Tensor | None = None) -> Tensor:
    """`attend` through `lib` on `threads` threads."""
    b, heads, g, d = q.shape
    length, dv = k_t.size(-1), v.size(-1)
    out = torch.empty(b, g, heads, dv, dtype=q.dtype)  # (b, g, heads, d_v)
    view = out.transpose(1, 2)  # (b, heads, g, d_v)
    keys = k_t.transpose(-1, -2)  # (b, heads, len, d_k), d contiguous
    if mask is None:
        m_addr, m_strides = 0, (0, 0, 0)
    else:
        full = mask.expand(k_t.size(0), 1, g, length)  # zero strides where broadcast
        entry, _, query, position = full.stride()
        m_addr, m_strides = full.data_ptr(), (entry, query, position)
    params = array.array("q", (
        q.data_ptr(), keys.data_ptr(), v.data_ptr(), m_addr, out.data_ptr(),
        b, heads, g, length, d, dv,
        *q.stride()[:3], *keys.stride()[:3], *v.stride()[:3], *m_strides,
        *view.stride()[:3],
        DTYPES[q.dtype], threads, kernels.float_bits(d ** -0.5),
        0 if entries is None else entries.data_ptr()))
    if lib.nmt_attention(params.buffer_info()[0]) != 0:
        raise MemoryError("fused attention: no memory for its scratch rows")
    return view


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel against the written-out softmax on a small masked case, float32 and
    bfloat16 (the grouped cache's shapes: 3 entries, 2 heads, 4 queries, 9 keys)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(3, 4, 2, 64, generator=gen).transpose(1, 2).to(dtype)  # (3, 2, 4, 64)
        keys = torch.randn(3, 2, 9, 64, generator=gen).to(dtype)  # (b, heads, len, d)
        v = torch.randn(3, 2, 9, 64, generator=gen).to(dtype)
        allowed = torch.rand(3, 1, 4, 9, generator=gen) > 0.4
        allowed[..., 0] = True  # every query sees a key
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        scores = (q.float() @ keys.float().transpose(-1, -2)) * 64 ** -0.5 + mask.float()
        want = scores.softmax(-1) @ v.float()  # (3, 2, 4, 64)
        got = _run(lib, q, keys.transpose(-1, -2), v, mask, 1)
        if not torch.allclose(got.float(), want, atol=tol, rtol=tol):
            return False
    return True


KERNEL = kernels.Kernel("fused_attention", "nmt_attention", PARAMS, _agrees)
