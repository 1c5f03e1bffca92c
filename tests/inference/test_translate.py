"""`nmt translate` through the real CLI and real pipes on a tiny random-init checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from helpers.cli import NmtCli

from nmt.config import DecodeConfig
from nmt.inference.translate import Engine, read_lines, source_batches, translate_stream
from nmt.precision import resolve_precision

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ("--beam", "2", "--max-len-b", "4")  # keeps CPU time small; order checks need no more
FP32 = ("--precision", "fp32")  # for outputs compared with in-process fp32 decoding


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def test_lines() -> list[str]:
    from conftest import shared_data_path

    text = shared_data_path("multi30k", "test_2016_flickr.en").read_text(encoding="utf-8")
    return text.split("\n")[:-1]


def alone(ckpt: Path, lines: list[str], **cfg: object) -> list[str]:
    """Reference: each line translated on its own, in process, in fp32 (CLI runs compared
    with it pass --precision fp32: bf16 GEMMs may round differently at another batch size)."""
    translator = Engine.load([ckpt], DecodeConfig(**cfg), device="cpu", precision="fp32")
    out = []
    for line in lines:
        ids = translator.vocab.encode([line])[0]
        hyps = translator.translate_ids([ids]) if ids else [[]]
        out.append(translator.vocab.decode([hyps[0][0].tokens])[0] if hyps[0] else "")
    return out


def test_empty_invalid_long_and_unterminated_lines(ckpt: Path, nmt_cli: NmtCli) -> None:
    lines = [b"", b"A dog runs on the beach.", b"bad \xff\xfe bytes", b"word " * 2000, b"",
             b"carriage\rreturn", b"no final newline"]
    result = nmt_cli.run("translate", "-m", str(ckpt), *FAST, input=b"\n".join(lines))
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)  # one line per line, final newline
    assert out[0] == "" and out[4] == ""
    assert all(out[i] for i in (1, 3))  # translated, the 10,000-char line too
    stderr = result.stderr.decode()
    assert "line 4:" in stderr and "truncat" in stderr
    assert stderr.count("\n") == 1  # one warning line, nothing else


def test_errors_strict_names_the_line(ckpt: Path, nmt_cli: NmtCli) -> None:
    result = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, "--errors", "strict",
                            input=b"fine\nalso fine\nbad \xc3\x28 here\n")
    assert result.returncode == 3
    assert b"line 3: invalid UTF-8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_5000_lines_through_a_pipe_keep_count_and_order(ckpt: Path, test_lines: list[str],
                                                        tmp_path: Path, nmt_cli: NmtCli) -> None:
    lines = [(test_lines[i % len(test_lines)] if i % 97 else "") for i in range(5000)]
    src = tmp_path / "src.en"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with src.open("rb") as stdin:  # a real pipe: cat src | nmt translate
        cat = subprocess.Popen(["cat"], stdin=stdin, stdout=subprocess.PIPE)
        proc = nmt_cli.run("translate", "-m", str(ckpt), *FAST, *FP32, "--buffer-size",
                           "700", "--max-tokens", "600", "--stats", stdin=cat.stdout,
                           timeout=600)
        cat.wait()
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode("utf-8").split("\n")[:-1]
    assert len(out) == 5000
    assert all(out[i] == "" for i in range(0, 5000, 97))
    assert b"sentences/s" in proc.stderr
    subset = list(range(1, 5000, 211))
    assert [out[i] for i in subset] == alone(ckpt, [lines[i] for i in subset], beam=2,
                                             max_len_b=4)
    assert len({out[i] for i in subset}) > 5  # outputs depend on the input


def test_output_file_input_file_nbest_and_ensemble(ckpt: Path, test_lines: list[str],
                                                   tmp_path: Path, nmt_cli: NmtCli) -> None:
    src = tmp_path / "in.en"
    src.write_text("\n".join(test_lines[:6]) + "\n\n", encoding="utf-8")
    out = tmp_path / "out.de"
    result = nmt_cli.invoke("translate", "-m", str(ckpt), "-m", str(ckpt), "-i", str(src),
                            "-o", str(out), "--beam", "3", "--nbest", "2", "--max-len-b", "6",
                            *FP32)
    assert result.returncode == 0, result.stderr.decode()
    rows = [line.split("\t") for line in out.read_text(encoding="utf-8").split("\n")[:-1]]
    assert len(rows) == 7 * 2
    assert [int(r[0]) for r in rows] == [i // 2 for i in range(14)]
    for first, second in zip(rows[0:12:2], rows[1:12:2], strict=True):
        assert float(first[1]) >= float(second[1])
    # An ensemble of one model twice is that model; nbest line 1 is the 1-best.
    single = alone(ckpt, test_lines[:6], beam=3, max_len_b=6)
    assert [r[2] for r in rows[0:12:2]] == single
    assert not list(tmp_path.glob(".out.de.*"))  # atomic write left no temp file


@pytest.mark.isa
def test_default_precision_is_auto(ckpt: Path, test_lines: list[str], nmt_cli: NmtCli) -> None:
    """`nmt translate` decodes at --precision auto unless told otherwise: its output equals
    the explicit `--precision auto` one, and auto loads the weights in the dtype the
    device's policy picks (bf16 on a CPU where native bf16 is faster than fp32, else fp32)."""
    source = ("\n".join(test_lines[:8]) + "\n").encode()
    default = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, input=source)
    auto = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, "--precision", "auto", input=source)
    assert default.returncode == 0 and auto.returncode == 0, default.stderr.decode()
    assert default.stdout == auto.stdout and default.stdout.count(b"\n") == 8
    translator = Engine.load([ckpt], DecodeConfig(beam=2), device="cpu", precision="auto")
    expected = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        resolve_precision("auto", torch.device("cpu"))]
    assert all(p.dtype == expected for p in translator.models[0].parameters())


def test_sampling_is_seeded(ckpt: Path, nmt_cli: NmtCli) -> None:
    args = ("translate", "-m", str(ckpt), "--sampling", "--max-len-b", "8", "--seed", "3")
    one = nmt_cli.invoke(*args, input=b"a man\na woman\n")
    two = nmt_cli.invoke(*args, input=b"a man\na woman\n")
    assert one.returncode == 0, one.stderr.decode()
    assert one.stdout == two.stdout and one.stdout.count(b"\n") == 2


def test_head_closes_pipe_quietly(ckpt: Path, test_lines: list[str], nmt_cli: NmtCli) -> None:
    data = ("\n".join(test_lines[:300]) + "\n").encode()
    proc = nmt_cli.popen("translate", "-m", str(ckpt), *FAST, "--buffer-size", "10",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(data)
    proc.stdin.close()
    proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    assert proc.stderr.read() == b""


def test_ctrl_c_ends_quietly(ckpt: Path, nmt_cli: NmtCli) -> None:
    proc = nmt_cli.popen("translate", "-m", str(ckpt), *FAST, "--buffer-size", "1",
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"a dog\n")
    proc.stdin.flush()
    assert proc.stdout.readline() != b""  # it is up and streaming (buffer of one line)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.stderr.read().strip() == b"nmt translate: interrupted"


def test_stream_in_process_and_helpers(ckpt: Path) -> None:
    import io

    assert list(read_lines(io.BytesIO(b"a\r\nb\n\nc"))) == [b"a\r", b"b", b"", b"c"]
    # Sorted lengths 1, 2, 5, 9 (+ EOS): 2 x 3 = 6 fits 12; 3 x 6 = 18 does not; 2 x 10 > 12.
    assert source_batches([5, 1, 9, 2], 12) == [[1, 3], [0], [2]]
    assert source_batches([50], 12) == [[0]]  # too long for the budget: alone
    translator = Engine.load([ckpt], DecodeConfig(beam=2, max_len_b=3), device="cpu",
                                 max_src_len=5)
    sink = io.BytesIO()
    warnings: list[str] = []
    stats = translate_stream(io.BytesIO(b"one two three four five six seven eight\n\n"), sink,
                             translator, warn=warnings.append)
    assert sink.getvalue().count(b"\n") == 2 and stats.sentences == 2
    assert len(warnings) == 1 and "line 1:" in warnings[0]


def test_bad_flags_and_missing_model(ckpt: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    result = nmt_cli.invoke("translate", "-m", str(tmp_path / "none.pt"), input=b"x\n")
    assert result.returncode == 3 and b"no such checkpoint" in result.stderr
    result = nmt_cli.invoke("translate", "-m", str(ckpt), "--nbest", "5", input=b"x\n")
    assert result.returncode == 2 and b"--nbest 5 exceeds --beam 4" in result.stderr
    result = nmt_cli.invoke("translate", "-m", str(ckpt), "--max-src-len", "100000", input=b"x\n")
    assert result.returncode == 2
    if not torch.cuda.is_available():
        result = nmt_cli.invoke("translate", "-m", str(ckpt), "--device", "cuda", input=b"x\n")
        assert result.returncode == 2 and b"no CUDA device" in result.stderr


def test_ctrl_c_ends_even_when_the_interrupt_is_swallowed(tmp_path: Path) -> None:
    # A KeyboardInterrupt raised inside a finalizer is printed and dropped by Python; a
    # filter then blocked on stdin must still end (exit 130) instead of hanging.
    script = tmp_path / "swallow.py"
    script.write_text(
        "import signal, sys, time\n"
        "from nmt.cli.common import interrupt_surely\n"
        "interrupt_surely('translate', grace_seconds=1.0)\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        sys.stdout.write('in del\\n'); sys.stdout.flush(); time.sleep(3)\n"
        "obj = Slow()\n"
        "del obj\n"
        "sys.stdin.buffer.readline()\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.readline() == b"in del\n"
    proc.send_signal(signal.SIGINT)  # lands in __del__: Python ignores it there
    assert proc.wait(timeout=30) == 130
    assert b"nmt translate: interrupted" in proc.stderr.read()


def test_output_text_never_holds_a_line_break_of_any_kind() -> None:
    """A generated piece can hold \\x1c, NEL or U+2028, which str.splitlines() and many
    readers treat as line ends: written as spaces, one line stays one line."""
    from nmt.inference.translate import sanitize

    text = "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh\x85i\u2028j\u2029k\x06l"
    clean = sanitize(text)
    assert len(clean.splitlines()) == 1 and len(clean) == len(text)
    assert clean == "a b c d e f g h i j k\x06l"
