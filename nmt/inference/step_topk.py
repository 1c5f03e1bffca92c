"""A beam-search step's candidates on a CPU in one C call (nmt/kernels/step_topk.c): the
log-softmax and the top k of each row of next-token logits, with the search's banned
columns left out.

Why: PyTorch spends a log_softmax (three passes over the (rows, V) logits, one of them
written), the restriction fills and a top-k (two more passes) per step; the kernel reads
each row twice, once for its maximum and block maxima, once from the L1 cache for the
sum of exponentials, and scans only the k blocks that can hold the top k. Built at
install, loaded for this CPU and checked once per process against PyTorch (nmt/kernels);
where no library applies, `kernel_for` returns None and the search takes PyTorch's path.
"""

from __future__ import annotations

import array
import ctypes

import torch
from torch import Tensor

from nmt import kernels
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID

PARAMS = 14  # the parameter block's length: P_COUNT of the C source's enum
MAX_K = 256  # MAX_K of the C source
MAX_COLUMNS = 4096 * 64  # MAX_BLOCKS * BLOCK of the C source
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FREE, NONE = -1, -2  # `only` entries: the usual rule; no column allowed


def enabled() -> bool:
    """Whether the kernel is built and checked here."""
    return KERNEL.enabled()


def kernel_for(logits: Tensor, k: int) -> ctypes.CDLL | None:
    """The library when `row_topk` can take these logits (rows, V) and k: a CPU tensor
    of a dtype it knows, rows contiguous, 0 < k <= min(MAX_K, V), V <= MAX_COLUMNS, and
    the kernel on; else None (the caller ranks another way)."""
    if (logits.device.type != "cpu" or logits.dtype not in DTYPES or logits.stride(-1) != 1
            or not 0 < k <= min(MAX_K, logits.size(-1)) or logits.size(-1) > MAX_COLUMNS):
        return None
    return KERNEL.library()


def row_topk(lib: ctypes.CDLL, logits: Tensor, k: int, *, ban_eos: bool,
             only: Tensor | None = None, threads: int | None = None
             ) -> tuple[Tensor, Tensor]:
    """The k best allowed columns of each row of `logits` (rows, V) and their
    log-probabilities under the log-softmax over all V columns: values (rows, k) float32,
    best first, and columns (rows, k) long, through `lib` (from `kernel_for`) on
    `threads` threads (default: torch's).

    Allowed: every column but PAD and BOS, and but EOS when `ban_eos`; a row whose `only`
    (rows,) long entry is a column c allows c alone, NONE (-2) none, FREE (-1) the rule
    above. Slots beyond the allowed columns hold -inf and column PAD. Ties among equal
    values come in an unspecified order (as with torch.topk)."""
    rows, vocab = logits.shape
    values = torch.empty(rows, k, dtype=torch.float32)
    columns = torch.empty(rows, k, dtype=torch.long)
    if only is not None:
        only = only.to(torch.long).contiguous()
    params = array.array("q", (
        logits.data_ptr(), rows, vocab, logits.stride(0), DTYPES[logits.dtype], k,
        values.data_ptr(), columns.data_ptr(), 0 if only is None else only.data_ptr(),
        int(ban_eos), PAD_ID, BOS_ID, EOS_ID,
        torch.get_num_threads() if threads is None else threads))
    lib.nmt_step_topk(params.buffer_info()[0])
    return values, columns


def reference(logits: Tensor, k: int, *, ban_eos: bool, only: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
    """What `row_topk` computes, in PyTorch: the definition the kernel is checked against."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (rows, V)
    allowed = torch.ones_like(log_probs, dtype=torch.bool)
    allowed[:, [PAD_ID, BOS_ID]] = False
    if ban_eos:
        allowed[:, EOS_ID] = False
    if only is not None:
        pinned = only != FREE  # (rows,)
        allowed[pinned] = False
        rows = torch.nonzero(only >= 0).squeeze(1)
        allowed[rows, only[rows]] = True
    masked = log_probs.masked_fill(~allowed, float("-inf"))
    values, columns = masked.topk(k, dim=-1)
    return values, columns.masked_fill(values == float("-inf"), PAD_ID)


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel against `reference` on small cases: float32 and bfloat16, a vocabulary
    that is not a multiple of the block, EOS banned, rows pinned to a column or to none."""
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        logits = (torch.randn(5, 300, generator=gen) * 3).to(dtype)
        only = torch.tensor([FREE, EOS_ID, FREE, NONE, 7])
        for ban_eos in (False, True):
            got_v, got_c = row_topk(lib, logits, 6, ban_eos=ban_eos, only=only, threads=1)
            want_v, _ = reference(logits, 6, ban_eos=ban_eos, only=only)
            finite = torch.isfinite(want_v)
            if not torch.equal(finite, torch.isfinite(got_v)):
                return False
            if not torch.allclose(got_v[finite], want_v[finite], atol=tol, rtol=tol):
                return False
            picked = torch.log_softmax(logits.float(), -1).gather(1, got_c)  # (5, 6)
            if not torch.allclose(picked[finite], got_v[finite], atol=tol, rtol=tol):
                return False
    return True


KERNEL = kernels.Kernel("step_topk", "nmt_step_topk", PARAMS, _agrees)
