"""Exceptions the library raises for expected failures, each with its CLI exit code.

The CLI turns any `NmtError` into one line on stderr (`nmt CMD: error: ...`) and exits with
`exit_code`; anything else is a bug and keeps its traceback. Exit codes (documented in
README.md):

    0   success
    1   unexpected internal error (a bug: traceback shown)
    2   usage: bad flag value, unknown recipe, command not built
    3   input data: missing/unreadable/malformed file, line-count mismatch
    4   integrity: checksum mismatch, truncated or corrupt archive
    5   network: download failed
    6   checkpoint: unreadable, unsafe, or incompatible checkpoint
    7   training aborted: too many non-finite losses in a row
    8   distributed: a peer process died or timed out
    9   a translation worker process died (killed, out of memory)
    75  training preempted (SIGTERM or SIGUSR1): saved at the next update; run it again
    130 interrupted (Ctrl-C)
    143 terminated (SIGTERM) where a command stops cleanly on it (translate)
"""

from __future__ import annotations


class NmtError(Exception):
    """Base class of expected errors; `str(err)` is the one-line message."""

    exit_code: int = 1


class UsageError(NmtError):
    """A flag, option or recipe value is invalid."""

    exit_code = 2


class DataError(NmtError):
    """An input file is missing, unreadable or malformed."""

    exit_code = 3


class IntegrityError(NmtError):
    """A checksum does not match, or an archive is truncated or corrupt."""

    exit_code = 4


class DownloadError(NmtError):
    """A download failed (network error, HTTP error, missing mirror file)."""

    exit_code = 5


class CheckpointError(NmtError):
    """A checkpoint cannot be loaded safely, or does not fit what is asked of it."""

    exit_code = 6


class TrainingAborted(NmtError):
    """Training stopped rather than save broken weights (e.g. repeated NaN losses)."""

    exit_code = 7


class DistributedError(NmtError):
    """A peer process of a distributed run died or stopped answering."""

    exit_code = 8


class WorkerDied(NmtError):
    """A translation worker process (`--workers`) died or did not start; the lines
    written before its batch are complete and in order."""

    exit_code = 9


class Preempted(NmtError):
    """Training stopped on SIGTERM or SIGUSR1 (a scheduler's preemption notice) after
    saving at the next update boundary; the same command resumes. 75 is EX_TEMPFAIL:
    schedulers and wrappers read it as "try again"."""

    exit_code = 75
