"""Training in bf16 with fp32 master weights: a bf16 copy of the model computes, the fp32
model keeps the weights, the optimizer and everything saved.

Under autocast every micro-batch casts each fp32 weight to bf16 again, one op per weight
and use (482 casts per base micro-batch); NVIDIA's reference Transformer measured that way
of casting about 20 % slower than half-precision weights with fp32 master weights. Here
the casts happen once per update, in one multi-tensor copy (`refresh`, after the optimizer
step), and the micro-batches run on bf16 weights with no autocast at all. The fp32 model
stays what the rest of training sees: Adam steps its weights from its fp32 gradients
(`gather`, one multi-tensor copy per update), checkpoints, the weight average, validation
and resume use it, so nothing saved changes.

On CUDA the copy's linear layers keep their weights transposed (`RowsLinear`): their
gradients then come out in the weights' own layout, with fewer ops per layer.

The bf16 copy's output matrix may have more rows than the vocabulary (`pad_vocab`: a
multiple of 64, the tile of the GPU's matmul kernels). The extra rows are zero, never
looked up and never predicted: the loss leaves their logits out (`vocab` of
nmt/train/loss.py), so their gradient is zero and they are not in the fp32 model at all.

In one process, each micro-batch's backward hands its gradients straight to fp32 buffers
(`backward`: autograd.grad, then one multi-tensor copy or add): the copy's parameters never
get a `.grad`, so autograd runs no accumulation node per parameter (one host op each, 193
of base's 1,100 per micro-batch), and the sum over micro-batches is fp32. Under DDP, whose
all-reduce hooks sit on those accumulation nodes, gradients accumulate in the copy's `.grad`
in bf16 (as fairseq's fp16 does), DDP all-reduces them in bf16, and `gather` moves the sum
to fp32 once per update.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from nmt.model.transformer import Transformer

VOCAB_MULTIPLE = 64  # rows of the padded output matrix: the matmul tile on NVIDIA GPUs


def padded_vocab(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`vocab` rounded up to a multiple of `multiple`."""
    return -(-vocab // multiple) * multiple


class HalfWeights:
    """A bf16 (or fp16) copy of `master` that computes; `master` keeps the fp32 weights."""

    def __init__(self, master: Transformer, dtype: torch.dtype = torch.bfloat16,
                 pad_vocab: bool = False, rows_linears: bool = False) -> None:
        self.master = master
        self.model: Transformer = copy.deepcopy(master).to(dtype)
        self.vocab = master.config.vocab_size
        if pad_vocab and padded_vocab(self.vocab) != self.vocab:
            self._pad_embedding(padded_vocab(self.vocab))
        transposed: set[int] = set()  # ids of the copy's weights stored (in, out)
        if rows_linears:
            for module in self.model.modules():
                if isinstance(module, nn.Linear):
                    RowsLinear.adopt(module)
                    transposed.add(id(module.weight))
        # The copy's parameters in the master's order, and the part of each that the
        # master fills: the padded output matrix's first `vocab` rows (a view), else all.
        self.params = list(self.model.parameters())
        self.master_params = list(master.parameters())
        assert len(self.params) == len(self.master_params)
        self.flipped = [id(q) in transposed for q in self.params]
        self.targets = [self._part(p, q, flip) for p, q, flip in
                        zip(self.master_params, self.params, self.flipped, strict=True)]
        self._grads: list[Tensor] | None = None  # fp32 gradient buffers, kept
        self._sinks: list[Tensor] = []  # the buffers as the copy's gradients are laid out
        self._filled: set[int] = set()  # buffers `backward` wrote this update

    @staticmethod
    def _part(p: Tensor, q: Tensor, flipped: bool) -> Tensor:
        """The view of copy tensor `q` (a parameter or its gradient) that master parameter
        `p` matches: its transpose (a `RowsLinear` weight, `flipped`), its first rows (the
        padded output matrix), or all of it."""
        if flipped:
            return q.t()  # (out, in) view of (in, out)
        if q.shape != p.shape:
            return q[:p.size(0)]  # (vocab, d_model) of (padded, d_model)
        return q

    def _pad_embedding(self, rows: int) -> None:
        """Give the copy's shared embedding/output matrix `rows` rows, the extra ones zero."""
        old = self.model.embed.weight
        new = torch.zeros(rows, old.size(1), dtype=old.dtype, device=old.device)
        new[:old.size(0)] = old.detach()
        self.model.embed.weight = nn.Parameter(new)  # (rows, d_model)

    def refresh(self) -> None:
        """Copy the master weights into the bf16 copy (after each optimizer step and after
        the master was loaded): one multi-tensor copy, no host sync."""
        with torch.no_grad():
            torch._foreach_copy_(self.targets, self.master_params)

    def _buffers(self) -> list[Tensor]:
        """The fp32 gradient buffers, one per master parameter, kept between updates, and
        `_sinks`: each as the copy's gradient is laid out (a transposed view for a
        `RowsLinear` weight), so a micro-batch's gradients go in with no view of their own."""
        if self._grads is None:
            self._grads = [torch.zeros_like(p) for p in self.master_params]
            self._sinks = [g.t() if flip else g for g, flip in zip(self._grads, self.flipped,
                                                                   strict=True)]
        return self._grads

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-batch's `loss` (computed on the copy), its gradients added
        into the fp32 buffers in one multi-tensor op (copied at the update's first use of
        a buffer); `gather` hands them to the master. One process only: DDP's all-reduce
        needs the copy's `.grad` (loss.backward(), then `gather`)."""
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        self._buffers()
        sources = [g if g is None or g.shape == sink.shape else g[:sink.size(0)]
                   for g, sink in zip(grads, self._sinks, strict=True)]  # padded rows out
        fresh = [i for i, g in enumerate(sources) if g is not None and i not in self._filled]
        again = [i for i, g in enumerate(sources) if g is not None and i in self._filled]
        with torch.no_grad():
            for ids, op in ((fresh, torch._foreach_copy_), (again, torch._foreach_add_)):
                if ids:
                    op([self._sinks[i] for i in ids],
                       [sources[i] for i in ids])  # type: ignore[misc]
        self._filled.update(fresh)

    def gather(self) -> None:
        """Put the update's gradients into the master's `.grad` in fp32 and clear the
        copy's: those `backward` summed into the buffers, or those accumulated in the
        copy's `.grad` (loss.backward(), under DDP), copied into the buffers by one
        multi-tensor copy. A parameter without a gradient (unused by every micro-batch)
        gets none."""
        bufs = self._buffers()
        have = [i for i, q in enumerate(self.params) if q.grad is not None]
        if have:
            with torch.no_grad():
                torch._foreach_copy_(
                    [bufs[i] for i in have],
                    [self._part(self.master_params[i], self.params[i].grad,  # type: ignore[arg-type]
                                self.flipped[i]) for i in have])
        for i in sorted(self._filled.union(have)):
            self.master_params[i].grad = bufs[i]
            self.params[i].grad = None
        self._filled.clear()

    def scale_dropout(self, factor: float) -> None:
        """Set the copy's dropout rates as the master's (`Transformer.scale_dropout`)."""
        self.model.scale_dropout(factor)


class RowsLinear(nn.Linear):
    """A linear layer of the bf16 copy, its weight stored transposed, (in, out): y =
    rows @ W + b in one addmm whose backward writes the weight's gradient, rows^T @ grad,
    in the weight's own layout. With nn.Linear's (out, in) weight, autograd makes that
    gradient as a transposed view, which its accumulation then copies into the weight's
    layout (a kernel and a buffer per layer and update), and dispatches three more
    transposes per layer; a Python autograd.Function would do the same copy (its outputs
    cannot be taken over without one)."""

    @staticmethod
    def adopt(linear: nn.Linear) -> None:
        """Make `linear` a RowsLinear in place: its weight transposed, (in, out)."""
        linear.weight = nn.Parameter(linear.weight.detach().t().contiguous())
        linear.__class__ = RowsLinear

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out), over x's rows flattened."""
        rows = x if x.dim() == 2 else x.reshape(-1, x.size(-1))  # (rows, in)
        if self.bias is None:
            out = rows.mm(self.weight)  # (rows, out)
        else:
            out = torch.addmm(self.bias, rows, self.weight)  # (rows, out)
        # 2-D in, the product itself out: an in-place op on it (the FFN's ReLU) then
        # costs autograd no view bookkeeping
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.size(-1))


def use_half_weights(setting: str, device: torch.device, precision: str) -> bool:
    """Whether training computes on a bf16 copy (TrainConfig.half_weights): "on" (bf16
    only), "off", or "auto" = on for bf16 on CUDA, off on a CPU (where autocast's casts
    are a small share of a step and the table's training linears expect fp32 weights)."""
    if precision != "bf16" or setting == "off":
        return False
    return setting == "on" or device.type == "cuda"
