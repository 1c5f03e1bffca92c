"""--precision auto and emulated half precision on a CPU: what each CPU class gets.

`auto` asks oneDNN whether bf16 is native; `ONEDNN_MAX_CPU_ISA=AVX2` is the documented way to
make it answer no (what an AVX2-only CPU answers). An explicit bf16 where it is emulated is
named with its measured cost (`emulation_note`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nmt.precision import cpu_native, emulation_note, resolve_precision

pytestmark = pytest.mark.isa

CPU = torch.device("cpu")
PROBE = ("from nmt.precision import emulation_note, resolve_precision; import torch; "
         "cpu = torch.device('cpu'); print(resolve_precision('auto', cpu)); "
         "print(emulation_note('bf16', cpu, True))")


def run_probe(**env: str) -> list[str]:
    """Run PROBE in a fresh interpreter (oneDNN reads its ISA cap once per process)."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120, check=True)
    return result.stdout.splitlines()


def test_auto_follows_native_bf16() -> None:
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_native("bf16") else "fp32")
    assert resolve_precision("fp32", CPU) == "fp32"


def test_capped_isa_means_fp32_and_a_named_cost() -> None:
    auto, note = run_probe(ONEDNN_MAX_CPU_ISA="AVX2")
    assert auto == "fp32"
    assert "no native bf16" in note and "slower than fp32" in note
    assert note.endswith("--precision auto picks fp32")
    slowdown = float(note.split("measured ")[1].split("x slower")[0])
    assert slowdown > 1.0  # emulated bf16 (fp32 math plus conversions) is never faster


def test_no_note_where_nothing_is_emulated() -> None:
    for precision in ("fp32", "int8"):
        assert emulation_note(precision, CPU, True) is None
    assert emulation_note("bf16", torch.device("cuda"), True) is None
    if cpu_native("bf16"):
        assert emulation_note("bf16", CPU, True) is None


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
