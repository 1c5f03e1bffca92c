"""Inference-only linear layers on nmt's C linear kernels (nmt/kernels/amx_linear.c,
avx2_linear.c), one class for all of them.

Why: these kernels are compiled at install and serve every shape (oneDNN compiles per row
count), quantize int8 activations per row, and the native decoder step calls them by
address (`c_entry`). What differs between them is data, a `KernelSpec`: the kernel's
library, its dtypes, the input width it takes and how it packs a weight. The specs are
defined beside their kernels (amx_linear.py, avx2_linear.py); nmt/inference/backends.py
decides where each runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt import kernels
from nmt.inference.int8_linear import quantize_weight


@dataclass(frozen=True)
class KernelSpec:
    """One C linear kernel as a layer sees it."""

    name: str  # what errors and extra_repr call it
    kernel: kernels.Kernel  # its library and C entry
    dtype: torch.dtype  # activations in and out: bfloat16, or float32 (int8 kernels)
    k_step: int  # in_features must be a multiple of this
    op: int  # the entry's op that computes a layer
    pack: Callable[[ctypes.CDLL, Tensor], Tensor]  # (out, in) weight -> the kernel's layout
    works: Callable[[], bool]  # whether it runs here (loaded and checked)
    int8: bool  # int8 weights with per-output scales, activations quantized per row

    def fits(self, weight: Tensor) -> bool:
        """Whether the kernel takes this (out, in) weight: 2-D, in a multiple of k_step."""
        return weight.dim() == 2 and weight.size(1) % self.k_step == 0 and weight.size(0) > 0


def run(spec: KernelSpec, lib: ctypes.CDLL, x: Tensor, packed: Tensor, n: int,
        bias: Tensor | None, threads: int, scale: Tensor | None = None) -> Tensor:
    """x (..., K) in `spec.dtype` times the weight packed by `spec.pack` (n outputs, int8
    ones with `scale` (n,)), plus `bias`: (..., n) in `spec.dtype`."""
    k = x.size(-1)
    rows = x.reshape(-1, k)  # (M, K); a view where x's rows are evenly spaced
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.size(0), n, dtype=spec.dtype)  # (M, N)
    status = kernels.call_linear(getattr(lib, spec.kernel.entry), spec.op, x=rows.data_ptr(),
                                 m=rows.size(0), k=k, ldx=rows.stride(0), w=packed.data_ptr(),
                                 n=n, bias=0 if bias is None else bias.data_ptr(),
                                 y=y.data_ptr(), ldy=n, threads=threads,
                                 scale=0 if scale is None else scale.data_ptr())
    if status != 0:
        raise RuntimeError(f"the {spec.name} failed (status {status})")
    return y.view(*x.shape[:-1], n)


def quantize_rows(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """x (M, K) float -> int8 (M, K) and scales (M,): each row symmetric to [-levels,
    levels], absmax / levels (0 for an all-zero row), round half to even: the int8
    kernels' activation quantization (levels 127; avx2_linear.c's 63 without VNNI)."""
    amax = x.abs().amax(dim=1)  # (M,)
    # a true division, as the kernels' (`127.0 / amax` is 127 * reciprocal: other rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)).div_(amax),
                      torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp_(-levels, levels).to(torch.int8)  # (M, K)
    return q, amax / levels


def int8_agrees(spec: KernelSpec, lib: ctypes.CDLL, shapes: Sequence[tuple[int, int]],
                row_counts: Sequence[int], levels: int = 127) -> bool:
    """Whether `lib`'s int8 op equals the same quantization done by PyTorch, its integer
    sums exact: weights of `shapes` (n, k), `row_counts` rows (around its blocks' edges) with
    an all-zero one, with and without a bias, one and two threads."""
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) / 50 + 1e-3
        bias = torch.randn(n, generator=gen)
        packed = spec.pack(lib, weight)
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen)
            x[0] = 0.0
            q, xs = quantize_rows(x, levels)
            exact = (q.double() @ weight.double().T) * xs.double()[:, None] * scale.double()
            for b in (bias, None):
                want = exact if b is None else exact + b.double()
                for threads in (1, 2):
                    got = run(spec, lib, x, packed, n, b, threads, scale).double()
                    if not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
                        return False
    return True


class KernelLinear(nn.Module):
    """An inference-only linear layer y = x W^T + b on one of nmt's C kernels, W packed once.

    Holds no parameters: the packed weight, the bias and the int8 scales are snapshots of
    the layer it replaces, so `state_dict()` and `.to()` leave them alone."""

    def __init__(self, spec: KernelSpec, weight: Tensor, bias: Tensor | None,
                 scale: Tensor | None = None, keep_quantized: bool = False) -> None:
        """`weight` (out, in): float, or for an int8 kernel already int8 with its per-output
        `scale` (out,) (else quantized here, as int8_linear.quantize_weight does);
        `keep_quantized`: an int8 layer also holds its int8 weight, for `rows` (the output
        projection only)."""
        super().__init__()
        lib = spec.kernel.library()
        given_int8 = scale is None or (spec.int8 and weight.dtype == torch.int8)
        if lib is None or not spec.fits(weight) or not given_int8:
            raise ValueError(f"KernelLinear needs the {spec.name} built and in_features % "
                             f"{spec.k_step} == 0 (given scales: int8 weights)")
        self.spec, self.lib = spec, lib
        self.out_features, self.in_features = weight.shape
        self.scale = self.quantized = None
        if spec.int8:
            q, scale = (weight, scale) if scale is not None else quantize_weight(weight)
            self.scale = scale.detach().float().contiguous()
            self.quantized = (q, self.scale) if keep_quantized else None
            self.packed = spec.pack(lib, q.contiguous())
        else:
            self.packed = spec.pack(lib, weight.detach().to(spec.dtype).contiguous())
        self.bias = None if bias is None else bias.detach().to(spec.dtype).contiguous().clone()

    def rows(self, index: Tensor) -> KernelLinear:
        """The layer of output rows `index` (n,) only (a shortlist's output projection,
        built per batch): repacked from the int8 weight, not quantized again. No bias."""
        if self.quantized is None:
            raise ValueError("KernelLinear.rows needs an int8 layer made with "
                             "keep_quantized=True")
        q, scale = self.quantized
        return KernelLinear(self.spec, q.index_select(0, index), None,
                            scale.index_select(0, index))

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features), in the kernel's dtype."""
        if x.dtype != self.spec.dtype:
            x = x.to(self.spec.dtype)
        return run(self.spec, self.lib, x, self.packed, self.out_features, self.bias,
                   torch.get_num_threads(), self.scale)

    def c_entry(self) -> tuple[int, int]:
        """The C function (its address) and op that compute this layer, for a caller in C
        (nmt/kernels/native_step.c), which passes `packed`, `bias` and `scale` as
        `forward` does."""
        return kernels.address(getattr(self.lib, self.spec.kernel.entry)), self.spec.op

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.spec.name}"
                + (", activations per row" if self.spec.int8 else ""))
