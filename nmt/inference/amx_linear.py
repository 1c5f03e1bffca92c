"""bf16 and int8 linear layers for CPU inference on Intel AMX through one C kernel
(nmt/kernels/amx_linear.c).

Why: oneDNN compiles a kernel for every row count it meets, about 1 ms each with AMX, and
beam search meets a new row count at almost every step: a worker process spends half a
second of its first 1,000 lines compiling, each worker again, and with a shortlist every
batch's new width compiles anew (docs/performance.md). The kernel here is compiled at install
(nmt/kernels) and serves every shape; it is used for bf16 where the CPU has
AMX-BF16 and the kernel builds and agrees with `F.linear` (checked once per process), in
place of nmt/inference/packed_linear.py's oneDNN linears. NMT_AMX_LINEAR=0 turns it off.

int8 (`AmxInt8Linear`, what nmt/inference/int8_linear.py picks where `int8_available()`):
the same tiling with int8 weights (per output channel) and activations quantized per row
inside the call (CTranslate2's scheme), signed x signed with int32 accumulation, float32 in
and out. It replaces torch's FBGEMM / oneDNN dynamic-quantized layers, which quantize a whole
call's activations with one scale and (oneDNN) compile per row count. NMT_AMX_INT8=0 turns
it off.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt import kernels
from nmt.switches import switch

PARAMS = 12  # P_COUNT of the C source
OP_AVAILABLE, OP_PACK, OP_LINEAR, OP_AVAILABLE_I8, OP_PACK_I8, OP_LINEAR_I8 = range(6)
K_STEP = 32  # bf16 in_features must be a multiple of this (one tile's depth)
K_STEP_I8 = 64  # int8 in_features must be a multiple of this


def _pack(lib: ctypes.CDLL, weight: Tensor) -> Tensor:
    """(N, K) bf16 weight -> the kernel's tile layout (flat bf16), N padded to 32."""
    w = weight.detach().to(torch.bfloat16).contiguous()
    n, k = w.shape
    out = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.bfloat16)
    if kernels.call_linear(lib.nmt_amx_linear, OP_PACK, w=w.data_ptr(), n=n, k=k,
                          y=out.data_ptr()) != 0:
        raise RuntimeError("the AMX linear kernel failed to pack a weight")
    return out


def _linear(lib: ctypes.CDLL, x: Tensor, packed: Tensor, n: int, bias: Tensor | None,
            threads: int, scale: Tensor | None = None) -> Tensor:
    """x (..., K) bf16 @ W^T + b -> (..., n) bf16 with W packed by `_pack`; or, given the
    weight's `scale` (n,) float32, x float32 times W packed by `_pack_i8` -> float32 (x's
    rows quantized to int8 each with its own scale)."""
    k = x.size(-1)
    rows = x.reshape(-1, k)  # (M, K); a view where x's rows are evenly spaced
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    op, dtype = (OP_LINEAR, torch.bfloat16) if scale is None else (OP_LINEAR_I8, torch.float32)
    y = torch.empty(rows.size(0), n, dtype=dtype)  # (M, N)
    status = kernels.call_linear(lib.nmt_amx_linear, op, x=rows.data_ptr(), m=rows.size(0),
                                k=k, ldx=rows.stride(0), w=packed.data_ptr(), n=n,
                                bias=0 if bias is None else bias.data_ptr(),
                                y=y.data_ptr(), ldy=n, threads=threads,
                                scale=0 if scale is None else scale.data_ptr())
    if status != 0:
        raise RuntimeError(f"the AMX linear kernel failed (status {status})")
    return y.view(*x.shape[:-1], n)


def _agrees(lib: ctypes.CDLL) -> bool:
    """The kernel runs here (AMX granted) and matches F.linear to bf16 rounding: row counts
    below, at and past the 16- and 32-row blocks, a width that is no multiple of 16, with
    and without a bias, one and two threads."""
    if kernels.call_linear(lib.nmt_amx_linear, OP_AVAILABLE) != 0:
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


KERNEL = kernels.Kernel("amx_linear", "nmt_amx_linear", PARAMS, _agrees, "NMT_AMX_LINEAR")


def has_amx() -> bool:
    """Whether this CPU has AMX (tiles, bf16 and int8 products) and no ISA cap rules it out
    for this process: then oneDNN's bf16 layers and nmt's AMX kernel use it."""
    return kernels.allowed("amx") is None


def available() -> bool:
    """Whether bf16 linears should run on this kernel here: an AMX-BF16 CPU, no ISA cap
    below AMX, the kernel wanted (NMT_AMX_LINEAR), built and checked."""
    return has_amx() and KERNEL.enabled()


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

    def c_entry(self) -> tuple[int, int]:
        """The C function (its address) and op that compute this layer, for a caller in C
        (nmt/inference/native_step.c), which passes `packed` and `bias` as `forward` does."""
        return kernels.address(getattr(self.lib, KERNEL.entry)), OP_LINEAR

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, AMX bf16 kernel")


def fits(weight: Tensor) -> bool:
    """Whether the kernel takes this (out, in) weight: 2-D, in a multiple of 32."""
    return weight.dim() == 2 and weight.size(1) % K_STEP == 0 and weight.size(0) > 0


def _pack_i8(lib: ctypes.CDLL, q: Tensor) -> Tensor:
    """(N, K) int8 weight -> the kernel's int8 tile layout (flat int8), N padded to 32."""
    q = q.contiguous()
    n, k = q.shape
    out = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.int8)
    if kernels.call_linear(lib.nmt_amx_linear, OP_PACK_I8, w=q.data_ptr(), n=n, k=k,
                          y=out.data_ptr()) != 0:
        raise RuntimeError("the AMX int8 kernel failed to pack a weight")
    return out


def quantize_rows(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """x (M, K) float -> int8 (M, K) and scales (M,): each row symmetric to [-levels,
    levels], absmax / levels (0 for an all-zero row), round half to even; the kernel's
    activation quantization (levels 127; avx2_linear.c's takes 63 without VNNI)."""
    amax = x.abs().amax(dim=1)  # (M,)
    # a true division, as the kernel's (`127.0 / amax` is 127 * reciprocal: other rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)).div_(amax),
                      torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp_(-levels, levels).to(torch.int8)  # (M, K)
    return q, amax / levels


def int8_works() -> bool:
    """Whether the kernel's int8 ops run here (built with AMX-INT8, AMX granted) and match
    the same quantization done by PyTorch (`_int8_agrees`, checked once per library)."""
    lib = KERNEL.library()
    if lib is None:
        return False
    with torch.autocast("cpu", enabled=False), torch.inference_mode():  # any caller's context
        return _int8_agrees(lib)


@functools.cache
def _int8_agrees(lib: ctypes.CDLL) -> bool:
    """The int8 ops run and agree as exactly as float rounding allows: row counts below, at
    and past the 16- and 32-row blocks, a width no multiple of 16, with and without a
    bias, one and two threads."""
    if kernels.call_linear(lib.nmt_amx_linear, OP_AVAILABLE_I8) != 0:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (40, 128), generator=gen, dtype=torch.int8)
    scale = torch.rand(40, generator=gen) / 50 + 1e-3
    bias = torch.randn(40, generator=gen)
    packed = _pack_i8(lib, weight)
    for rows in (1, 5, 16, 17, 33, 70):
        x = torch.randn(rows, 128, generator=gen)
        x[0] = 0.0  # an all-zero row
        q, xs = quantize_rows(x)
        exact = (q.double() @ weight.double().T) * xs.double()[:, None] * scale.double()
        for b in (bias, None):
            want = exact if b is None else exact + b.double()
            for threads in (1, 2):
                got = _linear(lib, x, packed, 40, b, threads, scale).double()
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
                    return False
    return True


def int8_available() -> bool:
    """Whether int8 linears should run on this kernel here: an AMX-INT8 CPU, no ISA cap
    below AMX, the kernel wanted (NMT_AMX_LINEAR and NMT_AMX_INT8), built and checked."""
    return (has_amx() and switch("NMT_AMX_INT8") != "0"
            and int8_works())


def fits_int8(weight: Tensor) -> bool:
    """Whether the int8 kernel takes this (out, in) weight: 2-D, in a multiple of 64."""
    return weight.dim() == 2 and weight.size(1) % K_STEP_I8 == 0 and weight.size(0) > 0


class KernelInt8Linear(nn.Module):
    """An inference-only linear layer y ~ x W^T + b on one of nmt's int8 C kernels: W
    given as int8 with per-output scales and packed once, x quantized per row in each
    call; float32 in and out. Holds no parameters (snapshots, as Int8Linear). The kernels'
    layers (`AmxInt8Linear` here, avx2_linear.py's `Avx2Int8Linear`) say how to reach,
    fit, pack and run theirs."""

    needs = ""  # what the constructor's error names
    kernel = ""  # what extra_repr names
    c_function = ""  # the kernel library's C entry, which `run` calls
    c_op = 0  # the op of that entry that `run` asks for

    @staticmethod
    def library() -> ctypes.CDLL | None:
        raise NotImplementedError

    @staticmethod
    def fits(q: Tensor) -> bool:
        raise NotImplementedError

    @staticmethod
    def pack(lib: ctypes.CDLL, q: Tensor) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def run(lib: ctypes.CDLL, x: Tensor, packed: Tensor, n: int, bias: Tensor | None,
            threads: int, scale: Tensor) -> Tensor:
        raise NotImplementedError

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None,
                 keep_quantized: bool = False) -> None:
        """`q` (out, in) int8 and `scale` (out,) as `int8_linear.quantize_weight` makes
        them; `keep_quantized`: hold them too, for `rows` (the output projection)."""
        super().__init__()
        lib = self.library()
        if lib is None or not self.fits(q) or q.dtype != torch.int8:
            raise ValueError(f"{type(self).__name__} needs {self.needs}")
        self.lib = lib
        self.in_features, self.out_features = q.size(1), q.size(0)
        self.packed = self.pack(lib, q)
        self.scale = scale.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        self.quantized = (q, self.scale) if keep_quantized else None

    def rows(self, index: Tensor) -> KernelInt8Linear:
        """The layer of output rows `index` (n,) only (a shortlist's output projection,
        built per batch): repacked from the int8 weight, not quantized again. No bias."""
        if self.quantized is None:
            raise ValueError(f"{type(self).__name__}.rows needs a layer made with "
                             "keep_quantized=True")
        q, scale = self.quantized
        return type(self)(q.index_select(0, index), scale.index_select(0, index), None)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) float32 -> (..., out_features) float32."""
        if x.dtype != torch.float32:
            x = x.float()
        return self.run(self.lib, x, self.packed, self.out_features, self.bias,
                        torch.get_num_threads(), self.scale)

    def c_entry(self) -> tuple[int, int]:
        """The C function (its address) and op that compute this layer, for a caller in C
        (nmt/inference/native_step.c), which passes `packed`, `bias` and `scale` as
        `forward` does."""
        return kernels.address(getattr(self.lib, self.c_function)), self.c_op

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kernel}, activations per row")


class AmxInt8Linear(KernelInt8Linear):
    """`KernelInt8Linear` on the AMX int8 kernel; needs `int8_available()` and
    `fits_int8(q)`."""

    needs = "the AMX kernel, int8 and in_features % 64 == 0"
    kernel = "AMX int8 kernel"
    c_function, c_op = KERNEL.entry, OP_LINEAR_I8
    library = staticmethod(KERNEL.library)
    fits = staticmethod(fits_int8)
    pack = staticmethod(_pack_i8)
    run = staticmethod(_linear)
