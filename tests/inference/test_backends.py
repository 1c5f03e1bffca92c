"""The table of CPU backends (nmt/inference/backends.py): each CPU's column, and in every
column the layer each precision gets equals the rules it replaced (the first backend that
runs and takes the weight, the fallbacks where a kernel is not loaded or a width is no
multiple of its step, nothing quantized without torch's int8 kernels); `render` and the
real layers on this machine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import REPO
from helpers.models import make_model
from torch import nn

from nmt import kernels
from nmt.inference import backends, int8_linear, mkl_linear, packed_linear
from nmt.inference.int8_linear import Int8Linear
from nmt.inference.kernel_linear import KernelLinear
from nmt.inference.mkl_linear import MklLinear
from nmt.inference.packed_linear import PackedLinear
from nmt.kernels.levels import LEVELS

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = {  # /proc/cpuinfo flags of a CPU of each class
    "baseline": "sse2 sse4_2",
    "avx2": "sse4_2 avx avx2 fma f16c",
    "avx2_vnni": "sse4_2 avx avx2 fma f16c avx_vnni",
    "avx512": "sse4_2 avx avx2 fma f16c avx512f avx512cd avx512bw avx512dq avx512vl",
    "avx512_bf16": ("sse4_2 avx avx2 fma f16c avx512f avx512cd avx512bw avx512dq avx512vl "
                    "avx512_bf16 avx512_vnni"),
    "amx": ("sse4_2 avx avx2 fma f16c avx512f avx512cd avx512bw avx512dq avx512vl "
            "avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"),
}
WHAT_RUNS = ("mkl", "onednn-fp32", "onednn-bf16", "amx-bf16", "amx-int8", "avx2", "torch-int8")


@pytest.mark.parametrize(("level", "vendor", "machine", "want"), [
    ("amx", "GenuineIntel", "x86_64", "amx"),
    ("avx512_bf16", "GenuineIntel", "x86_64", "intel-avx512"),
    ("avx512", "GenuineIntel", "x86_64", "intel-avx512"),
    ("avx2_vnni", "GenuineIntel", "x86_64", "intel-avx2"),
    ("avx2", "GenuineIntel", "x86_64", "intel-avx2"),
    ("avx512_bf16", "AuthenticAMD", "x86_64", "amd-avx512"),
    ("avx512", "HygonGenuine", "x86_64", "amd-avx512"),
    ("avx2", "AuthenticAMD", "x86_64", "amd-avx2"),
    ("baseline", "GenuineIntel", "x86_64", "other"),
    ("baseline", "AuthenticAMD", "x86_64", "other"),
    ("avx512", "", "aarch64", "other"),  # the x86 flags mean nothing there
])
def test_the_column_comes_from_the_class_and_the_vendor(
        monkeypatch: pytest.MonkeyPatch, level: str, vendor: str, machine: str,
        want: str) -> None:
    for name in kernels.CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: machine)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(FLAGS[level].split()))
    monkeypatch.setattr(mkl_linear, "cpu_info", lambda: {"vendor_id": vendor})
    assert backends.column() == want


def test_caps_move_a_cpu_to_a_lower_column(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in kernels.CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(FLAGS["amx"].split()))
    monkeypatch.setattr(mkl_linear, "cpu_info", lambda: {"vendor_id": "GenuineIntel"})
    assert backends.column() == "amx"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert backends.column() == "intel-avx512"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert backends.column() == "intel-avx2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert backends.column() == "other"


class Made(nn.Module):
    """A stand-in for a backend's layer: which one was made."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind


def loads(level: str, cpu_class: str) -> bool:
    """Whether a kernel whose lowest build is `level` loads on a CPU of `cpu_class`."""
    return list(LEVELS).index(cpu_class) >= list(LEVELS).index(level)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A CPU of `state["class"]` (Intel's where `state["intel"]`), each backend running
    where its `state` entry says (a kernel only where it could load); layers made are
    `Made` stand-ins, so that no library is needed."""
    state: dict = {"class": "avx512", "intel": False, **dict.fromkeys(WHAT_RUNS, True)}
    monkeypatch.setattr(kernels, "cpu_class", lambda: state["class"])
    monkeypatch.setattr(mkl_linear, "is_intel", lambda: state["intel"])
    monkeypatch.setattr(mkl_linear, "works", lambda: state["mkl"])
    monkeypatch.setattr(packed_linear, "works", lambda dtype: state[
        "onednn-fp32" if dtype == torch.float32 else "onednn-bf16"])
    monkeypatch.setattr(int8_linear, "available", lambda: state["torch-int8"])
    for key, flag, level in ((("nmt-amx", "bf16"), "amx-bf16", "amx"),
                             (("nmt-amx", "int8"), "amx-int8", "amx"),
                             (("nmt-avx2", "int8"), "avx2", "avx2")):
        monkeypatch.setitem(backends.SPECS, key, replace(
            backends.SPECS[key],
            works=lambda flag=flag, level=level: state[flag] and loads(level, state["class"])))
    monkeypatch.setattr(backends, "MklLinear", lambda w, b: Made("mkl"))
    monkeypatch.setattr(backends, "PackedLinear", lambda w, b: Made("onednn"))
    monkeypatch.setattr(backends, "Int8Linear",
                        lambda w, b, keep_quantized=False: Made("torch-int8"))
    monkeypatch.setattr(backends, "KernelLinear",
                        lambda spec, w, b, keep_quantized=False: Made(spec.name))
    return state


def rules(state: dict, precision: str, width: int) -> str:
    """The choice before the table, as it was written down: what `backends.layer` must
    make for a weight of `width` inputs ("torch": none, nn.Linear stays)."""
    level = state["class"]
    if precision == "fp32":
        if state["intel"] and state["mkl"]:
            return "mkl"
        return "onednn" if state["onednn-fp32"] else "torch"
    if precision == "bf16":
        if level == "amx" and width % 32 == 0 and state["amx-bf16"]:
            return "AMX bf16 kernel"
        return "onednn" if state["onednn-bf16"] else "torch"
    if not state["torch-int8"]:  # no int8 kernel of torch's: not quantized, fp32's layers
        return rules(state, "fp32", width)
    if level == "amx" and width % 64 == 0 and state["amx-int8"]:
        return "AMX int8 kernel"
    below_avx512 = list(LEVELS).index(level) < list(LEVELS).index("avx512")
    if below_avx512 and width % 32 == 0 and state["avx2"] and loads("avx2", level):
        return "AVX2 int8 kernel"
    return "torch-int8"


def test_every_column_chooses_as_the_rules_did(fake: dict) -> None:
    """Every class and vendor, every combination of what runs, widths that are a multiple
    of 64, of 32 only, and of neither: the same layer as the rules (int8 through `prepare`'s
    gate: without torch's int8 kernels the fp32 row)."""
    checked = set()
    for level, intel in itertools.product(LEVELS, (True, False)):
        fake.update({"class": level, "intel": intel})
        checked.add(backends.column())
        for runs in itertools.product((True, False), repeat=len(WHAT_RUNS)):
            fake.update(zip(WHAT_RUNS, runs, strict=True))
            for precision, width in itertools.product(("fp32", "bf16", "int8"), (128, 96, 40)):
                quantized = precision != "int8" or fake["torch-int8"]
                made = backends.layer(torch.zeros(8, width), None,
                                      precision if quantized else "fp32")
                got = "torch" if made is None else made.kind
                assert got == rules(fake, precision, width), (level, intel, fake, precision,
                                                              width)
    assert checked == set(backends.COLUMNS)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_prepare_swaps_every_linear_and_makes_the_projection(
        fake: dict, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 model's projection keeps its int8 weight (`keep_quantized`); without
    torch's int8 kernels an int8 model is prepared as fp32; where nothing runs, nothing is
    swapped and the projection is the plain matmul."""
    kept: list[bool] = []
    monkeypatch.setattr(backends, "Int8Linear", lambda w, b, keep_quantized=False: (
        kept.append(keep_quantized) or Made("torch-int8")))
    model = make_model().to(backends.DTYPES.get(precision, torch.float32))
    linears = sum(type(m) is nn.Linear for m in model.modules())
    projection = backends.prepare(model, precision)
    want = rules(fake, precision, model.config.d_model)
    assert isinstance(projection, Made) and projection.kind == want
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, Made) for m in model.modules()) == linears
    assert kept == ([False] * linears + [True] if precision == "int8" else [])
    fake["torch-int8"] = False
    plain = make_model()
    assert backends.prepare(plain, "int8").kind == rules(fake, "fp32", 64) == "onednn"
    fake.update({"onednn-fp32": False, "onednn-bf16": False})
    plain = make_model().to(backends.DTYPES.get(precision, torch.float32))
    assert backends.prepare(plain, precision) is None
    assert sum(type(m) is nn.Linear for m in plain.modules()) == linears


def test_prepare_leaves_other_models_alone(fake: dict) -> None:
    half = make_model().to(torch.float16)
    assert backends.prepare(half, "fp16") is None and backends.prepare(half, "int8") is None
    assert any(type(m) is nn.Linear for m in half.modules())
    bf16 = make_model().to(torch.bfloat16)  # int8 asked of a bf16 model: its own dtype's
    assert backends.prepare(bf16, "int8").kind == "onednn"


def test_the_descriptive_rows_follow_the_linear_rows() -> None:
    """The output projection is a linear of its precision; the C decoder step is tried
    exactly where a linear it can call is; every column has a cell for every row."""
    for (operation, precision), cells in backends.TABLE.items():
        assert len(cells) == len(backends.COLUMNS)
        if operation == "output projection":
            assert cells == backends.TABLE["linear", precision]
        if operation == "decoder step":
            for linear, step in zip(backends.TABLE["linear", precision], cells, strict=True):
                assert ("nmt-step" in step) == bool(backends.C_CALLABLE & set(linear))


def test_render_lists_every_column_and_backend() -> None:
    table = backends.render()
    lines = table.splitlines()
    assert lines[0].split("|")[3:-1] == [f" {c} " for c in backends.COLUMNS]
    used = {name for cells in backends.TABLE.values() for names in cells for name in names}
    assert used <= set(backends.LEGEND)
    for name in used:
        assert any(line.startswith(f"- `{name}`: ") for line in lines), name
    for operation, precision in backends.TABLE:
        assert any(line.startswith(f"| {operation} | {precision} |") for line in lines)


def backend_of(layer: nn.Module, precision: str) -> str:
    """The name of the backend whose layer `layer` is."""
    if isinstance(layer, KernelLinear):
        return next(name for (name, p), spec in backends.SPECS.items()
                    if p == precision and spec is layer.spec)
    names = {MklLinear: "mkl", PackedLinear: "onednn", Int8Linear: "torch-int8"}
    return names.get(type(layer), "torch")


@pytest.mark.isa
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_this_machine_gets_the_layer_its_cell_names(precision: str) -> None:
    """The real layers: each linear is the first backend of this CPU's cell that runs
    here and takes its weight, and the projection too."""
    model = make_model().to(backends.DTYPES.get(precision, torch.float32))
    weights = {name: m.weight for name, m in model.named_modules() if type(m) is nn.Linear}
    weights["projection"] = model.output_weight
    projection = backends.prepare(model, precision)
    if precision == "int8" and not backends.runs("torch-int8", "int8"):
        precision = "fp32"  # nothing quantized
    layers = {**dict(model.named_modules()), "projection": projection}
    for name, weight in weights.items():
        want = next(n for n in backends.cell("linear", precision)
                    if backends.runs(n, precision)
                    and ((n, precision) not in backends.SPECS
                         or backends.SPECS[n, precision].fits(weight)))
        assert backend_of(layers[name], precision) == want, name


@pytest.mark.parametrize("doc", ["docs/performance.md", "docs/design.md"])
def test_the_docs_print_the_table_as_it_is(doc: str) -> None:
    """The table in the docs is `render()`'s, between its markers: regenerate it with
    `python -c "from nmt.inference.backends import render; print(render())"`."""
    text = (REPO / doc).read_text(encoding="utf-8")
    begin = text.index("<!-- the backend table:")
    start = text.index("\n", begin) + 1
    end = text.index("<!-- end of the backend table -->", start)
    assert text[start:end].rstrip("\n") == backends.render(), f"{doc}: regenerate the table"
