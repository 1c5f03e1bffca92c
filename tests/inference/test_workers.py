"""Worker processes (`--workers`, `Translator.load(workers=N)`): the same output for any
number, in order; failures and signals lose no finished line and leave no process behind."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.cli import NmtCli

from nmt.api import Translator as ApiTranslator
from nmt.config import DecodeConfig
from nmt.errors import UsageError, WorkerDied
from nmt.inference import translate as engine_module
from nmt.inference.translate import Engine, LineReader, read_lines, translate_stream
from nmt.inference.workers import RemoteTraceback, plan_workers

pytestmark = pytest.mark.usefixtures("one_thread")

# Small batches and buffers: many of each, so the workers interleave and buffers overlap.
CFG = DecodeConfig(beam=2, max_len_b=6, max_tokens=96, buffer_size=40)
FAST = ("--beam", "2", "--max-len-b", "6", "--precision", "fp32", "--max-tokens", "96")


@pytest.fixture(scope="module")
def lines() -> list[str]:
    from conftest import shared_data_path

    text = shared_data_path("multi30k", "test_2016_flickr.en").read_text(encoding="utf-8")
    real = text.split("\n")[:300]
    return [("" if i % 41 == 0 else line) for i, line in enumerate(real)]  # some empty lines


def stream(translator: Engine, lines: list[str]) -> bytes:
    sink = io.BytesIO()
    translate_stream(io.BytesIO(("\n".join(lines) + "\n").encode()), sink, translator)
    return sink.getvalue()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path, lines: list[str]) -> bytes:
    """One process's output, which every worker count must reproduce byte for byte."""
    return stream(Engine.load([tiny_checkpoint], CFG, device="cpu", precision="fp32"), lines)


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
@pytest.mark.parametrize("workers", [2, 3])
def test_any_number_of_workers_writes_the_same_bytes(tiny_checkpoint: Path, lines: list[str],
                                                      reference: bytes, workers: int) -> None:
    with Engine.load([tiny_checkpoint], CFG, device="cpu", precision="fp32",
                         workers=workers) as translator:
        assert translator.workers == workers and len(translator.pool.pids) == workers
        assert stream(translator, lines) == reference
        short = stream(translator, lines[:7])  # fewer batches than workers
    assert short == b"\n".join(reference.split(b"\n")[:7]) + b"\n"
    assert reference.count(b"\n") == len(lines)


@pytest.mark.slow  # forked workers; the fast loop keeps the byte-identity test above
@pytest.mark.parametrize("settings", [dict(nbest=2), dict(sampling=True, nbest=2)])
def test_nbest_and_seeded_sampling_do_not_depend_on_the_workers(
        tiny_checkpoint: Path, lines: list[str], settings: dict) -> None:
    cfg = DecodeConfig(beam=2, max_len_b=6, max_tokens=96, buffer_size=40, **settings)
    outputs = []
    for workers in (1, 2):
        with Engine.load([tiny_checkpoint], cfg, device="cpu", precision="fp32", seed=7,
                             workers=workers) as translator:
            outputs.append(stream(translator, lines[:120]))
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == 120 * 2


@pytest.mark.slow  # forked workers
def test_the_api_spreads_calls_and_threads_over_the_workers(tiny_checkpoint: Path, lines: list[str]
                                                            ) -> None:
    text = [line for line in lines[:90] if line]
    with ApiTranslator.load(tiny_checkpoint, precision="fp32", quiet=True) as one:
        want = one.translate(text, beam=2, max_len_b=6, max_tokens=96)
        sampled = one.translate(text[:20], sampling=True, seed=3, max_len_b=6)
    with ApiTranslator.load(tiny_checkpoint, precision="fp32", quiet=True, workers=2) as two:
        assert two.workers == 2
        got: dict[int, list[str]] = {}

        def call(k: int) -> None:
            got[k] = two.translate(text, beam=2, max_len_b=6, max_tokens=96)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert got == {0: want, 1: want, 2: want}
        assert two.translate(text[:20], sampling=True, seed=3, max_len_b=6) == sampled
    assert two.workers == 1  # closed: later calls decode in this process
    assert two.translate(text[:5], beam=2, max_len_b=6, max_tokens=96) == want[:5]


@pytest.fixture
def boom_ckpt(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """translate_ids raises on a batch holding the source "boom boom boom" (patched before
    the workers are forked, so they run it too); yields that source's ids."""
    vocab = Engine.load([tiny_checkpoint], CFG, device="cpu", precision="fp32").vocab
    boom = vocab.encode(["boom boom boom"])[0]
    real = Engine.translate_ids

    def translate_ids(self: Engine, sources, prefixes=None, *, seed=None):
        if any(list(s) == boom for s in sources):
            raise ValueError("a bug met in a batch")
        return real(self, sources, prefixes, seed=seed)

    monkeypatch.setattr(engine_module.Engine, "translate_ids", translate_ids)
    yield boom


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_batch_that_raises_loses_and_reorders_no_line(tiny_checkpoint: Path, lines: list[str],
                                                         reference: bytes, boom_ckpt: list[int],
                                                         workers: int) -> None:
    bad = list(lines)
    bad[95] = "boom boom boom"  # buffer 3 (lines 81-120) fails
    with Engine.load([tiny_checkpoint], CFG, device="cpu", precision="fp32",
                         workers=workers) as translator:
        sink = io.BytesIO()
        with pytest.raises(ValueError, match="a bug met") as caught:
            translate_stream(io.BytesIO(("\n".join(bad) + "\n").encode()), sink, translator)
        if workers > 1:
            assert isinstance(caught.value.__cause__, RemoteTraceback)
            assert "translate_ids" in caught.value.__cause__.text
        # every buffer before the failing one, whole and in order; nothing after it
        assert sink.getvalue() == b"\n".join(reference.split(b"\n")[:80]) + b"\n"
        assert stream(translator, lines) == reference  # the workers live on


def children_of(pid: int) -> set[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def gone(pids: set[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.slow  # fault injection into a forked worker
def test_a_killed_worker_fails_its_buffer_and_keeps_the_lines_before(
        tiny_checkpoint: Path, lines: list[str], reference: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Engine.translate_ids

    def slow(self: Engine, sources, prefixes=None, *, seed=None):
        time.sleep(0.05)
        return real(self, sources, prefixes, seed=seed)

    monkeypatch.setattr(engine_module.Engine, "translate_ids", slow)
    with Engine.load([tiny_checkpoint], CFG, device="cpu", precision="fp32",
                         workers=2) as translator:
        victim = translator.pool.pids[0]
        many = lines * 4
        sink = io.BytesIO()

        def kill_soon() -> None:
            while sink.tell() == 0:  # the first buffer is out
                time.sleep(0.01)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        with pytest.raises(WorkerDied, match=f"pid {victim}.* killed by signal 9"):
            translate_stream(io.BytesIO(("\n".join(many) + "\n").encode()), sink, translator)
        killer.join()
        out = sink.getvalue()
        full = (reference * 4).split(b"\n")
        assert out and out.endswith(b"\n")
        written = out.split(b"\n")[:-1]
        assert len(written) % 40 == 0 and written == full[:len(written)]  # whole buffers
        assert translator.pool.pids == [translator.pool.pids[0]] != [victim]
        monkeypatch.setattr(engine_module.Engine, "translate_ids", real)
        assert stream(translator, lines[:30]) == b"\n".join(reference.split(b"\n")[:30]) + b"\n"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_signal_with_workers_busy_ends_cleanly(tiny_checkpoint: Path, lines: list[str],
                                                  reference: bytes, nmt_cli: NmtCli,
                                                  how: str) -> None:
    """Every finished line is written, whole and in order; the workers do not outlive it."""
    many = lines * 20
    proc = nmt_cli.popen("translate", "-m", str(tiny_checkpoint), *FAST, "--workers", "2",
                         "--buffer-size", "40", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    feeder = threading.Thread(target=_feed, args=(proc, ("\n".join(many) + "\n").encode()))
    feeder.start()
    first = proc.stdout.readline()  # translating, with workers
    workers = children_of(proc.pid)
    assert len(workers) == 2
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C reaches the whole process group
        os.killpg(proc.pid, signal.SIGINT)
    rest = proc.stdout.read()
    code = proc.wait(timeout=60)
    feeder.join()
    stderr = proc.stderr.read().decode()
    assert (code, stderr.strip()) == ((143, "nmt translate: terminated") if how == "SIGTERM"
                                      else (130, "nmt translate: interrupted"))
    written = (first + rest).split(b"\n")
    assert written[-1] == b"" and len(written) > 1
    assert written[:-1] == (reference * 20).split(b"\n")[:len(written) - 1]
    assert gone(workers), "a worker outlived the command"


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass


def test_a_program_talking_through_a_pipe_gets_each_answer(tiny_checkpoint: Path, nmt_cli: NmtCli
                                                           ) -> None:
    """With workers running ahead of the input, a line is still answered before the
    translator waits for the next one (request/response over a pipe)."""
    proc = nmt_cli.popen("translate", "-m", str(tiny_checkpoint), *FAST, "--workers", "2",
                         "--buffer-size", "1", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        for text in (b"a dog\n", b"two men on a boat\n", b"\n", b"a red car\n"):
            proc.stdin.write(text)
            proc.stdin.flush()
            assert _line_within(proc, 60.0).endswith(b"\n")  # answered, not held back
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0 and proc.stdout.read() == b""
    finally:
        proc.kill()


def _line_within(proc: subprocess.Popen, seconds: float) -> bytes:
    """The next line of the process's stdout, or a test failure after `seconds`."""
    out = b""
    deadline = time.monotonic() + seconds
    fd = proc.stdout.fileno()
    while not out.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"no answer within {seconds} s (got {out!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            break
        out += chunk
    return out


def test_stats_name_the_workers_chosen(tiny_checkpoint: Path, nmt_cli: NmtCli) -> None:
    result = nmt_cli.run("translate", "-m", str(tiny_checkpoint), *FAST, "--stats",
                         input=b"a dog\n")
    assert result.returncode == 0, result.err
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} worker{'s' if cores > 1 else ''} x 1 thread on {cores} core" in result.err
    assert "sentences/s" in result.err


def test_worker_plans() -> None:
    assert plan_workers(None, None, "cpu", 8)[:2] == (8, 1)
    assert plan_workers(None, None, "cpu", 8, latency=True)[:2] == (1, 8)
    assert plan_workers(2, None, "cpu", 8)[:2] == (2, 4)
    assert plan_workers(3, 2, "cpu", 8) == (3, 2, "")  # the user's choice: nothing to say
    assert "2 workers x 4 threads on 8 cores" in plan_workers(2, None, "cpu", 8).note
    assert plan_workers(None, None, "cuda", 8)[0] == 1
    with pytest.raises(UsageError, match="decode on the CPU"):
        plan_workers(2, None, "cuda", 8)
    with pytest.raises(UsageError, match="--workers must be >= 1"):
        plan_workers(0, None, "cpu", 8)


def test_line_reader_knows_when_input_would_wait() -> None:
    for data in (b"a\r\nb\n\nc", b"", b"x\n", b"\n\n", b"no newline", b"\xff\n" * 5000):
        assert list(LineReader(io.BufferedReader(io.BytesIO(data)))) == \
            list(read_lines(io.BytesIO(data)))
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as source:
        reader = LineReader(source)
        lines = iter(reader)
        os.write(write_fd, b"one\ntw")
        assert reader.ready() and next(lines) == b"one"
        assert not reader.ready()  # half a line: the next read would wait
        os.write(write_fd, b"o\n")
        assert reader.ready() and next(lines) == b"two" and not reader.ready()
        os.close(write_fd)
        assert reader.ready() and list(lines) == []
