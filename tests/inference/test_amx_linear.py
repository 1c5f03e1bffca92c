"""The AMX bf16 and int8 linear kernels (nmt/inference/amx_linear.py) against PyTorch:
every row count around their 16- and 32-row tiles and their row chunks, widths that are no
multiple of a tile, strided and 3-D inputs, one and two threads; a bf16 model searches alike
with the kernel on and off, an int8 model stays close to fp32; where a kernel cannot run (no
AMX, not loaded, a shape it does not take, no compiler), oneDNN's bf16 layer or torch's
int8 layer is used instead."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_model, random_batch
from helpers.native import without_kernels
from torch import nn

from nmt import kernels
from nmt.inference import amx_linear, backends
from nmt.inference.decoding import DecodingWorkspace
from nmt.inference.kernel_linear import KernelLinear, quantize_rows
from nmt.inference.packed_linear import PackedLinear, works
from nmt.inference.search import beam_search, max_output_lengths

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_amx = pytest.mark.skipif(not (kernels.allowed("amx") is None and amx_linear.BF16.works()),
                               reason="the kernel does not run here: no AMX-BF16, kernels "
                                      "capped below it, or no C compiler")


def amx(weight: torch.Tensor, bias: torch.Tensor | None) -> KernelLinear:
    """The AMX bf16 kernel's layer."""
    return KernelLinear(amx_linear.BF16, weight, bias)


def is_amx(layer: object, spec: object = amx_linear.BF16) -> bool:
    return isinstance(layer, KernelLinear) and layer.spec is spec


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer in float32 from the same bf16 operands, rounded to bf16 as the kernel's
    output is."""
    return F.linear(x.float(), weight.float(),
                    None if bias is None else bias.float()).bfloat16()


@needs_amx
@pytest.mark.parametrize("rows", [1, 4, 15, 16, 17, 31, 32, 33, 100, 600])
@pytest.mark.parametrize(("k", "n"), [(32, 8), (256, 40), (256, 768), (1024, 1000)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_equals_the_float_layer(rows: int, k: int, n: int, bias: bool) -> None:
    """600 rows at 256 inputs cross the kernel's 512-row chunk; 1,000 outputs leave a
    partial 32-output block with a partial 16-output half."""
    gen = torch.Generator().manual_seed(rows * 7 + k + n)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    layer = amx(weight, b)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), reference(x, weight, b).float(),
                               rtol=1e-2, atol=1e-2)


@needs_amx
def test_strided_and_batched_inputs_and_two_threads() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(72, 64, generator=gen).bfloat16()
    bias = torch.randn(72, generator=gen).bfloat16()
    layer = amx(weight, bias)
    wide = torch.randn(37, 100, generator=gen).bfloat16()
    strided = wide[:, 10:74]  # rows 100 elements apart
    batched = torch.randn(3, 11, 64, generator=gen).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(strided).float(),
                                   reference(strided, weight, bias).float(),
                                   rtol=1e-2, atol=1e-2)
        got = layer(batched)
        assert got.shape == (3, 11, 72)
        torch.testing.assert_close(got.float(), reference(batched, weight, bias).float(),
                                   rtol=1e-2, atol=1e-2)
        x = torch.randn(300, 64, generator=gen).bfloat16()
        one = layer(x)
        torch.set_num_threads(2)
        try:
            two = layer(x)
        finally:
            torch.set_num_threads(1)
    assert torch.equal(one, two)  # each output block is computed alike on any thread


@needs_amx
def test_a_snapshot_of_the_weight() -> None:
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    layer = amx(linear.weight, linear.bias)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        linear.weight.zero_()
    with torch.inference_mode():
        assert torch.equal(layer(x), before)
    assert list(layer.state_dict()) == []  # no parameters, like PackedLinear


@needs_amx
def test_a_bf16_model_searches_alike_with_the_kernel_on_and_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    on, off = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
    on_space = DecodingWorkspace(on, backends.prepare(on, "bf16"))
    with monkeypatch.context() as patch:  # the kernel not loaded: oneDNN's layers
        patch.setattr(amx_linear.KERNEL, "library", lambda: None)
        off_space = DecodingWorkspace(off, backends.prepare(off, "bf16"))
    assert not any(is_amx(m) for m in off.modules())
    assert any(is_amx(m) for m in on.modules())
    assert is_amx(on_space.projection)
    assert isinstance(off_space.projection, PackedLinear)
    for seed in range(3):
        src = random_batch([8, 3, 5, 1, 6], seed)
        max_lens = max_output_lengths(src, 1.0, 5)
        with torch.inference_mode():
            torch.testing.assert_close(on(src, src).float(), off(src, src).float(),
                                       rtol=2e-2, atol=2e-2)
            with off_space.decoder(src) as decoder:
                want = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
            with on_space.decoder(src) as decoder:
                got = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
            # a shortlist's projection is packed per batch by the same kernel
            columns = torch.arange(0, 50, 2)
            projection, _ = on_space.restricted(columns)
            assert is_amx(projection)
            feats = torch.randn(6, 64).bfloat16()
            torch.testing.assert_close(
                projection(feats).float(),
                reference(feats, on.output_weight.index_select(0, columns), None).float(),
                rtol=1e-2, atol=1e-2)
        assert [[h.tokens for h in row] for row in got] == \
            [[h.tokens for h in row] for row in want]
        for row_got, row_want in zip(got, want, strict=True):
            for g, w in zip(row_got, row_want, strict=True):
                assert g.score == pytest.approx(w.score, abs=2e-2)


def test_where_the_kernel_does_not_run_the_onednn_layer_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the AMX column: the kernel for a bf16 weight it takes where it is loaded, else
    oneDNN's layer; fp32 never on it; no AMX (a cap below it): another column."""
    if not works(torch.bfloat16):
        pytest.skip("oneDNN bf16 linear unavailable here")
    monkeypatch.setattr(backends, "column", lambda: "amx")
    weight = torch.randn(48, 64).bfloat16()
    assert not isinstance(backends.layer(weight.float(), None, "fp32"), KernelLinear)
    narrow = torch.randn(48, 40).bfloat16()  # no multiple of 32
    assert isinstance(backends.layer(narrow, None, "bf16"), PackedLinear)
    loaded = amx_linear.BF16.works()
    assert is_amx(backends.layer(weight, None, "bf16")) == loaded
    with monkeypatch.context() as patch:
        patch.setattr(amx_linear.KERNEL, "library", lambda: None)
        assert isinstance(backends.layer(weight, None, "bf16"), PackedLinear)
    monkeypatch.undo()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # a CPU without AMX
    assert kernels.allowed("amx") is not None and backends.column() != "amx"
    assert isinstance(backends.layer(weight, None, "bf16"), PackedLinear)
    assert not amx_linear.BF16.fits(torch.randn(48, 40))
    with pytest.raises(ValueError, match="in_features % 32"):
        amx(narrow, None)


def test_without_its_library_bf16_linears_stay_with_onednn(tmp_path) -> None:
    if kernels.allowed("amx") is not None:
        pytest.skip("this CPU has no AMX-BF16: the kernel is never built here")
    code = ("import torch\n"
            "from nmt.inference.backends import layer\n"
            "w = torch.randn(48, 64).bfloat16()\n"
            "print(type(layer(w, None, 'bf16')).__name__, type(layer(w, None, 'bf16')).__name__)\n")
    out = without_kernels(code, tmp_path)
    assert out == ["PackedLinear PackedLinear"]


# --- int8 -------------------------------------------------------------------------------

needs_amx_int8 = pytest.mark.skipif(
    not (kernels.allowed("amx") is None and amx_linear.INT8.works()),
    reason="the int8 kernel does not run here: no AMX-INT8, kernels capped below it, or no "
           "C compiler")


def test_row_quantization_is_symmetric_per_row() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.01]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0], [127, 64, -32, 0]]  # 63.5 -> 64
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.0, 3.0]) / 127)


@needs_amx_int8
def test_an_int8_model_runs_on_the_kernel_close_to_fp32_and_falls_back_when_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nmt.inference.int8_linear import Int8Linear

    plain = make_model()
    on, off = make_model(), make_model()
    on_space = DecodingWorkspace(on, backends.prepare(on, "int8"))
    with monkeypatch.context() as patch:  # the int8 ops not working: torch's layers
        patch.setitem(backends.SPECS, ("nmt-amx", "int8"),
                      replace(amx_linear.INT8, works=lambda: False))
        assert isinstance(backends.prepare(off, "int8"), Int8Linear)
    assert not any(is_amx(m, amx_linear.INT8) for m in off.modules())
    assert any(is_amx(m, amx_linear.INT8) for m in on.modules())
    assert is_amx(on_space.projection, amx_linear.INT8)
    columns = torch.arange(0, 50, 2)
    projection, weight = on_space.restricted(columns)  # a shortlist's rows, not requantized
    assert is_amx(projection, amx_linear.INT8) and weight is None
    for seed in range(3):
        src = random_batch([8, 3, 5, 1, 6], seed)
        with torch.inference_mode():
            want = torch.log_softmax(plain(src, src), -1).exp()
            for model in (on, off):
                got = torch.log_softmax(model(src, src), -1).exp()
                assert float((got - want).abs().max()) < 0.02  # probabilities
            max_lens = max_output_lengths(src, 1.0, 5)
            with on_space.decoder(src) as decoder:
                hyps = beam_search(decoder, max_lens, beam=4, alpha=0.6, nbest=2, min_len=1)
        assert [len(row) for row in hyps] == [2] * 5


def test_int8_where_the_kernel_does_not_run_torch_kernels_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the AMX column: the int8 kernel for a width it takes where it works, else torch's
    layer; no AMX (a cap below it): another column, torch's layer."""
    from nmt.inference import int8_linear

    if not int8_linear.available():
        pytest.skip("no int8 kernel of torch's here")
    monkeypatch.setattr(backends, "column", lambda: "amx")
    weight = torch.randn(48, 64)
    assert isinstance(backends.layer(torch.randn(48, 40), None, "int8"),
                      int8_linear.Int8Linear)  # 40 inputs: no multiple of 64
    loaded = amx_linear.INT8.works()
    assert is_amx(backends.layer(weight, None, "int8"), amx_linear.INT8) == loaded
    with monkeypatch.context() as patch:  # the library not loaded
        patch.setattr(amx_linear.KERNEL, "library", lambda: None)
        assert not amx_linear.INT8.works()
        assert isinstance(backends.layer(weight, None, "int8"), int8_linear.Int8Linear)
    assert is_amx(backends.layer(weight, None, "int8"), amx_linear.INT8) == loaded
    monkeypatch.undo()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")  # a CPU without AMX
    assert kernels.allowed("amx") is not None and backends.column() != "amx"
    assert not is_amx(backends.layer(weight, None, "int8"), amx_linear.INT8)
    assert not amx_linear.INT8.fits(torch.randn(48, 40))
    if amx_linear.KERNEL.enabled():
        with pytest.raises(ValueError, match="in_features % 64"):
            KernelLinear(amx_linear.INT8, torch.zeros(48, 40, dtype=torch.int8), None,
                         scale=torch.ones(48))
