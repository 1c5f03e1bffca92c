"""Row counts in steps for bf16 training on an AMX CPU (nmt/model/row_buckets.py): the same
outputs and gradients as the plain layers, the same parameters and state dict, and used
only where oneDNN compiles per shape with AMX (nmt/train/setup.py's `buckets_rows`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_model, random_batch
from torch import nn

from nmt.inference import amx_linear
from nmt.model.row_buckets import RowBucketedLinear, bucket_rows, linear_rows
from nmt.train.setup import buckets_rows

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
    assert bucket_rows(bucketed, 16) == n_linear > 0
    assert bucketed.row_multiple == 16
    assert not any(type(m) is nn.Linear for m in bucketed.modules())
    assert all(m.row_multiple == 16 for m in bucketed.modules()
               if isinstance(m, RowBucketedLinear))
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


def test_wanted_only_for_bf16_on_a_cpu_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(amx_linear, "has_amx", lambda: True)
    assert buckets_rows(cpu, "bf16")
    assert not buckets_rows(cpu, "fp32")
    assert not buckets_rows(torch.device("meta"), "bf16")
    monkeypatch.setenv("NMT_ROW_BUCKETS", "0")
    assert not buckets_rows(cpu, "bf16")
    monkeypatch.delenv("NMT_ROW_BUCKETS")
    monkeypatch.setattr(amx_linear, "has_amx", lambda: False)  # no AMX, or capped below it
    assert not buckets_rows(cpu, "bf16")
