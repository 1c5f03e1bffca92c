"""Label-smoothed cross-entropy that ignores padding and also reports the plain NLL.

With smoothing eps over a vocabulary of V, the target distribution puts 1 - eps on the gold
token and eps / (V - 1) on every other token (fairseq's `label_smoothed_cross_entropy`).
Both sums are returned un-normalised so the caller can divide by the number of target
tokens of the whole update (all micro-batches, all ranks).

The (rows, V) logits are the biggest activation of a training step, so the loss is one
autograd function with the minimum of (rows, V) work: the forward runs one log_softmax
(in fp32), a gather and a row sum, and keeps only the log-probabilities; the backward
writes the gradient `softmax - (1 - eps - eps_i) * onehot - eps_i` once, in the logits'
dtype. On a CPU both go block by block of rows, in cache. Autograd through log_softmax +
gather + sum + masked_fill instead allocates several more (rows, V) tensors. The training
loop also projects only the non-PAD target positions (`target_positions` + the model's
`select`), so padding costs nothing in the output projection or the loss.

`projected_smoothed_loss` goes one step further (for GPUs, where the (rows, V) fp32
round trips cost more than the matmuls): it takes the decoder features and the output
matrix, runs projection + loss chunk by chunk over rows, keeps only each row's logsumexp,
and recomputes each chunk's logits in backward to write grad_features and grad_weight
directly. No (rows, V) tensor ever exists; `label_smoothed_nll` stays as its reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt.model.paths import cpu_path


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row smoothed loss and NLL of (N, V) logits; rows with weight 0 are ignored.

    On a CPU the rows go through in blocks of about `CPU_BLOCK_BYTES` of fp32 (`_blocks`),
    so each block's cast, log_softmax, sums, and in backward its softmax and gradient
    passes, reuse data still in the core's cache: only the logits are read from memory
    and the log-probabilities (forward) or the gradient (backward) written to it, instead
    of some five full (N, V) passes each way. Each row's numbers are the same either way.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, weight: Tensor | None,
                epsilon: float) -> tuple[Tensor, Tensor]:
        vocab = logits.size(-1)
        eps_i = epsilon / (vocab - 1)
        dtype = _compute_dtype(logits)
        if not cpu_path(logits):  # one kernel, reading half-precision logits as is
            lprobs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V)
            smooth = lprobs.sum(-1) if epsilon != 0.0 else None  # (N,) sum_v log p_v
        else:
            lprobs = torch.empty(logits.shape, dtype=dtype, device=logits.device)  # (N, V)
            smooth = torch.empty(logits.size(0), dtype=dtype, device=logits.device)  # (N,)
            for rows in _blocks(logits):
                # (n, V) log-probabilities in fp32 (fp64 for fp64 logits), written in place
                torch.ops.aten._log_softmax.out(logits[rows].to(dtype), -1, False,
                                                out=lprobs[rows])
                if epsilon != 0.0:
                    torch.sum(lprobs[rows], -1, out=smooth[rows])  # (n,) sum_v log p_v
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
        if weight is not None:
            weight = weight.to(lprobs.dtype)
            nll = nll * weight
        if epsilon == 0.0:
            loss = nll.sum()
        else:
            assert smooth is not None
            smooth = -smooth
            if weight is not None:
                smooth = smooth * weight
            loss = (1.0 - epsilon - eps_i) * nll.sum() + eps_i * smooth.sum()
        # Only log-probabilities are kept (the logits can be freed): exp gives the softmax.
        ctx.save_for_backward(lprobs, target, weight)
        ctx.coef = (1.0 - epsilon - eps_i, eps_i)
        ctx.logits_dtype = logits.dtype
        return loss, nll.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor
                 ) -> tuple[Tensor, None, None, None]:
        lprobs, target, weight = ctx.saved_tensors
        gold, eps_i = ctx.coef
        # d loss / d logits = g * (softmax - gold * onehot - eps_i), built block by block
        # in fp32 and written once in the logits' dtype (a fresh buffer: lprobs is kept,
        # backward may run again).
        scale = grad_loss if weight is None else grad_loss * weight[:, None]  # () or (N, 1)
        gold_scale = (scale * -gold).to(lprobs.dtype).expand(target.size(0), 1)  # (N, 1)
        grad = torch.empty(lprobs.shape, dtype=ctx.logits_dtype, device=lprobs.device)
        same = grad.dtype == lprobs.dtype  # fp32 logits: work in grad itself, no copy
        for rows in _blocks(lprobs):
            # (n, V) softmax, then the gradient in place
            block = torch.exp(lprobs[rows], out=grad[rows]) if same else lprobs[rows].exp()
            block_scale = scale if scale.dim() == 0 else scale[rows]
            block.mul_(block_scale)
            if eps_i:
                block.sub_(block_scale * eps_i)
            block.scatter_add_(-1, target[rows, None], gold_scale[rows])
            if not same:
                grad[rows] = block
        # The NLL output is a detached statistic; its gradient (always zero here) is ignored.
        return grad, None, None, None


# Rows per block of the CPU loss: about this many bytes of fp32 (N, V) data, so a block's
# passes stay in a core's L2 (2 MB on recent Intel server cores).
CPU_BLOCK_BYTES = 1 << 20


def _blocks(rows_by_vocab: Tensor) -> list[slice]:
    """Row slices of an (N, V) tensor: blocks of about CPU_BLOCK_BYTES of fp32 on a CPU,
    all rows at once elsewhere (a GPU streams the whole tensor in one kernel)."""
    n, vocab = rows_by_vocab.shape
    if not cpu_path(rows_by_vocab):
        return [slice(0, n)]
    step = max(1, CPU_BLOCK_BYTES // (4 * vocab))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for half-precision logits (softmax sums need the range), else their own."""
    return torch.promote_types(logits.dtype, torch.float32)


def smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float,
                           weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) of `logits` (N, V) against `target` (N,), fp32 scalars.

    `weight` (N,) of 0/1 masks rows out (padding); None counts every row. The NLL is a
    detached statistic.
    """
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, weight, float(epsilon))
    return loss, nll.detach()


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float,
                       pad_id: int) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) over non-PAD positions, both fp32 scalars.

    logits: (..., V) in any float dtype; target: (...) int64 with `pad_id` at padding.
    """
    flat_logits = logits.reshape(-1, logits.size(-1))  # (B*T, V)
    flat_target = target.reshape(-1)  # (B*T,)
    keep = flat_target.ne(pad_id).to(_compute_dtype(logits))  # (B*T,) 1 at real tokens
    return smoothed_cross_entropy(flat_logits, flat_target, epsilon, keep)


def target_positions(tgt_lengths: np.ndarray, width: int) -> np.ndarray | None:
    """Flat indices into (batch * width) of the real (non-PAD) target positions of a
    right-padded batch whose rows hold `tgt_lengths` tokens (EOS included); None when no
    row is padded. Computed on the host, so selecting them costs no device sync."""
    lengths = np.asarray(tgt_lengths, dtype=np.int64)
    if lengths.min() == width:
        return None
    starts = np.arange(lengths.size, dtype=np.int64) * width  # (batch,)
    ends = np.cumsum(lengths)  # (batch,) position after each row in the packed order
    offsets = np.repeat(starts - (ends - lengths), lengths)  # (n_real,)
    return np.arange(int(ends[-1]), dtype=np.int64) + offsets


# ----- output projection + loss, chunked over rows -----

# Rows per chunk: a (chunk, V) block of logits is the largest temporary. 1024 x 37,000 is
# 145 MiB of fp32 softmax plus 72 MiB of bf16 logits: small next to a step's activations,
# large enough that each chunk's matmuls still run at full speed.
DEFAULT_CHUNK_ROWS = 1024


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """Smoothed loss and NLL of `features @ weight.T` without an (N, V) tensor.

    Forward keeps per-row logsumexp only; backward recomputes each chunk's logits, turns
    them into the logit gradient in place and multiplies it straight into grad_features
    (N, d) and grad_weight (V, d).
    """

    @staticmethod
    def forward(ctx: Any, features: Tensor, weight: Tensor, target: Tensor,
                row_weight: Tensor | None, epsilon: float, chunk_rows: int,
                dtype: torch.dtype, compiled: bool, vocab: int) -> tuple[Tensor, Tensor]:
        stats = _compiled()[0] if compiled else _chunk_stats
        eps_i = epsilon / (vocab - 1)
        stat = torch.promote_types(dtype, torch.float32)  # softmax statistics
        with _no_autocast(features):
            x = features.to(dtype)  # (N, d) matmul operand, saved for backward
            w = weight.to(dtype)  # (V, d)
            rows = x.size(0)
            lse = x.new_empty(rows, dtype=stat)  # (N,)
            nll = x.new_empty(rows, dtype=stat)  # (N,)
            smooth = None
            if eps_i:  # -sum_v log p_v = V * lse - sum_v z_v, and sum_v z_v = x . sum_v w_v
                # (N,) without a (N, V) pass; padded rows of w are zero
                smooth = -(x.to(stat) @ w.sum(0, dtype=stat))
            for start in range(0, rows, chunk_rows):
                end = min(start + chunk_rows, rows)
                logits = x[start:end] @ w.t()  # (chunk, V_padded) in the compute dtype
                # (chunk,) each, over the vocabulary's own columns
                lse[start:end], gold = stats(logits[:, :vocab], target[start:end])
                nll[start:end] = lse[start:end] - gold
            if smooth is not None:
                smooth += vocab * lse
            if row_weight is not None:
                row_weight = row_weight.to(stat)
                nll = nll * row_weight
                if smooth is not None:
                    smooth = smooth * row_weight
            nll_sum = nll.sum()
            # Two distinct tensors: returning one object twice would route its gradient
            # to the NLL output, which backward ignores.
            loss = nll_sum.clone() if smooth is None else (
                (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth.sum())
        ctx.save_for_backward(x, w, target, row_weight, lse)
        ctx.coef = (1.0 - epsilon - eps_i, eps_i)
        ctx.chunk_rows = chunk_rows
        ctx.compiled = compiled
        ctx.vocab = vocab
        ctx.dtypes = (features.dtype, weight.dtype)
        return loss, nll_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor
                 ) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None, None,
                            None]:
        x, w, target, row_weight, lse = ctx.saved_tensors
        logit_grad = _compiled()[1] if ctx.compiled else _chunk_grad_inplace
        gold, eps_i = ctx.coef
        features_dtype, weight_dtype = ctx.dtypes
        need_x, need_w = ctx.needs_input_grad[:2]
        rows, stat = x.size(0), lse.dtype
        scale = grad_loss.to(stat).expand(rows)  # (N,) d loss / d row loss
        if row_weight is not None:
            scale = scale * row_weight
        with _no_autocast(x):
            grad_x = x.new_empty(x.shape, dtype=features_dtype) if need_x else None  # (N, d)
            # grad_weight sums over chunks: accumulated in fp32 (or the weight's own wider
            # dtype), then returned in the weight's dtype.
            acc_dtype = torch.promote_types(weight_dtype, stat)
            grad_w = None
            for start in range(0, rows, ctx.chunk_rows):
                end = min(start + ctx.chunk_rows, rows)
                s = scale[start:end, None]  # (chunk, 1)
                logits = x[start:end] @ w.t()  # (chunk, V_padded) again, compute dtype
                g = logit_grad(logits, lse[start:end], s, target[start:end], gold, eps_i)
                if ctx.vocab < g.size(1):  # padded columns: never predicted, no gradient
                    g[:, ctx.vocab:] = 0
                if grad_x is not None and grad_x.dtype == g.dtype:
                    torch.mm(g, w, out=grad_x[start:end])  # (chunk, d)
                elif grad_x is not None:
                    grad_x[start:end] = g @ w  # (chunk, d), cast to the features' dtype
                if need_w:
                    part = g.t() @ x[start:end]  # (V, d)
                    if grad_w is None:
                        grad_w = part.to(acc_dtype)
                    else:
                        grad_w += part
        if need_w and grad_w is None:  # no rows at all
            grad_w = w.new_zeros(w.shape, dtype=acc_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight_dtype)
        # The NLL output is a detached statistic; its gradient is ignored, as in the reference.
        return grad_x, grad_w, None, None, None, None, None, None, None


def _chunk_stats(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp, gold logit) of each row of a (chunk, V) block, in fp32 (or fp64)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (chunk, V)
    return torch.logsumexp(z, dim=-1), z.gather(-1, target[:, None]).squeeze(-1)


def _chunk_grad_inplace(logits: Tensor, lse: Tensor, scale: Tensor, target: Tensor,
                        gold: float, eps_i: float) -> Tensor:
    """d loss / d logits of a (chunk, V) block, scale * (softmax - eps_i - gold * onehot),
    in the logits' dtype; eager: built in one fp32 buffer in place (`logits` itself when it
    is fp32: it is a temporary of the caller)."""
    g = logits.to(lse.dtype)  # (chunk, V)
    g.sub_(lse[:, None]).exp_().mul_(scale)  # softmax * scale
    if eps_i:
        g.sub_(scale * eps_i)
    g.scatter_add_(-1, target[:, None], scale * -gold)
    return g.to(logits.dtype)


def _chunk_grad_pointwise(logits: Tensor, lse: Tensor, scale: Tensor, target: Tensor,
                          gold: float, eps_i: float) -> Tensor:
    """The same gradient as one pointwise expression (a one-hot by comparison, not a
    scatter), which torch.compile turns into a single kernel that reads the logits and
    writes the gradient once."""
    z = logits.to(lse.dtype)  # (chunk, V)
    g = torch.exp(z - lse[:, None]) * scale - scale * eps_i
    hit = torch.arange(z.size(-1), device=z.device) == target[:, None]  # (chunk, V)
    return torch.where(hit, g - scale * gold, g).to(logits.dtype)


@functools.cache
def _compiled() -> tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., Tensor]]:
    """torch.compile'd per-chunk statistics and gradient (compiled once per process, with
    dynamic shapes: the last chunk and every batch have their own row count)."""
    return (torch.compile(_chunk_stats, dynamic=True),
            torch.compile(_chunk_grad_pointwise, dynamic=True))


def _no_autocast(like: Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for `like`'s device type: the function picks its own dtypes."""
    return torch.autocast(device_type=like.device.type, enabled=False)


def matmul_dtype(features: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the output projection runs in: autocast's for the device when it is on
    (what F.linear would use; autocast leaves fp64 alone), else the wider of the two
    operands' dtypes."""
    widest = torch.promote_types(features.dtype, weight.dtype)
    if widest == torch.float64:
        return widest
    device = features.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return widest


def projected_smoothed_loss(features: Tensor, weight: Tensor, target: Tensor,
                            epsilon: float, pad_id: int | None = None,
                            chunk_rows: int = DEFAULT_CHUNK_ROWS,
                            compiled: bool = False, vocab: int | None = None
                            ) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) of the logits `features @ weight.T`, never built whole.

    Equal to `label_smoothed_nll(F.linear(features, weight), target, epsilon, pad_id)`
    (the same smoothing: 1 - eps on the gold token, eps / (V - 1) elsewhere), but only a
    (chunk_rows, V) block of logits exists at a time, forward and backward; the backward
    recomputes it and writes grad_features and grad_weight directly. Matmuls run in the
    autocast dtype when autocast is on (else the inputs' dtype), softmax statistics in
    fp32 (fp64 for fp64 inputs).

    features: (..., d) decoder outputs; weight: (V, d) the shared output matrix;
    target: (...) int64; rows whose target is `pad_id` count for nothing (None: every row
    counts). Both results are fp32 (or fp64) scalars; the NLL is a detached statistic.

    `compiled` runs each chunk's softmax statistics and logit gradient as torch.compile'd
    kernels (fused: the logits are read once and the gradient written once, in the compute
    dtype); the first call compiles them (seconds). The matmuls stay torch's.

    `vocab`: the vocabulary's size where `weight` has more rows (padded to a multiple of
    64 for the GPU's matmul tiles, zero): the logits of the rows past it are left out of
    the softmax and get no gradient. None: every row of `weight` is a word.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    flat = features.reshape(-1, features.size(-1))  # (N, d)
    flat_target = target.reshape(-1)  # (N,)
    if flat.size(0) != flat_target.size(0):
        raise ValueError(f"{flat.size(0)} feature rows but {flat_target.size(0)} targets")
    dtype = matmul_dtype(flat, weight)
    keep = None
    if pad_id is not None:
        keep = flat_target.ne(pad_id).to(torch.promote_types(dtype, torch.float32))  # (N,)
    loss, nll = _ProjectedSmoothedCrossEntropy.apply(flat, weight, flat_target, keep,
                                                     float(epsilon), int(chunk_rows), dtype,
                                                     bool(compiled),
                                                     weight.size(0) if vocab is None else vocab)
    return loss, nll.detach()


def fused_loss_enabled(choice: str, device: torch.device) -> bool:
    """Whether training uses `projected_smoothed_loss` (TrainConfig.fused_loss): "on",
    "off", or "auto" = on for CUDA, where not materialising the (rows, vocab) logits saves
    memory at no loss of speed, off for a CPU, where recomputing the logits in the backward
    costs time (docs/training.md, "GPU levers")."""
    if choice == "auto":
        return device.type == "cuda"
    return choice == "on"
