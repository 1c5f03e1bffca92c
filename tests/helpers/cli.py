"""The one way tests run the `nmt` CLI; conftest's `nmt_cli` fixture is NMT_CLI.

Two modes, one result (CliResult: returncode, stdout and stderr as bytes; .out, .err and
.output as text), so a test reads the same whichever it uses:

- `nmt_cli.run(*args)`: a real `python -m nmt.cli.main` process, for what needs one: exit codes
  through signals, real pipes and stdin/stdout bytes, torchrun, a fresh interpreter.
- `nmt_cli.invoke(*args)`: in process through typer's CliRunner (no interpreter start), for
  cheap cases (bad flags, usage errors) and for faults monkeypatched into this process.

`nmt_cli.popen(*args)` starts the process for tests that stream to it or signal it, with the
command line and environment of `run` (`argv`, `env`). Keywords change what a test needs
changed: `env` (a value None unsets the variable), `input`; in a subprocess also `cwd` and
`timeout`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
Arg = str | os.PathLike | int | float
Env = Mapping[str, str | None]
# A developer's mirror must not leak into the tests (only `nmt prep` reads it); a test that
# wants one sets it.
_BASE_ENV: dict[str, str | None] = {"NMT_MIRROR": None}


@dataclass(frozen=True)
class CliResult:
    """What a CLI run gave: the arguments after `nmt`, the exit status, both streams."""

    args: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        """stdout as text (UTF-8)."""
        return self.stdout.decode("utf-8")

    @property
    def err(self) -> str:
        """stderr as text (UTF-8)."""
        return self.stderr.decode("utf-8")

    @property
    def output(self) -> str:
        """stdout then stderr, as text: for checks that do not care which stream."""
        return self.out + self.err


def _apply(env: dict[str, str], changes: Env) -> dict[str, str]:
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


class NmtCli:
    """The `nmt` CLI, run in a subprocess (`run`, `popen`) or in process (`invoke`)."""

    def __init__(self, entry: Sequence[str] = ("-m", "nmt.cli.main")) -> None:
        self.entry = tuple(entry)

    def instrumented(self, code: str) -> NmtCli:
        """The CLI started as `python -c code ARGS` instead: test-only instrumentation of
        the child process; `code` ends by calling nmt.cli.main.main(). Subprocess modes only."""
        return NmtCli(("-c", code))

    def argv(self, *args: Arg) -> list[str]:
        """The command line of `nmt ARGS` as `run` and `popen` start it."""
        return [sys.executable, *self.entry, *map(str, args)]

    @staticmethod
    def env(env: Env | None = None) -> dict[str, str]:
        """The child's environment: this one, UTF-8 streams, one OpenMP thread per process,
        the repository on PYTHONPATH, no NMT_MIRROR; then `env` (None unsets a variable)."""
        paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        base = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(paths)}
        return _apply(_apply(base, _BASE_ENV), env or {})

    def run(self, *args: Arg, input: bytes | str | None = None, env: Env | None = None,
            cwd: Arg = REPO, timeout: float = 300, **popen_kwargs: object) -> CliResult:
        """Run `nmt ARGS` in a subprocess to its end (from REPO unless `cwd`), `input` on
        its stdin (or pass stdin=, preexec_fn=, ... through to subprocess.run)."""
        data = input.encode("utf-8") if isinstance(input, str) else input
        done = subprocess.run(self.argv(*args), input=data, capture_output=True, cwd=cwd,
                              env=self.env(env), timeout=timeout, check=False,
                              **popen_kwargs)
        return CliResult(tuple(map(str, args)), done.returncode, done.stdout, done.stderr)

    def popen(self, *args: Arg, env: Env | None = None, cwd: Arg = REPO,
              **popen_kwargs: object) -> subprocess.Popen[bytes]:
        """Start `nmt ARGS` and return the process (pipes as `popen_kwargs` say)."""
        return subprocess.Popen(self.argv(*args), cwd=cwd, env=self.env(env),
                                **popen_kwargs)

    def invoke(self, *args: Arg, input: bytes | str | None = None,
               env: Env | None = None) -> CliResult:
        """Run `nmt ARGS` in this process through typer's CliRunner (`env` applies while it
        runs; the working directory is this process's); an exception other than SystemExit
        propagates, as a traceback would end a real process."""
        from typer.testing import CliRunner

        from nmt.cli.main import app

        if self.entry != ("-m", "nmt.cli.main"):
            raise TypeError("an instrumented CLI runs in a subprocess only")
        argv = list(map(str, args))
        # A command may install SIGINT/SIGTERM handlers (cli/common.py `interrupt_surely`):
        # this process's own come back after it, or a later test's child processes would
        # inherit a handler that raises instead of ending them.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            result = CliRunner().invoke(app, argv, input=input,
                                        env={**_BASE_ENV, **(env or {})},
                                        catch_exceptions=False)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return CliResult(tuple(argv), result.exit_code, result.stdout_bytes,
                         result.stderr_bytes or b"")


NMT_CLI = NmtCli()


def assert_one_line(result: CliResult, code: int, *words: str) -> None:
    """`result` failed with exit `code` and one stderr line, `nmt COMMAND: error: ...` (or
    `nmt COMMAND SUBCOMMAND: error: ...`), that holds every one of `words`; nothing on
    stdout, no traceback."""
    assert result.returncode == code, result.err
    lines = result.err.splitlines()
    prefix = re.compile(rf"nmt {re.escape(result.args[0])}( [a-z0-9]+)?: error: ")
    assert len(lines) == 1 and prefix.match(lines[0]), result.err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.err and result.out == ""
