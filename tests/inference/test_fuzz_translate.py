"""Issue 6, inputs: fuzz `translate` with hostile text; one output line per input line.

A seeded generator builds inputs of each class; every input goes through the real
streaming pipeline (in process, one model load) and a sample of them through the real CLI
in a subprocess. Classes and counts are in CLASSES; the total is asserted at the end.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
from helpers.checkpoints import make_checkpoint, make_vocab
from helpers.cli import NmtCli

from nmt.config import DecodeConfig
from nmt.errors import DataError
from nmt.inference.translate import Engine, translate_stream

pytestmark = pytest.mark.usefixtures("one_thread")

COMBINING = "\u0301\u0308\u0323\u20dd\u0e31"
RTL = "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 \u202e\u202b\u200f"
CONTROL = "".join(map(chr, [0, 1, 7, 8, 9, 11, 12, 27, 127, 0x85, 0x2028, 0x2029, 0xFEFF]))


def random_bytes(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400)))


def invalid_utf8(rng: random.Random) -> bytes:
    bad = [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xf0\x28\x8c\x28", b"\xed\xa0\x80", b"\x80"]
    words = [rng.choice([b"dog", b"a man", rng.choice(bad)]) for _ in range(rng.randrange(40))]
    return b"\n".join(b" ".join(words[i:i + 3]) for i in range(0, len(words), 3))


def text_from(rng: random.Random, alphabet: str) -> bytes:
    chars = [rng.choice(alphabet) for _ in range(rng.randrange(0, 200))]
    return "".join(chars).encode("utf-8")


def control_chars(rng: random.Random) -> bytes:
    return text_from(rng, CONTROL + "ab \n")


def carriage_returns(rng: random.Random) -> bytes:
    return text_from(rng, "\r\r\n a dog\t")


def combining_rtl(rng: random.Random) -> bytes:
    return text_from(rng, COMBINING + RTL + "abc \n")


def huge_line(rng: random.Random) -> bytes:
    return ("".join(rng.choice("ab c") for _ in range(100_000)) + "\nshort\n").encode()


def empty_lines(_rng: random.Random) -> bytes:
    return b"\n" * 10_000


# class name -> (generator, number of inputs tried)
CLASSES = {
    "random_bytes": (random_bytes, 30),
    "invalid_utf8": (invalid_utf8, 30),
    "nul_and_control": (control_chars, 30),
    "carriage_return": (carriage_returns, 30),
    "combining_and_rtl": (combining_rtl, 30),
    "100k_char_lines": (huge_line, 3),
    "10k_empty_lines": (empty_lines, 1),
}


def expected_lines(data: bytes) -> list[bytes]:
    """Input lines as translate defines them: split at \\n; no final newline still ends one."""
    lines = data.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import shared_data_path

    work = tmp_path_factory.mktemp("fuzz")
    return make_checkpoint(make_vocab(shared_data_path("multi30k"), work), work / "m.pt",
                           max_positions=64)


@pytest.mark.slow
def test_fuzz_one_output_line_per_input_line(ckpt: Path) -> None:
    assert _fuzz(ckpt, per_class=None) == sum(count for _, count in CLASSES.values()) == 154


def test_fuzz_a_few_inputs_of_every_class(ckpt: Path) -> None:
    """The fast loop's share of the fuzz: the first 2 inputs of every class (the
    interactive path included), every check of the full run."""
    assert _fuzz(ckpt, per_class=2) == sum(min(2, c) for _, c in CLASSES.values())


def _fuzz(ckpt: Path, per_class: int | None) -> int:
    """Translate `per_class` generated inputs of every class (all when None) and check
    one output line per input line, order, UTF-8 and --errors strict; returns how many."""
    translator = Engine.load([ckpt], DecodeConfig(beam=2, max_len_b=2), device="cpu")
    strict = Engine.load([ckpt], DecodeConfig(beam=1, max_len_b=1), device="cpu")
    rng = random.Random(1234)
    tried = 0
    for name, (make, count) in CLASSES.items():
        for k in range(count if per_class is None else min(count, per_class)):
            data = make(rng)
            if k % 2 and data.endswith(b"\n"):
                data = data[:-1]  # half the inputs lack a final newline
            lines = expected_lines(data)
            sink = io.BytesIO()
            buffer_size = 1 if k < 2 else rng.choice([7, 2000])  # 1: the interactive path
            translate_stream(io.BytesIO(data), sink, translator, buffer_size=buffer_size,
                             warn=lambda _msg: None)
            out = sink.getvalue()
            assert out.count(b"\n") == len(lines), (name, k)
            assert out == b"" or out.endswith(b"\n")
            out_lines = out.split(b"\n")[:-1]
            for i, line in enumerate(lines):  # empty stays empty: order is preserved
                if line == b"":
                    assert out_lines[i] == b"", (name, k, i)
            out.decode("utf-8")  # always valid UTF-8
            # --errors strict: success on valid UTF-8, else DataError naming the first bad line.
            try:
                data.decode("utf-8")
                first_bad = None
            except UnicodeDecodeError as err:
                first_bad = data.count(b"\n", 0, err.start) + 1
            if first_bad is not None or k < 2:
                try:
                    translate_stream(io.BytesIO(data), io.BytesIO(), strict, errors="strict")
                    assert first_bad is None, (name, k)
                except DataError as err:
                    assert first_bad is not None and f"line {first_bad}:" in str(err)
            tried += 1
    return tried


@pytest.mark.slow
def test_fuzz_through_the_cli(ckpt: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    """One file mixing every class (no final newline) through the real CLI: exit 0."""
    rng = random.Random(99)
    parts = [make(rng) for make, _ in CLASSES.values()] + [b"last line, no newline"]
    data = b"\n".join(parts)
    result = nmt_cli.run("translate", "-m", str(ckpt), "--beam", "2", "--max-len-b", "2",
                         input=data, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.count(b"\n") == len(expected_lines(data))
    assert b"Traceback" not in result.stderr
    strict = nmt_cli.run("translate", "-m", str(ckpt), "--errors", "strict", input=data)
    assert strict.returncode == 3 and b"invalid UTF-8" in strict.stderr
