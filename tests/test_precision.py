"""--precision auto and slow half precision on a CPU: what each CPU class gets.

`auto` takes bf16 where oneDNN computes it natively and the CPU is of a kind whose bf16
matmuls measured faster than fp32's: AMX, or AVX512-BF16 on an AMD CPU (`bf16_rule`, from
the CPU's features: nothing measured or cached per run); `ONEDNN_MAX_CPU_ISA=AVX2` is the
documented way to make oneDNN answer no (what an AVX2-only CPU answers). An explicit bf16
where it is emulated or slower than fp32 is named with its cost (`precision_note`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nmt.precision as precision_policy
from nmt import kernels
from nmt.precision import (
    bf16_rule,
    cpu_bf16_pays,
    cpu_native,
    measure_bf16_speedup,
    precision_note,
    resolve_precision,
)

pytestmark = pytest.mark.isa

CPU = torch.device("cpu")
PROBE = ("from nmt.precision import precision_note, resolve_precision; import torch; "
         "cpu = torch.device('cpu'); print(resolve_precision('auto', cpu)); "
         "print(precision_note('bf16', cpu, True))")
BASE = "avx2 fma f16c avx512f avx512cd avx512bw avx512dq avx512vl avx512_bf16 avx512_vnni"


def run_probe(probe: str = PROBE, **env: str) -> list[str]:
    """Run `probe` in a fresh interpreter (oneDNN reads its ISA cap once per process)."""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120, check=True)
    return result.stdout.splitlines()


def test_auto_follows_the_rule() -> None:
    assert cpu_bf16_pays() == bf16_rule()[0]
    assert not cpu_bf16_pays() or cpu_native("bf16")
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_bf16_pays() else "fp32")
    assert resolve_precision("fp32", CPU) == "fp32"


@pytest.mark.parametrize(("vendor", "flags", "pays"), [
    ("GenuineIntel", BASE + " amx_tile amx_bf16 amx_int8", True),  # Xeon with AMX
    ("AuthenticAMD", BASE, True),  # Zen 4 / Zen 5
    ("GenuineIntel", BASE, False),  # Cooper Lake, or a Xeon whose AMX is hidden
])
def test_native_bf16_is_taken_only_on_cpus_where_it_measured_faster(
        monkeypatch, vendor: str, flags: str, pays: bool) -> None:
    """A CPU with native bf16 kernels that run them slower than fp32 (an Intel Xeon whose
    AMX the hypervisor hides: AVX512-BF16 at about half fp32's speed) gets fp32 from
    `auto`, says why, and names an explicit bf16 as slow; AMX, or AVX512-BF16 on an AMD
    CPU, gets bf16 and no note."""
    for cap in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(cap, raising=False)
    monkeypatch.setattr(precision_policy, "cpu_native", lambda precision: True)
    monkeypatch.setattr(precision_policy, "cpu_info", lambda: {"vendor_id": vendor})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert resolve_precision("auto", CPU) == ("bf16" if pays else "fp32")
    auto = precision_note(resolve_precision("auto", CPU), CPU, True, setting="auto")
    explicit = precision_note("bf16", CPU, False)
    if pays:
        assert auto is None and explicit is None
    else:
        assert auto == "auto: fp32, as " + bf16_rule()[1]
        assert explicit == "slow: " + bf16_rule()[1] + ". --precision auto picks fp32"
        assert "about half fp32's speed" in explicit
    assert precision_note("fp32", CPU, True, setting="fp32") is None


def test_nothing_is_written_to_the_cache_directory(tmp_path) -> None:
    """`auto` is decided from the CPU's features in every process: no timing is cached."""
    run_probe(XDG_CACHE_HOME=str(tmp_path), HOME=str(tmp_path))
    assert not any(tmp_path.rglob("*"))


def test_the_measurement_leaves_one_thread_per_process_as_it_was() -> None:
    before = torch.get_num_threads()
    record = measure_bf16_speedup(size=64, repeats=2)
    assert torch.get_num_threads() == before
    assert record["speedup"] == pytest.approx(record["fp32_ms"] / record["bf16_ms"])


def test_capped_isa_means_fp32_and_a_named_cost() -> None:
    auto, note = run_probe(ONEDNN_MAX_CPU_ISA="AVX2")
    assert auto == "fp32"
    assert note.startswith("slow: ") and "no native bf16" in note and "slower than fp32" in note
    assert note.endswith("--precision auto picks fp32")
    slowdown = float(note.split("measured ")[1].split("x slower")[0])
    # A figure was measured and named; how large is the machine's (and its load's) to say:
    # beside other work on 2 cores it read 0.9 once (docs/performance.md has the figures).
    assert slowdown > 0


def test_no_note_where_nothing_is_slow() -> None:
    for precision in ("fp32", "int8"):
        assert precision_note(precision, CPU, True) is None
    assert precision_note("bf16", torch.device("cuda"), True) is None
    if cpu_bf16_pays():
        assert precision_note("bf16", CPU, True) is None


@pytest.mark.slow  # three interpreters, each capped before oneDNN starts: 5 s
def test_train_and_translate_name_emulated_bf16(tmp_path, nmt_cli) -> None:
    """`nmt train --precision bf16` on a CPU that emulates it says so on its start-up line,
    with the cost; `nmt translate --precision bf16` warns; both still run. `auto` is
    silent."""
    from helpers.data import make_copy_data

    data = make_copy_data(tmp_path / "data", n_train=60, n_valid=8)
    run = tmp_path / "run"
    capped = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = nmt_cli.run("train", data, "-o", run, "--arch", "tiny", "--device", "cpu",
                       "--max-updates", "1", "--max-tokens", "256", "--precision", "bf16",
                       env=capped)
    assert done.returncode == 0, done.err
    startup = next(line for line in done.err.splitlines() if "precision bf16" in line)
    assert "precision bf16 on cpu (slow: this CPU has no native bf16" in startup
    assert "slower than fp32 here. --precision auto picks fp32)" in startup
    model = str(run / "checkpoint_last.pt")
    out = nmt_cli.run("translate", "-m", model, "--precision", "bf16", input="a b c\n\nd e\n",
                      env=capped)
    assert out.returncode == 0, out.err
    assert len(out.out.split("\n")) == 4  # one line per input line
    warning = [line for line in out.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "--precision bf16 will be slow" in warning[0]
    quiet = nmt_cli.run("translate", "-m", model, input="a b c\n", env=capped)
    assert quiet.returncode == 0 and "warning" not in quiet.err
