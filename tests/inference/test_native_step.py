"""The native decoder step (nmt/inference/native_step.py): the PyTorch layers' step bit for
bit, on MKL's fp32 linears, on the AMX kernels' int8 and bf16 ones and on the AVX2 int8
kernel's (every step's logits,
whole beam searches, the rows-fed and regrouped paths, cache growth, several threads, odd
head sizes), what it leaves to PyTorch, and a trained model translating byte-identically
with and without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import torch_threads
from helpers.models import make_model, random_batch

from nmt import kernels
from nmt.inference import amx_linear, avx2_linear, backends, mkl_linear, native_step
from nmt.inference.backends import swap_linears
from nmt.inference.decoding import DecodingWorkspace, decode_step
from nmt.inference.kernel_linear import KernelLinear
from nmt.inference.mkl_linear import MklLinear
from nmt.inference.native_step import NativeStep, plan_for, takes
from nmt.inference.packed_linear import PackedLinear
from nmt.inference.search import beam_search, greedy_decode, max_output_lengths
from nmt.model.transformer import Transformer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.isa]

needs_native = pytest.mark.skipif(
    not (mkl_linear.works() and native_step.KERNEL.enabled()),
    reason="no MKL packed sgemm in this torch, or no C compiler: the native step cannot run")

needs_int8 = pytest.mark.skipif(
    not (isinstance(backends.layer(torch.zeros(8, 64), None, "int8"), KernelLinear)
         and native_step.KERNEL.enabled()),
    reason="int8 layers are torch's here (an AVX-512 CPU without AMX-INT8, or no C "
           "compiler), which the native step does not take")

needs_avx2_int8 = pytest.mark.skipif(
    not (avx2_linear.INT8.works() and native_step.KERNEL.enabled()),
    reason="no AVX2 int8 kernel here (no AVX2, or no C compiler)")

needs_amx_bf16 = pytest.mark.skipif(
    not (kernels.allowed("amx") is None and amx_linear.BF16.works()
         and native_step.KERNEL.enabled()),
    reason="no AMX-BF16 kernel here (no AMX, kernels capped below it, or no C compiler): "
           "bf16 layers are oneDNN's, which the native step does not take")

SHAPES = {  # name -> make_model overrides
    "tiny": {},  # d_k = d_v = 16: the attention kernel's plain loops
    "d64": {"d_model": 128, "heads": 2},  # d_k = d_v = 64: its vector path
    "dk_ne_dv": {"d_k": 8, "d_v": 16},
}


def mkl_model(seed: int = 0, **overrides: object) -> Transformer:
    """A tiny random model with every linear on MKL's packed sgemm (what the translator
    makes of an fp32 model on an Intel CPU)."""
    model = make_model(seed, **overrides)
    swap_linears(model, MklLinear)
    return model


def int8_model(seed: int = 0, **overrides: object) -> Transformer:
    """The same with every linear on the int8 kernel the translator picks here (AMX's on a
    CPU with AMX-INT8, else the AVX2 one)."""
    model = make_model(seed, **overrides)
    swap_linears(model, lambda weight, bias: backends.layer(weight, bias, "int8"))
    fc2 = model.decoder[0].ffn.fc2
    assert isinstance(fc2, KernelLinear) and fc2.spec.int8
    return model


def avx2_int8_model(seed: int = 0, **overrides: object) -> Transformer:
    """The same with every linear on the AVX2 int8 kernel, whatever this CPU would pick
    (on an AVX-512 CPU its VNNI build)."""
    model = make_model(seed, **overrides)
    swap_linears(model, lambda weight, bias: KernelLinear(avx2_linear.INT8, weight, bias))
    return model


def bf16_model(seed: int = 0, **overrides: object) -> Transformer:
    """The same in bf16 with every linear on the AMX bf16 kernel (the translator's bf16
    layers on a CPU with AMX-BF16)."""
    model = make_model(seed, **overrides).to(torch.bfloat16)
    swap_linears(model, lambda weight, bias: KernelLinear(amx_linear.BF16, weight, bias))
    return model


MAKERS = [pytest.param(mkl_model, id="fp32"),
          pytest.param(int8_model, id="int8", marks=needs_int8),
          pytest.param(avx2_int8_model, id="int8-avx2", marks=needs_avx2_int8),
          pytest.param(bf16_model, id="bf16", marks=needs_amx_bf16)]


def workspaces(model: Transformer) -> tuple[DecodingWorkspace, DecodingWorkspace]:
    """Two workspaces of `model`: with the native step, and with it taken away."""
    native, plain = DecodingWorkspace(model), DecodingWorkspace(model)
    assert native.native is not None
    plain.native = None
    return native, plain


def search(workspace: DecodingWorkspace, src: torch.Tensor, beam: int, min_len: int = 1,
           max_b: int = 5) -> list:
    max_lens = max_output_lengths(src, 1.0, max_b)
    with torch.inference_mode(), workspace.decoder(src) as decoder:
        if beam == 1:
            return [[h] for h in greedy_decode(decoder, max_lens, alpha=0.6, min_len=min_len)]
        return beam_search(decoder, max_lens, beam=beam, alpha=0.6, nbest=2, min_len=min_len)


def as_tuples(hyps: list) -> list:
    return [[(h.tokens, h.score) for h in row] for row in hyps]


@needs_native
@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_steps_logits_are_the_pytorch_steps(shape: str, make: object,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Step by step through one decoder's life: the first step (one row a sentence),
    the expansion to beams, steps on every row, on whole sentences only (the fed entries),
    a reorder into one row per group; then rows that are not whole sentences, which the
    PyTorch layers take. Logits equal bit for bit, and the native step ran where it
    should."""
    model = make(**SHAPES[shape])
    native, plain = workspaces(model)
    ran: list[bool] = []
    real_step = NativeStep.step

    def counting(self: NativeStep, *args: object, **kwargs: object) -> torch.Tensor | None:
        got = real_step(self, *args, **kwargs)
        ran.append(got is not None)
        return got

    monkeypatch.setattr(NativeStep, "step", counting)
    src = random_batch([7, 3, 5], seed=2)  # padded
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode(), native.decoder(src) as a, plain.decoder(src) as b:
        def both(call: str, *args: object) -> None:
            got, want = getattr(a, call)(*args), getattr(b, call)(*args)
            if isinstance(got, torch.Tensor):
                assert torch.equal(got, want), call

        def tokens(n: int) -> torch.Tensor:
            return torch.randint(4, 50, (n,), generator=gen)

        both("step", tokens(3))
        expand = torch.arange(3).repeat_interleave(4)
        both("regroup", expand, 4, None)  # groups of 4
        for _ in range(3):
            both("step", tokens(12))
            order = torch.randperm(4, generator=gen)
            both("regroup", (torch.arange(3)[:, None] * 4 + order).view(-1), 4, None)
        rows = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])  # sentences 0 and 2
        both("step_rows", tokens(8), rows, 12)
        both("step_rows", tokens(8), rows, 12)
        both("reorder", rows[torch.randperm(8, generator=gen)])  # any order: g = 1
        assert a.state.group_size == 1
        both("step", tokens(8))
        both("step_rows", tokens(3), torch.tensor([0, 4, 5]), 8)  # g = 1: whole groups
        both("regroup", torch.tensor([0, 0, 4, 4]), 2, torch.tensor([0, 4]))
        both("step_rows", tokens(1), torch.tensor([3]), 4)  # half a group: PyTorch's
    assert ran == [True] * 8 + [False]


@needs_native
@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("beam", [1, 4])
def test_searches_find_the_same_hypotheses_with_the_same_scores(
        shape: str, beam: int, make: object) -> None:
    """Whole searches over a batch whose sentences finish at different steps (the fed
    entries shrink; the caches compact), forced past the caches' first capacity (16
    positions: they grow): the same hypotheses and scores, to the last bit."""
    model = make(seed=1, **SHAPES[shape])
    native, plain = workspaces(model)
    src = random_batch([9, 2, 6, 4, 11], seed=4)
    for min_len, max_b in ((1, 5), (20, 24)):
        got = search(native, src, beam, min_len, max_b)
        want = search(plain, src, beam, min_len, max_b)
        assert as_tuples(got) == as_tuples(want)
    assert max(len(h.tokens) for row in got for h in row) >= 20


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
@needs_native
@pytest.mark.parametrize("make", MAKERS)
def test_two_threads_give_the_one_thread_result(make: object) -> None:
    """With two torch threads (the attention split by sentence, the linears' threads) the
    native step and the PyTorch layers still agree bit for bit."""
    model = make(seed=2, d_model=128, heads=2)
    native, plain = workspaces(model)
    src = random_batch([5, 8, 3, 6, 7, 4, 9, 2], seed=5)
    with torch_threads(2):
        assert as_tuples(search(native, src, 4)) == as_tuples(search(plain, src, 4))


@needs_native
def test_the_agreement_check_passes_and_the_plan_is_made() -> None:
    lib = native_step.KERNEL.library()
    assert lib is not None and native_step._agrees(lib)
    model = mkl_model()
    assert takes(model) and plan_for(model) is not None


@needs_native
def test_what_it_leaves_to_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No plan for a pre-norm model, one whose linears are not MKL's, a model in training
    mode, or without the C step's library; a step that wants the attention weights runs
    the PyTorch layers (and stores them) even with a plan."""
    assert plan_for(mkl_model(pre_norm=True)) is None
    assert plan_for(make_model()) is None  # plain nn.Linear
    if torch.backends.mkldnn.is_available():
        onednn = make_model()
        swap_linears(onednn, PackedLinear)
        assert plan_for(onednn) is None
    assert plan_for(mkl_model().train()) is None
    with monkeypatch.context() as patch:
        patch.setattr(native_step.KERNEL, "library", lambda: None)
        assert plan_for(mkl_model()) is None
        assert DecodingWorkspace(mkl_model()).native is None

    model = mkl_model()
    plan = plan_for(model)
    assert plan is not None
    src = random_batch([4, 6], seed=6)
    with torch.inference_mode():
        states = [DecodingWorkspace(model).decoder(src).state for _ in range(2)]
        bos = torch.full((2,), 2)
        got = decode_step(model, bos, states[0], need_attention=True, native=plan.stepper())
        want = decode_step(model, bos, states[1], need_attention=True)
    assert torch.equal(got, want) and states[0].attention is not None
    assert torch.equal(states[0].attention, states[1].attention)


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("precision", [pytest.param("fp32"),
                                       pytest.param("int8", marks=needs_int8),
                                       pytest.param("bf16", marks=needs_amx_bf16)])
def test_a_trained_model_translates_byte_identically(multi30k_model: Path, precision: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`Translator` on a model trained on Multi30k, test2016's first 60 lines: the same
    output with the native step as without its library, whole batches and one line at a
    time."""
    from conftest import shared_data_path

    from nmt.api import Translator

    monkeypatch.setattr(mkl_linear, "is_intel", lambda: True)  # MKL's linears on any CPU
    lines = (shared_data_path("multi30k") / "test_2016_flickr.en").read_text(
        encoding="utf-8").splitlines()[:60]
    outputs = {}
    for flag in ("1", "0"):
        with monkeypatch.context() as patch:
            if flag == "0":
                patch.setattr(native_step.KERNEL, "library", lambda: None)
            translator = Translator.load(multi30k_model, precision=precision, threads=1,
                                         quiet=True)
            try:
                workspace = translator._engine.workspaces[0]
                assert (workspace.native is not None) == (flag == "1")
                outputs[flag] = (translator.translate(lines),
                                 [translator.translate([line])[0] for line in lines[:15]])
            finally:
                translator.close()
    assert outputs["1"] == outputs["0"]
    assert sum(bool(line) for line in outputs["1"][0]) == 60


@needs_native
def test_a_changed_model_gets_no_stepper() -> None:
    """A plan reads addresses once: after a decoder linear is swapped or the LayerNorms'
    parameters are moved (`.to()`), its workspace's decoders step through the PyTorch
    layers instead of stale memory."""
    model = mkl_model()
    plan = plan_for(model)
    assert plan is not None and plan.stepper() is not None
    fc1 = model.decoder[1].ffn.fc1
    model.decoder[1].ffn.fc1 = MklLinear(torch.randn(fc1.out_features, fc1.in_features),
                                         fc1.bias)
    assert plan.stepper() is None
    model.decoder[1].ffn.fc1 = fc1
    assert plan.stepper() is not None
    model.to(torch.float64)  # the LayerNorms' parameters move
    assert plan.stepper() is None
    workspace = DecodingWorkspace(mkl_model())
    assert workspace.native is not None
    workspace.model.decoder[0].res_ffn.norm.to(torch.float64)
    src = random_batch([4, 6], seed=7)
    with torch.inference_mode(), workspace.decoder(src) as decoder:
        assert decoder._native is None
