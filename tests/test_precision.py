"""--precision auto and slow half precision on a CPU: what each CPU class gets.

`auto` asks oneDNN whether bf16 is native and takes it where it also measured faster than
fp32 (cached per machine); `ONEDNN_MAX_CPU_ISA=AVX2` is the documented way to make oneDNN
answer no (what an AVX2-only CPU answers). An explicit bf16 where it is emulated or slower
than fp32 is named with its measured cost (`precision_note`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import nmt.precision as precision_policy
from nmt.precision import (
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
SPEED_PROBE = "from nmt.precision import cpu_bf16_speedup; print(cpu_bf16_speedup())"


def run_probe(probe: str = PROBE, **env: str) -> list[str]:
    """Run `probe` in a fresh interpreter (oneDNN reads its ISA cap once per process)."""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120, check=True)
    return result.stdout.splitlines()


def test_auto_follows_native_bf16_that_pays() -> None:
    assert cpu_bf16_pays() == (cpu_native("bf16") and precision_policy.cpu_bf16_speedup()
                               >= precision_policy.BF16_PAYS_FROM)
    assert resolve_precision("auto", CPU) == ("bf16" if cpu_bf16_pays() else "fp32")
    assert resolve_precision("fp32", CPU) == "fp32"


@pytest.mark.parametrize("speedup", [0.52, 1.1, 1.9])
def test_native_bf16_is_taken_only_where_it_is_faster(monkeypatch, speedup: float) -> None:
    """A CPU with native bf16 kernels that run them slower than fp32 (an Intel Xeon whose
    AMX the hypervisor hides: AVX512-BF16 at about half fp32's speed) gets fp32 from
    `auto`, says why, and names an explicit bf16 as slow; a CPU where bf16 is faster by
    BF16_PAYS_FROM or more gets bf16 and no note."""
    monkeypatch.setattr(precision_policy, "cpu_native", lambda precision: True)
    monkeypatch.setattr(precision_policy, "cpu_bf16_speedup", lambda: speedup)
    pays = speedup >= precision_policy.BF16_PAYS_FROM
    assert resolve_precision("auto", CPU) == ("bf16" if pays else "fp32")
    auto = precision_note(resolve_precision("auto", CPU), CPU, True, setting="auto")
    explicit = precision_note("bf16", CPU, False)
    if pays:
        assert auto is None and explicit is None
    else:
        assert auto == (f"auto: fp32, as this CPU's native bf16 matmul measured "
                        f"{speedup:.2f}x fp32's speed here")
        assert explicit is not None and explicit.startswith(
            "slow: this CPU computes bf16 natively, but its bf16 matmul measured "
            f"{speedup:.2f}x fp32's speed here")
        assert explicit.endswith("--precision auto picks fp32")
    assert precision_note("fp32", CPU, True, setting="fp32") is None


def test_bf16_speed_is_measured_once_per_machine_and_kept(tmp_path) -> None:
    """The measurement is written to the cache directory and read back by later processes
    (so every run and every rank decides alike), keyed by the ISA caps too."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first = float(run_probe(SPEED_PROBE, **env)[0])
    files = list((tmp_path / "nmt").glob("bf16-speed-*.json"))
    assert len(files) == 1 and first > 0
    record = json.loads(files[0].read_text(encoding="utf-8"))
    assert record["fp32_ms"] > 0 and record["bf16_ms"] > 0
    assert record["speedup"] == pytest.approx(first)
    files[0].write_text(json.dumps({**record, "speedup": 7.5}), encoding="utf-8")
    assert float(run_probe(SPEED_PROBE, **env)[0]) == 7.5  # read, not measured again
    other = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2" else "AVX2"
    run_probe(SPEED_PROBE, ONEDNN_MAX_CPU_ISA=other, **env)  # another cap: another key
    assert len(list((tmp_path / "nmt").glob("bf16-speed-*.json"))) == 2
    assert not list((tmp_path / "nmt").glob("*.tmp"))  # written atomically


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
    assert slowdown > 1.0  # emulated bf16 (fp32 math plus conversions) is never faster


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
