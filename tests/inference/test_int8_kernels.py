"""nmt's int8 C kernels (nmt/inference/amx_linear.py's AMX one, avx2_linear.py's AVX2
one) as `KernelLinear`s: the exact product of their quantized operands at every row count
and width their blocking meets, strided and batched inputs, two threads, shortlist rows;
and where the backends' table picks the AVX2 one. On an AVX-512 CPU the AVX2 kernel's VNNI
build runs here (8-bit activations), under the AVX2 caps its AVX2 one (7-bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nmt import kernels
from nmt.inference import amx_linear, avx2_linear, backends, int8_linear
from nmt.inference.int8_linear import quantize_weight
from nmt.inference.kernel_linear import KernelLinear, KernelSpec, quantize_rows

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_avx2 = pytest.mark.skipif(
    not avx2_linear.INT8.works(),
    reason="the AVX2 int8 kernel does not run here: no AVX2, or no C compiler")

KERNELS = [
    pytest.param(amx_linear.INT8, id="amx", marks=pytest.mark.skipif(
        not amx_linear.INT8.works(),
        reason="the AMX int8 kernel does not run here: no AMX-INT8, kernels capped below "
               "it, or no C compiler")),
    pytest.param(avx2_linear.INT8, id="avx2", marks=needs_avx2),
]


def make(spec: KernelSpec, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
         keep_quantized: bool = False) -> KernelLinear:
    """`spec`'s layer of int8 weight `q` with its per-output `scale`."""
    return KernelLinear(spec, q, bias, scale=scale, keep_quantized=keep_quantized)


def levels(kind: KernelSpec) -> int:
    """The activations' largest quantized magnitude of `kind`'s kernel (AVX2: 63 without
    VNNI, 127 with it; AMX: 127)."""
    if kind is amx_linear.INT8:
        return 127
    lib = avx2_linear.KERNEL.library()
    assert lib is not None
    return kernels.call_linear(lib.nmt_avx2_linear, avx2_linear.OP_LEVELS)


def exact(kind: KernelSpec, x: torch.Tensor, q: torch.Tensor,
          scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `kind`'s kernel computes, in float64 from the same quantized operands: x's
    rows quantized as `quantize_rows` does, integer products summed exactly, rescaled."""
    xq, xs = quantize_rows(x.reshape(-1, x.size(-1)), levels(kind))
    out = (xq.double() @ q.double().T) * xs.double()[:, None] * scale.double()
    if bias is not None:
        out = out + bias.double()
    return out.view(*x.shape[:-1], q.size(0))


@needs_avx2
def test_the_avx2_build_quantizes_to_7_bits_without_vnni_and_8_with() -> None:
    vnni = kernels.allowed("avx2_vnni") is None
    assert levels(avx2_linear.INT8) == (127 if vnni else 63)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 15, 16, 17, 32, 33, 100, 600])
@pytest.mark.parametrize(("k", "n"), [(64, 8), (256, 40), (256, 768), (1024, 1000)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_computes_the_quantized_product(kind: KernelSpec, rows: int,
                                                   k: int, n: int, bias: bool) -> None:
    """Exact integer sums, so float rounding alone separates a kernel from the float64
    product of the same quantized operands; and that product is within int8 error of the
    float layer. 600 rows at 256 inputs cross both kernels' 512-row chunks; 1,000 and 40
    outputs leave partial output blocks with partial halves (AMX: 32 and 16, AVX2: 16
    and 8)."""
    gen = torch.Generator().manual_seed(rows * 7 + k + n)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    q, scale = quantize_weight(weight)
    layer = make(kind, q, scale, b)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact(kind, x, q, scale, b), rtol=1e-5,
                               atol=1e-4)
    want = F.linear(x, weight, b)
    assert float((got - want).norm() / want.norm()) < (0.03 if levels(kind) == 127 else 0.05)


@needs_avx2
@pytest.mark.parametrize("k", [32, 96])
def test_the_avx2_kernel_takes_widths_in_steps_of_32(k: int) -> None:
    """Widths AMX's kernel does not take (no multiple of 64)."""
    gen = torch.Generator().manual_seed(k)
    q, scale = quantize_weight(torch.randn(20, k, generator=gen))
    x = torch.randn(9, k, generator=gen)
    with torch.inference_mode():
        got = make(avx2_linear.INT8, q, scale, None)(x)
    torch.testing.assert_close(got.double(), exact(avx2_linear.INT8, x, q, scale, None),
                               rtol=1e-5, atol=1e-4)


@needs_avx2
def test_extreme_rows_do_not_saturate() -> None:
    """Rows at the quantization's ends against weights at theirs: the largest pair sums
    AVX2's int16 step can meet, still exact."""
    gen = torch.Generator().manual_seed(5)
    q = torch.full((24, 64), 127, dtype=torch.int8)
    q[1::2] = -127
    q[2, ::3] = 0
    scale = torch.rand(24, generator=gen) + 0.5
    x = torch.ones(6, 64)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = torch.randn(64, generator=gen).sign()
    layer = make(avx2_linear.INT8, q, scale, None)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x).double(), exact(avx2_linear.INT8, x, q, scale, None),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KERNELS)
def test_strided_batched_zero_rows_and_two_threads(kind: KernelSpec) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(72, 128, generator=gen)
    bias = torch.randn(72, generator=gen)
    q, scale = quantize_weight(weight)
    layer = make(kind, q, scale, bias)
    wide = torch.randn(37, 200, generator=gen)
    strided = wide[:, 10:138]  # rows 200 elements apart
    batched = torch.randn(3, 11, 128, generator=gen)
    batched[1, 4] = 0.0  # an all-zero row gives the bias
    with torch.inference_mode():
        torch.testing.assert_close(layer(strided).double(),
                                   exact(kind, strided, q, scale, bias), rtol=1e-5, atol=1e-4)
        got = layer(batched)
        assert got.shape == (3, 11, 72)
        torch.testing.assert_close(got.double(), exact(kind, batched, q, scale, bias),
                                   rtol=1e-5, atol=1e-4)
        assert torch.equal(got[1, 4], bias)
        assert torch.equal(layer(batched.bfloat16()), layer(batched.bfloat16().float()))
        x = torch.randn(300, 128, generator=gen)
        one = layer(x)
        torch.set_num_threads(2)
        try:
            two = layer(x)
            empty = layer(torch.empty(0, 128))
        finally:
            torch.set_num_threads(1)
    assert torch.equal(one, two)  # each output block is computed alike on any thread
    assert empty.shape == (0, 72)


@pytest.mark.parametrize("kind", KERNELS)
def test_rows_snapshot_and_what_it_refuses(kind: KernelSpec) -> None:
    linear = nn.Linear(64, 48)
    layer = make(kind, *quantize_weight(linear.weight), linear.bias, keep_quantized=True)
    assert list(layer.state_dict()) == []  # no parameters, like Int8Linear
    x = torch.randn(5, 64)
    with torch.inference_mode():
        before = layer(x)
        index = torch.tensor([3, 0, 47, 20])
        part = layer.rows(index)
        assert type(part) is KernelLinear and part.spec is kind
        torch.testing.assert_close(part(x), before[:, index] - linear.bias[index].detach(),
                                   rtol=1e-5, atol=1e-5)  # rows keep no bias
    with torch.no_grad():
        linear.weight.zero_()
    with torch.inference_mode():
        assert torch.equal(layer(x), before)
    with pytest.raises(ValueError, match="keep_quantized"):
        make(kind, *quantize_weight(linear.weight), None).rows(index)
    with pytest.raises(ValueError, match="in_features % "):
        make(kind, torch.zeros(48, 40, dtype=torch.int8), torch.ones(48), None)
    with pytest.raises(ValueError, match="int8 weights"):  # scales given with float weights
        make(kind, linear.weight, torch.ones(48), None)
    weight = torch.randn(48, 64)  # a float weight: quantized by the layer, as quantize_weight
    with torch.inference_mode():
        assert torch.equal(KernelLinear(kind, weight, None)(x),
                           make(kind, *quantize_weight(weight), None)(x))


def test_the_table_picks_avx2_on_cpus_without_avx512_and_amx(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 kernel in the avx2 columns (Intel's and AMD's); torch's for a width no
    multiple of 32, where the kernel is not loaded, and in the AVX-512 columns."""
    if not (avx2_linear.INT8.works() and int8_linear.available()):
        pytest.skip("no AVX2 int8 kernel or no int8 kernel of torch's here")
    weight = torch.randn(48, 64)
    for column in ("intel-avx2", "amd-avx2"):
        monkeypatch.setattr(backends, "column", lambda column=column: column)
        got = backends.layer(weight, None, "int8")
        assert isinstance(got, KernelLinear) and got.spec is avx2_linear.INT8
        assert isinstance(backends.layer(torch.randn(48, 48), None, "int8"),
                          int8_linear.Int8Linear)
    with monkeypatch.context() as patch:
        patch.setattr(avx2_linear.KERNEL, "library", lambda: None)
        assert isinstance(backends.layer(weight, None, "int8"), int8_linear.Int8Linear)
    for column in ("intel-avx512", "amd-avx512", "other"):
        monkeypatch.setattr(backends, "column", lambda column=column: column)
        assert isinstance(backends.layer(weight, None, "int8"), int8_linear.Int8Linear)
