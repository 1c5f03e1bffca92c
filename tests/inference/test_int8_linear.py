"""int8 linears for CPU inference: close to F.linear, and a trained model translates as well
in int8 as in fp32, one line per line, in order."""

from __future__ import annotations

import io

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from torch import nn

from nmt.config import DecodeConfig, TrainConfig, model_preset
from nmt.errors import UsageError
from nmt.inference import backends, int8_linear
from nmt.inference.int8_linear import Int8Linear, available, quantize_weight
from nmt.inference.kernel_linear import KernelLinear
from nmt.inference.translate import Engine, translate_stream
from nmt.model.transformer import Transformer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_int8 = pytest.mark.skipif(not available(),
                                reason="this torch/CPU has no working int8 linear kernel")


def is_int8(layer: object) -> bool:
    return isinstance(layer, Int8Linear) or (isinstance(layer, KernelLinear) and layer.spec.int8)


def row_selectable(layer: object) -> bool:
    """An int8 layer that can give a layer of some of its rows (a shortlist's)."""
    return is_int8(layer) and getattr(layer, "quantized", None) is not None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_weight_quantization_is_per_channel_and_symmetric() -> None:
    weight = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-100.0, 50.0, 1.0]])
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and scale.shape == (3,)
    assert q[0].tolist() == [127, -64, 32] and q[1].tolist() == [0, 0, 0]
    assert q[2, 0] == -127 and scale[1] == 1.0  # an all-zero row keeps a finite scale
    torch.testing.assert_close(q.float() * scale[:, None], weight, atol=0.4, rtol=0.01)


@needs_int8
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64), (1, 1, 64), (600, 1, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_close_to_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 300, bias=bias)
    x = torch.randn(*shape)
    layer = Int8Linear(linear.weight, linear.bias)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape == (*shape[:-1], 300) and got.dtype == torch.float32
    assert relative_error(got, want) < 0.03  # 600 rows x 300: the oneDNN kernel
    with torch.no_grad():
        linear.weight.zero_()  # a snapshot: later changes do not reach it
    assert relative_error(layer(x), want) < 0.03


@needs_int8
def test_rows_of_a_layer_are_the_layer_of_those_rows() -> None:
    """A shortlist's projection (`rows`): the same int8 weights and scales as quantizing
    the selected rows afresh, so the same outputs (to the kernels' float rounding)."""
    torch.manual_seed(1)
    weight = torch.randn(500, 64) / 8
    index = torch.tensor([0, 3, 7, 100, 499, 250])
    full = Int8Linear(weight, None, keep_quantized=True)
    picked = full.rows(index)  # packed from full.quantized's rows `index`
    afresh = Int8Linear(weight.index_select(0, index), None, keep_quantized=True)
    assert full.quantized is not None and afresh.quantized is not None
    assert all(torch.equal(a.index_select(0, index), b)
               for a, b in zip(full.quantized, afresh.quantized, strict=True))
    with pytest.raises(ValueError, match="keep_quantized"):
        Int8Linear(weight, None).rows(index)  # a plain layer holds no int8 copy
    for rows in (3, 300):  # below and above the FBGEMM / oneDNN switch
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            torch.testing.assert_close(picked(x), afresh(x), atol=1e-5, rtol=1e-5)


@needs_int8
@pytest.mark.parametrize("kernel", int8_linear.KERNELS)
def test_each_kernel_alone(kernel: str) -> None:
    if not int8_linear.kernel_works(kernel):
        pytest.skip(f"{kernel} int8 kernel unavailable here")
    torch.manual_seed(1)
    linear = nn.Linear(32, 48)
    layer = Int8Linear(linear.weight, linear.bias, use=(kernel,))
    assert list(layer.packed) == [kernel]
    for rows in (2, 4000):  # both sides of the size threshold run the forced kernel
        x = torch.randn(rows, 32)
        assert relative_error(layer(x), linear(x).detach()) < 0.03


@needs_int8
def test_quantized_model_is_close_and_keeps_its_embedding() -> None:
    torch.manual_seed(0)
    plain = Transformer(model_preset("tiny", vocab_size=80)).eval()
    model = Transformer(model_preset("tiny", vocab_size=80)).eval()
    model.load_state_dict(plain.state_dict())
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    projection = backends.prepare(model, "int8")
    assert sum(is_int8(m) for m in model.modules()) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert row_selectable(projection)
    assert set(model.state_dict()) <= set(plain.state_dict())
    src = torch.randint(4, 80, (3, 9))
    with torch.inference_mode():
        want = torch.log_softmax(plain(src, src), -1)
        got = torch.log_softmax(model(src, src), -1)
    assert float((got.exp() - want.exp()).abs().max()) < 0.02  # probabilities


def test_nothing_quantized_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model stays bf16 (its own layers), and where no int8 kernel of torch's
    works the model is not quantized: its layers and projection are fp32's."""
    bf16 = Transformer(model_preset("tiny", vocab_size=40)).to(torch.bfloat16)
    assert not is_int8(backends.prepare(bf16, "int8"))
    assert not any(is_int8(m) for m in bf16.modules())
    int8_linear.kernel_works.cache_clear()
    monkeypatch.setattr(int8_linear, "_apply", lambda *_: (_ for _ in ()).throw(
        RuntimeError("no int8 kernel here")))
    try:
        assert not available()
        model = Transformer(model_preset("tiny", vocab_size=40))
        fp32 = Transformer(model_preset("tiny", vocab_size=40))
        projection = backends.prepare(model, "int8")
        assert not is_int8(projection) and not any(is_int8(m) for m in model.modules())
        assert type(projection) is type(backends.prepare(fp32, "fp32"))
        assert [type(m) for m in model.modules()] == [type(m) for m in fp32.modules()]
    finally:
        monkeypatch.undo()
        int8_linear.kernel_works.cache_clear()


def test_int8_on_cuda_is_a_usage_error() -> None:
    from nmt.precision import resolve_precision

    with pytest.raises(UsageError, match="int8 is for CPUs"):
        resolve_precision("int8", torch.device("cuda"))
    assert resolve_precision("int8", torch.device("cpu")) == "int8"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny model trained on a copy task (a real, decisive model)."""
    from helpers.data import make_copy_data, train_one_thread

    work = tmp_path_factory.mktemp("int8")
    data = make_copy_data(work / "data", n_train=1500, n_valid=120, max_len=8)
    cfg = TrainConfig(max_updates=900, max_tokens=1024, warmup=150, lr_scale=2.0,
                      max_len=64, log_interval=100, valid_interval=10_000,
                      save_interval_minutes=0, seed=1)
    checkpoint = train_one_thread(data, work / "run", model_preset("tiny", dropout=0.0), cfg)
    sources = (data / "valid.src").read_text().splitlines()
    refs = (data / "valid.tgt").read_text().splitlines()
    return checkpoint, sources, refs


def stream(checkpoint: object, precision: str, lines: list[str]) -> list[str]:
    translator = Engine.load([checkpoint], DecodeConfig(beam=4, max_len_b=12,
                                                            max_tokens=200),
                                 device="cpu", precision=precision)
    sink = io.BytesIO()
    translate_stream(io.BytesIO(("\n".join(lines) + "\n").encode()), sink, translator)
    return sink.getvalue().decode("utf-8").split("\n")[:-1]


@needs_int8
@pytest.mark.slow
def test_int8_translates_a_trained_model_like_fp32(trained: tuple) -> None:
    checkpoint, sources, refs = trained
    # Empty lines in between: they must come back empty, in place.
    lines = [line for i, s in enumerate(sources) for line in ((s, "") if i % 7 == 0 else (s,))]
    fp32 = stream(checkpoint, "fp32", lines)
    int8 = stream(checkpoint, "int8", lines)
    loaded = Engine.load([checkpoint], DecodeConfig(), device="cpu", precision="int8")
    assert row_selectable(loaded.workspaces[0].projection)  # the vocabulary too
    assert len(int8) == len(lines) == len(fp32)
    assert [i for i, out in enumerate(int8) if not out] == \
        [i for i, line in enumerate(lines) if not line]
    hyps_fp32 = [out for out, line in zip(fp32, lines, strict=True) if line]
    hyps_int8 = [out for out, line in zip(int8, lines, strict=True) if line]
    bleu_fp32 = sacrebleu.corpus_bleu(hyps_fp32, [refs]).score
    bleu_int8 = sacrebleu.corpus_bleu(hyps_int8, [refs]).score
    assert bleu_fp32 > 60, f"the fixture model did not learn (BLEU {bleu_fp32:.1f})"
    assert abs(bleu_int8 - bleu_fp32) <= 2.0, (bleu_int8, bleu_fp32)
    same = sum(a == b for a, b in zip(hyps_int8, hyps_fp32, strict=True)) / len(hyps_fp32)
    assert same >= 0.9  # in order: a shifted line would break the agreement
