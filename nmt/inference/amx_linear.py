"""bf16 linear layers for CPU inference on Intel AMX through one C kernel (amx_linear.c).

Why: oneDNN compiles a kernel for every row count it meets, about 1 ms each with AMX, and
beam search meets a new row count at almost every step: a worker process spends half a
second of its first 1,000 lines compiling, each worker again, and with a shortlist every
batch's new width compiles anew (docs/performance.md). The kernel here is compiled once per
machine (nmt/native.py) and serves every shape; it is used for bf16 where the CPU has
AMX-BF16 and the kernel builds and agrees with `F.linear` (checked once per process), in
place of nmt/inference/packed_linear.py's oneDNN linears. NMT_AMX_LINEAR=0 turns it off.
"""

from __future__ import annotations

import array
import ctypes
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nmt.native as native
from nmt.cores import cpu_info

SOURCE = Path(__file__).with_suffix(".c")
PARAMS = 11  # P_COUNT of the C source
OP_AVAILABLE, OP_PACK, OP_LINEAR = 0, 1, 2
K_STEP = 32  # in_features must be a multiple of this (one tile's depth)


def _call(lib: ctypes.CDLL, op: int, x: int = 0, m: int = 0, k: int = 0, ldx: int = 0,
          w: int = 0, n: int = 0, bias: int = 0, y: int = 0, ldy: int = 0,
          threads: int = 1) -> int:
    params = array.array("q", (op, x, m, k, ldx, w, n, bias, y, ldy, threads))
    return lib.nmt_amx_linear(params.buffer_info()[0])


def _pack(lib: ctypes.CDLL, weight: Tensor) -> Tensor:
    """(N, K) bf16 weight -> the kernel's tile layout (flat bf16), N padded to 32."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    n, k = w.shape
    out = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.bfloat16)
    if _call(lib, OP_PACK, w=w.data_ptr(), n=n, k=k, y=out.data_ptr()) != 0:
        raise RuntimeError("the AMX linear kernel failed to pack a weight")
    return out


def _linear(lib: ctypes.CDLL, x: Tensor, packed: Tensor, n: int, bias: Tensor | None,
            threads: int) -> Tensor:
    """x (..., K) bf16 @ W^T + b -> (..., n) bf16 with W packed by `_pack`."""
    k = x.size(-1)
    rows = x.reshape(-1, k)  # (M, K); a view where x's rows are evenly spaced
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.size(0), n, dtype=torch.bfloat16)  # (M, N)
    status = _call(lib, OP_LINEAR, x=rows.data_ptr(), m=rows.size(0), k=k,
                   ldx=rows.stride(0), w=packed.data_ptr(), n=n,
                   bias=0 if bias is None else bias.data_ptr(), y=y.data_ptr(), ldy=n,
                   threads=threads)
    if status != 0:
        raise RuntimeError(f"the AMX linear kernel failed (status {status})")
    return y.view(*x.shape[:-1], n)


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel runs here (AMX granted) and matches F.linear to bf16 rounding: row counts
    below, at and past the 16- and 32-row blocks, a width that is no multiple of 16, with
    and without a bias, one and two threads."""
    if _call(lib, OP_AVAILABLE) != 0:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    packed = _pack(lib, weight)
    for rows in (1, 5, 16, 17, 33, 70):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        for b in (bias, None):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            for threads in (1, 2):
                got = _linear(lib, x, packed, 40, b, threads).float()
                if not torch.allclose(got, want, rtol=1e-2, atol=2e-2):
                    return False
    return True


KERNEL = native.Kernel(SOURCE, "nmt_amx_linear", PARAMS, _agrees, "NMT_AMX_LINEAR",
                       "the AMX bf16 linear kernel", "bf16 linears use oneDNN's")


def has_amx() -> bool:
    """Whether the CPU reports AMX tiles with bf16 (/proc/cpuinfo)."""
    flags = set(cpu_info().get("flags", "").split())
    return {"amx_tile", "amx_bf16"} <= flags


def capped() -> bool:
    """Whether the kernels are capped below AMX for this process (ATEN_CPU_CAPABILITY, or
    ONEDNN_MAX_CPU_ISA naming no AMX ISA): then a CPU without AMX is what is measured,
    and oneDNN's bf16 layers without AMX are what such a CPU runs."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return (native.isa_flags() != ("-march=native",)
            or onednn not in ("", "ALL", "DEFAULT") and "AMX" not in onednn)


def available() -> bool:
    """Whether bf16 linears should run on this kernel here: an AMX-BF16 CPU, no ISA cap
    below AMX, the kernel wanted (NMT_AMX_LINEAR), built and checked."""
    return has_amx() and not capped() and KERNEL.enabled()


class AmxLinear(nn.Module):
    """An inference-only bf16 linear layer y = x W^T + b on the AMX kernel, W packed once.

    Holds no parameters (the packed weight and the bias are snapshots), like
    nmt/inference/packed_linear.py's PackedLinear, whose place it takes for bf16; needs
    `available()` and in_features a multiple of 32 (`fits`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        lib = KERNEL.library()
        if lib is None or not fits(weight):
            raise ValueError("AmxLinear needs the AMX kernel and in_features % 32 == 0")
        self.lib = lib
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.packed = _pack(lib, weight)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) bf16 -> (..., out_features) bf16."""
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        return _linear(self.lib, x, self.packed, self.out_features, self.bias,
                       torch.get_num_threads())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, AMX bf16 kernel")


def fits(weight: Tensor) -> bool:
    """Whether the kernel takes this (out, in) weight: 2-D, in a multiple of 32."""
    return weight.dim() == 2 and weight.size(1) % K_STEP == 0 and weight.size(0) > 0
