"""The C kernels' loader (nmt/kernels): built at install for each ISA level, chosen per CPU.

A library built for a level the CPU lacks is never loaded (a home directory or image shared
by two CPU generations once crashed translation with SIGILL); the caps bound the level as
they bound torch's kernels; where no library applies, nothing is printed and the PyTorch
paths run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nmt import kernels
from nmt.inference import fused_attention
from nmt.kernels.levels import KERNELS, LEVELS

# /proc/cpuinfo flags of the CPU classes nmt is measured on (the vector ones).
ZEN3 = "sse4_2 avx avx2 fma f16c bmi2"  # AMD EPYC Zen 3: AVX2 only
SKYLAKE = ZEN3 + " avx512f avx512cd avx512bw avx512dq avx512vl"  # AVX-512, no bf16/VNNI
ZEN5 = SKYLAKE + " avx512_bf16 avx512_vnni avx_vnni"  # AMD EPYC Zen 4/5
SAPPHIRE = SKYLAKE + " avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"  # Xeon, AMX
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    """Set the flags the loader sees (an x86-64 CPU) and no caps."""
    for name in CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")

    def pretend(flags: str) -> None:
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags.split()))

    return pretend


@pytest.mark.parametrize(("flags", "want"), [
    (ZEN3, "avx2"), (SKYLAKE, "avx512"), (ZEN5, "avx512_bf16"), (SAPPHIRE, "amx"),
    ("sse4_2", "baseline")])
def test_the_class_is_the_best_level_the_cpu_reports(cpu, flags: str, want: str) -> None:
    cpu(flags)
    assert kernels.cpu_class() == want


def test_every_level_needs_what_the_one_before_it_in_a_kernel_needs() -> None:
    """A kernel's levels grow: a CPU that runs one runs those before it (the loader walks
    down the list until one fits)."""
    for name, levels in KERNELS.items():
        for low, high in zip(levels, levels[1:], strict=False):
            assert set(LEVELS[low][1]) <= set(LEVELS[high][1]), (name, low, high)


@pytest.mark.parametrize(("cap", "value", "top"), [
    ("ATEN_CPU_CAPABILITY", "avx2", "avx2"), ("ATEN_CPU_CAPABILITY", "default", "baseline"),
    ("ATEN_CPU_CAPABILITY", "avx512", "amx"), ("ONEDNN_MAX_CPU_ISA", "AVX2", "avx2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", "avx512_bf16"),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", "amx")])
def test_the_caps_bound_the_class(cpu, monkeypatch: pytest.MonkeyPatch, cap: str,
                                  value: str, top: str) -> None:
    cpu(SAPPHIRE)
    monkeypatch.setenv(cap, value)
    assert kernels.cpu_class() == top
    assert ("capped at" in (kernels.allowed("amx") or "")) == (top != "amx")


def _kernel_dir(tmp_path: Path, levels: dict[str, Path]) -> Path:
    """A kernels directory holding `levels` (level -> the library to copy there) of the
    attention kernel."""
    where = tmp_path / "kernels"
    where.mkdir()
    for level, library in levels.items():
        shutil.copy(library, where / f"fused_attention_{level}.so")
    return where


def _built(level: str) -> Path:
    path = fused_attention.KERNEL.path(level)
    if not path.is_file():
        pytest.skip(f"the attention kernel's {level} library was not built at install")
    return path


@pytest.mark.parametrize("flags", [ZEN3, SKYLAKE])
def test_a_library_for_a_level_the_cpu_lacks_is_never_loaded(cpu, tmp_path: Path,
                                                            monkeypatch, flags) -> None:
    """Every level's file present, the CPU one of AVX2 (or AVX-512): the best it runs is
    chosen, never a higher one."""
    cpu(flags)
    here = _built("avx2")
    monkeypatch.setattr(kernels, "HERE", _kernel_dir(tmp_path, {
        level: here for level in KERNELS["fused_attention"]}))
    kernel = kernels.Kernel("fused_attention", fused_attention.KERNEL.entry,
                            fused_attention.PARAMS, lambda lib: True)
    status = kernel.status()
    assert status.level == ("avx2" if flags == ZEN3 else "avx512")
    assert "this CPU lacks" in kernels.allowed("amx")


def test_where_no_library_was_built_the_pytorch_path_runs_silently(
        cpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    cpu(ZEN5)
    empty = tmp_path / "none"
    empty.mkdir()
    monkeypatch.setattr(kernels, "HERE", empty)
    kernel = kernels.Kernel("fused_attention", "nmt_attention", fused_attention.PARAMS,
                            lambda lib: True)
    assert kernel.library() is None and kernel.status().level is None
    assert "not built at install" in kernel.status().note
    assert capfd.readouterr().err == ""


def test_nmt_kernels_0_turns_every_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMT_KERNELS", "0")
    assert not fused_attention.enabled()
    assert "NMT_KERNELS=0" in fused_attention.KERNEL.status().note


@pytest.mark.slow
def test_a_cpu_that_lacks_a_level_survives_its_library_beside_it(tmp_path: Path) -> None:
    """In a fresh process: the avx512 library of the attention kernel is one that dies of
    SIGILL the moment it is loaded, the CPU is told to be AVX2-only; loading picks the avx2
    library and runs it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the trap library")
    here = _built("avx2")
    trap = tmp_path / "trap.c"
    trap.write_text("__attribute__((constructor)) static void trap(void) "
                    "{ __builtin_trap(); }\n")
    where = _kernel_dir(tmp_path, {"avx2": here})
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(where / "fused_attention_avx512.so"),
                    str(trap)], check=True)
    code = (
        "import platform\n"
        "from nmt import kernels\n"
        f"kernels.HERE = __import__('pathlib').Path({str(where)!r})\n"
        f"kernels.cpu_flags = lambda: frozenset({ZEN3!r}.split())\n"
        "platform.machine = lambda: 'x86_64'\n"
        "from nmt.inference import fused_attention\n"
        "print(fused_attention.KERNEL.status().level)\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["avx2"]
