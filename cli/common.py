"""What every subcommand shares: error-to-exit-code mapping and stderr messages."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from nmt.errors import NmtError

# Messages and progress bars go to stderr; stdout carries data only.
console = Console(stderr=True, highlight=False)

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process it killed


class Terminated(BaseException):
    """SIGTERM arrived in a command that stops cleanly on it (see `interrupt_surely`)."""


def fail(command: str, message: str, code: int) -> NoReturn:
    """Print `nmt COMMAND: error: MESSAGE` on one line of stderr and exit with `code`."""
    text = " ".join(str(message).split("\n"))
    sys.stderr.write(f"nmt {command}: error: {text}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def warn(command: str, message: str) -> None:
    """One warning line on stderr."""
    sys.stderr.write(f"nmt {command}: warning: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def handle_errors(command: str) -> Iterator[None]:
    """Map library errors to one-line messages and exit codes; Ctrl-C and closed pipes
    end quietly (130 and 0); anything else is a bug and keeps its traceback."""
    try:
        yield
    except NmtError as err:
        fail(command, str(err), err.exit_code)
    except KeyboardInterrupt:
        _say_stopped(command, EXIT_INTERRUPTED)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Terminated:
        _say_stopped(command, EXIT_TERMINATED)
        raise typer.Exit(EXIT_TERMINATED) from None
    except BrokenPipeError:
        # `nmt translate | head`: the reader left. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise typer.Exit(0) from None


def interrupt_surely(command: str, grace_seconds: float = 5.0,
                     terminate: bool = False) -> None:
    """Make Ctrl-C end this process even when Python drops the KeyboardInterrupt.

    The interrupt is raised wherever the main thread is; if that is a finalizer (a
    `__del__` or weakref callback), Python prints and ignores it, and a filter that then
    blocks reading stdin would never end. The handler installed here raises as usual and
    also starts a daemon timer that, if the process is still alive `grace_seconds` later,
    says "interrupted" and exits 130 at once. For commands with no cleanup that matters
    (translate writes its output file atomically; a temp file left behind is all).

    With `terminate`, SIGTERM does the same with `Terminated` (exit 143, "terminated"),
    so the command can write what it finished and stop its workers first.
    """

    def on_signal(signum: int, frame: object) -> None:
        code = EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED
        timer = threading.Timer(grace_seconds, _exit_interrupted, args=(command, code))
        timer.daemon = True
        timer.start()
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    if terminate:
        signal.signal(signal.SIGTERM, on_signal)


def _say_stopped(command: str, code: int) -> None:
    """`nmt COMMAND: interrupted` (Ctrl-C) or `... terminated` (SIGTERM) on stderr."""
    sys.stderr.write(f"nmt {command}: "
                     f"{'terminated' if code == EXIT_TERMINATED else 'interrupted'}\n")
    sys.stderr.flush()


def _exit_interrupted(command: str, code: int = EXIT_INTERRUPTED) -> None:
    _say_stopped(command, code)
    os._exit(code)


def model_files(command: str, paths: list[Path]) -> list[Path]:
    """The checkpoint files `-m` names: a run directory becomes its average.pt, else
    checkpoint_best.pt, else checkpoint_last.pt (nmt.checkpoint.resolve_model_path), and
    the choice is said on stderr."""
    from nmt.checkpoint import resolve_model_paths

    return resolve_model_paths(paths, lambda given, file: console.print(
        f"nmt {command}: -m {given}: using {file}", markup=False, soft_wrap=True))
