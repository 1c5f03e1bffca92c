"""Training's linear products on a CPU (nmt/train/linears.py), as the backend table picks
them: row counts in steps for bf16 on an AMX CPU, oneDNN's matmul for fp32 on an AMD CPU with
AVX-512. Each gives the plain layer's outputs and gradients (exactly, or to float rounding),
keeps the parameters and state dict, projects to the vocabulary in the training step (the
model knows nothing of it), and runs only on its CPUs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.data import make_copy_data
from helpers.models import make_model, random_batch, tiny_model_batch
from torch import nn

from nmt.config import TrainConfig, model_preset
from nmt.data.batching import Batch
from nmt.inference import backends
from nmt.train import linears
from nmt.train.feed import Micro
from nmt.train.linears import ROWS, TrainingLinear, choice, linear_rows, onednn_linear, use
from nmt.train.loop import Trainer
from nmt.train.setup import buckets_rows
from nmt.train.step import LossOptions, micro_loss

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 16), (64, 16), (1, 16), (0, 16)])
def test_padded_rows_give_the_plain_layer_and_its_gradients(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    got = linear_rows(x, weight, bias, 8)
    want = F.linear(x, weight, bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads_got = torch.autograd.grad((got * upstream).sum(), (x, weight, bias))
    grads_want = torch.autograd.grad((want * upstream).sum(), (x, weight, bias))
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w)


def test_bucketing_keeps_parameters_and_state_and_the_model_output() -> None:
    plain, bucketed = make_model(), make_model()
    params = [id(p) for p in bucketed.parameters()]
    n_linear = sum(type(m) is nn.Linear for m in bucketed.modules())
    function = functools.partial(linear_rows, multiple=16)
    assert use(bucketed, function) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in bucketed.modules())
    assert all(m.function is function for m in bucketed.modules()
               if isinstance(m, TrainingLinear))
    assert [id(p) for p in bucketed.parameters()] == params  # the optimizer's own tensors
    assert list(bucketed.state_dict()) == list(plain.state_dict())
    src = random_batch([5, 3, 6], seed=1)
    tgt = random_batch([4, 6, 2], seed=2, bos=True)
    plain.double()
    bucketed.double()
    torch.testing.assert_close(bucketed(src, tgt), plain(src, tgt))
    loss_plain = plain(src, tgt).logsumexp(-1).sum()
    loss_bucketed = bucketed(src, tgt).logsumexp(-1).sum()
    grads_plain = torch.autograd.grad(loss_plain, list(plain.parameters()))
    grads_bucketed = torch.autograd.grad(loss_bucketed, list(bucketed.parameters()))
    for g, w in zip(grads_bucketed, grads_plain, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("selected", [True, False], ids=["select", "all-rows"])
def test_the_training_step_buckets_the_output_projection(selected: bool, monkeypatch) -> None:
    """LossOptions.project: the step projects the decoder states itself with padded rows
    (the model's own projection stays plain), with the loss and gradients of the plain
    projection."""
    model, src, tgt_in, tgt_out, select = tiny_model_batch()
    micro = Micro(Batch(src, tgt_in, tgt_out, int((src != 0).sum()), int((tgt_out != 0).sum())),
                  has_pad=True, select=select if selected else None,
                  target=tgt_out.reshape(-1)[select] if selected else tgt_out)
    calls = []

    def counted(x, weight, bias, multiple):
        calls.append(multiple)
        return linear_rows(x, weight, bias, multiple)

    results = []
    for project in (None, functools.partial(counted, multiple=8)):
        model.zero_grad(set_to_none=True)
        loss, nll = micro_loss(model, model, micro, LossOptions(0.1, 0, project=project))
        loss.backward()
        results.append((loss.detach(), nll, [p.grad for p in model.parameters()]))
    assert calls == [8]
    (loss_a, nll_a, grads_a), (loss_b, nll_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(nll_b, nll_a)
    for g, w in zip(grads_b, grads_a, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(("column", "precision", "want"), [
    ("amx", "bf16", "torch-rows64"), ("amx", "fp32", "torch"), ("intel-avx512", "bf16", "torch"),
    ("amd-avx512", "fp32", "onednn-train"), ("amd-avx512", "bf16", "torch"),
    ("amd-avx2", "fp32", "torch"), ("intel-avx512", "fp32", "torch"), ("other", "fp32", "torch"),
    ("amx", "fp16", "torch")])
def test_each_cpu_column_gets_its_training_linear(monkeypatch, column, precision, want) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(backends, "column", lambda: column)
    assert choice(cpu, precision) == want
    assert buckets_rows(cpu, precision) == (want == "torch-rows64")
    assert choice(torch.device("meta"), precision) == "torch"
    if want == "onednn-train":
        monkeypatch.setattr(backends, "runs", lambda name, precision: False)
        assert choice(cpu, precision) == "torch"  # oneDNN's matmul not there: PyTorch's


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 16), (1, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_gives_the_plain_layer_and_its_gradients(shape, bias: bool) -> None:
    """To float32 rounding: another library sums the products in another order."""
    if not backends.runs("onednn", "fp32"):
        pytest.skip("oneDNN's fp32 matmul does not run here")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 16, generator=gen, requires_grad=True)
    b = torch.randn(12, generator=gen, requires_grad=True) if bias else None
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    got, want = onednn_linear(x, weight, b), F.linear(x, weight, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(want.shape, generator=gen)
    inputs = (x, weight) if b is None else (x, weight, b)
    grads_got = torch.autograd.grad((got * upstream).sum(), inputs)
    grads_want = torch.autograd.grad((want * upstream).sum(), inputs)
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    inplace = onednn_linear(x.reshape(-1, 16), weight, b)
    inplace.relu_().sum().backward()  # the feed-forward's ReLU works on its output in place


def test_a_bucketing_run_buckets_its_layers_and_its_output_projection(tmp_path, monkeypatch
                                                                      ) -> None:
    """Where the table says so (an AMX CPU faked here), the Trainer's model has no plain
    nn.Linear left and its training step projects with rows in steps of ROWS; it trains."""
    monkeypatch.setattr(backends, "column", lambda: "amx")
    data = make_copy_data(tmp_path / "data", n_train=40, n_valid=8)
    cfg = TrainConfig(max_updates=2, max_tokens=256, max_len=32, warmup=2, precision="bf16",
                      valid_interval=100, save_interval_minutes=0)
    trainer = Trainer(data, tmp_path / "run", model_preset("tiny"), cfg, "cpu",
                      progress=False)
    assert trainer.loss_options.project.keywords == {"multiple": ROWS}
    assert not any(type(m) is nn.Linear for m in trainer.model.modules())
    calls = []

    def counted(x, weight, bias, multiple):
        calls.append(multiple)
        return linear_rows(x, weight, bias, multiple)

    monkeypatch.setattr(linears, "linear_rows", counted)
    trainer.loss_options = LossOptions(0.1, 0, project=functools.partial(counted,
                                                                          multiple=ROWS))
    summary = trainer.run()
    assert summary.step == 2 and calls and set(calls) == {ROWS}
