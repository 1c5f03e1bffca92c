"""fp32 linears on MKL's packed sgemm: nn.Linear's numbers at every row count, where the
backends' table picks them (nmt/inference/backends.py), and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_model, random_batch
from torch import nn

from nmt.inference import backends, mkl_linear, packed_linear
from nmt.inference.decoding import DecodingWorkspace
from nmt.inference.mkl_linear import MklLinear
from nmt.inference.packed_linear import PackedLinear
from nmt.inference.search import beam_search, max_output_lengths

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_mkl = pytest.mark.skipif(not mkl_linear.works(),
                               reason="this torch has no working MKL packed-linear ops")


def reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """nn.Linear in float64, rounded to fp32: what both fp32 kernels approximate."""
    bias = None if linear.bias is None else linear.bias.double()
    return F.linear(x.double(), linear.weight.double(), bias).float()


@needs_mkl
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100, 1500])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", [(32, 48), (256, 1000), (1024, 24)])
def test_mkl_linear_equals_nn_linear(rows: int, bias: bool, features: tuple[int, int]) -> None:
    """Packed once (for one row), right for every row count: MKL's packed B does not depend
    on the rows it was packed for."""
    torch.manual_seed(rows)
    linear = nn.Linear(*features, bias=bias)
    x = torch.randn(rows, features[0])
    layer = MklLinear(linear.weight, linear.bias)
    with torch.inference_mode():
        got, plain = layer(x), linear(x)
    want = reference(x, linear)
    assert got.shape == want.shape == (rows, features[1]) and got.dtype == torch.float32
    err, plain_err = (got - want).abs().max().item(), (plain - want).abs().max().item()
    assert err <= 2 * plain_err + 1e-6  # as close as torch's own fp32 matmul


@needs_mkl
def test_mkl_linear_takes_any_input_layout() -> None:
    """3-D inputs, a transposed (non-contiguous) view and an empty batch."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)
    layer = MklLinear(linear.weight, linear.bias)
    with torch.inference_mode():
        x3 = torch.randn(3, 7, 64)
        torch.testing.assert_close(layer(x3), linear(x3), rtol=1e-5, atol=1e-5)
        xt = torch.randn(64, 9).t()  # (9, 64), strides (1, 9)
        assert not xt.is_contiguous()
        torch.testing.assert_close(layer(xt), linear(xt), rtol=1e-5, atol=1e-5)
        assert layer(torch.randn(0, 64)).shape == (0, 40)


@needs_mkl
def test_mkl_linear_is_a_snapshot_without_parameters() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    x = torch.randn(5, 32)
    layer = MklLinear(linear.weight, linear.bias)
    with torch.inference_mode():
        want = linear(x)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert not list(layer.parameters()) and not layer.state_dict()
    assert "packed for MKL" in repr(layer)


@needs_mkl
def test_packed_with_two_threads_computes_with_one() -> None:
    """A worker computes with one thread on weights its parent packed with several."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 300)
    x = torch.randn(70, 256)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer = MklLinear(linear.weight, linear.bias)
        two = layer(x)
    finally:
        torch.set_num_threads(before)
    one = layer(x)
    want = reference(x, linear)
    for got in (one, two):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_fp32_layers_are_mkls_on_intel_cpus_only(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(24, 32)
    monkeypatch.setattr(mkl_linear, "is_intel", lambda: True)
    assert backends.column() in ("amx", "intel-avx512", "intel-avx2", "other")
    assert isinstance(backends.layer(weight, None, "fp32"), MklLinear)
    if packed_linear.works(torch.bfloat16):  # oneDNN's bf16 (absent under AVX2 caps)
        assert type(backends.layer(weight.bfloat16(), None, "bf16")) is PackedLinear
    if packed_linear.works(torch.float32):
        with monkeypatch.context() as patch:  # MKL's functions not working here
            patch.setattr(mkl_linear, "works", lambda: False)
            assert type(backends.layer(weight, None, "fp32")) is PackedLinear
        monkeypatch.setattr(mkl_linear, "is_intel", lambda: False)  # AMD: MKL runs AVX2
        assert type(backends.layer(weight, None, "fp32")) is PackedLinear


def test_is_intel_reads_the_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mkl_linear, "cpu_info", lambda: {"vendor_id": "GenuineIntel"})
    assert mkl_linear.is_intel()
    monkeypatch.setattr(mkl_linear, "cpu_info", lambda: {"vendor_id": "AuthenticAMD"})
    assert not mkl_linear.is_intel()
    monkeypatch.setattr(mkl_linear, "cpu_info", lambda: {})
    assert not mkl_linear.is_intel()


def test_missing_functions_fall_back_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's library does not export MKL's packed sgemm, fp32 layers are oneDNN's
    again (and an MklLinear cannot be made)."""
    mkl_linear.works.cache_clear()
    monkeypatch.setattr(mkl_linear, "is_intel", lambda: True)
    monkeypatch.setattr(mkl_linear, "mkl", lambda: None)
    try:
        assert not mkl_linear.available()
        if packed_linear.works(torch.float32):
            assert type(backends.layer(torch.randn(8, 16), None, "fp32")) is PackedLinear
        with pytest.raises(RuntimeError, match="not available"):
            MklLinear(torch.randn(8, 16), None)
    finally:
        monkeypatch.undo()
        mkl_linear.works.cache_clear()


@needs_mkl
def test_equals_torchs_own_mkl_op_bit_for_bit() -> None:
    """The packed weight and the bias-first product are what torch's `mkl::_mkl_linear`
    computes, to the last bit (the native decoder step relies on the same functions)."""
    if not hasattr(torch.ops.mkl, "_mkl_linear"):
        pytest.skip("this torch has no mkl::_mkl_linear to compare with")
    torch.manual_seed(0)
    linear = nn.Linear(256, 300)
    layer = MklLinear(linear.weight, linear.bias)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), 1)
    shape = torch.zeros(1).expand(300, 256)
    for rows in (1, 4, 33):
        x = torch.randn(rows, 256)
        want = torch.ops.mkl._mkl_linear(x, packed, shape, linear.bias.detach(), rows)
        assert torch.equal(layer(x), want)


@needs_mkl
def test_model_on_mkl_translates_like_onednn_and_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model's beam search: the same hypotheses on MKL, on oneDNN and unpacked."""
    if not packed_linear.works(torch.float32):
        pytest.skip("oneDNN linear ops unavailable here")
    models, projections = {}, {}
    for name, intel in (("plain", None), ("mkl", True), ("onednn", False)):
        model = make_model()
        if intel is not None:
            monkeypatch.setattr(mkl_linear, "is_intel", lambda intel=intel: intel)
            projections[name] = backends.prepare(model, "fp32")
        models[name] = model
    assert any(isinstance(m, MklLinear) for m in models["mkl"].modules())
    assert not any(isinstance(m, MklLinear) for m in models["onednn"].modules())
    assert isinstance(projections["mkl"], MklLinear)
    assert isinstance(projections["onednn"], PackedLinear)
    src = random_batch([8, 3, 6, 2], seed=1)
    results = {}
    for name, model in models.items():
        workspace = DecodingWorkspace(model, projections.get(name))
        with torch.inference_mode(), workspace.decoder(src) as decoder:
            results[name] = beam_search(decoder, max_output_lengths(src, 1.0, 5), beam=4,
                                        alpha=0.6, nbest=2, min_len=1)
    tokens = {name: [[h.tokens for h in row] for row in hyps] for name, hyps in results.items()}
    assert tokens["mkl"] == tokens["plain"] == tokens["onednn"]
    for row_mkl, row_plain in zip(results["mkl"], results["plain"], strict=True):
        for got, want in zip(row_mkl, row_plain, strict=True):
            assert got.score == pytest.approx(want.score, abs=1e-4)
