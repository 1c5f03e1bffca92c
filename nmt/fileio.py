"""File-system helpers every step shares: atomic outputs, hashing, line counts. Imports no
torch.

Outputs are written to a temp file beside the target, fsynced, and renamed into place, so an
interrupted run never leaves a half-written file under its final name, and a failed write
leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from nmt.errors import DataError

CHUNK = 1 << 20  # bytes read per step when hashing or copying
_COUNT_BYTES = 1 << 24  # bytes read per step when counting lines
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync it and rename it to `path`.

    On any exception the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def temp_name_pattern(name_glob: str) -> str:
    """Glob matching the temp files `atomic_output` makes for targets named `name_glob`."""
    return f".{name_glob}.*.tmp"


def remove_stale_temps(directory: Path, name_glob: str) -> list[Path]:
    """Delete temp files left by killed writes of targets matching `name_glob`.

    A process killed with SIGKILL (or a power cut) inside `atomic_output` cannot clean up;
    its temp file is never renamed, so deleting it loses nothing. Call this only where no
    other live writer of the same targets can exist (e.g. the single checkpoint writer of
    a run directory, before it writes).
    """
    removed = []
    for path in Path(directory).glob(temp_name_pattern(name_glob)):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, then rename it over `path`."""
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        write(handle)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks (flat memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def count_lines(path: Path) -> int:
    """Number of lines as `wc -l` counts them, plus a last line without a newline."""
    count, last = 0, b"\n"
    try:
        with open(path, "rb") as handle:
            while block := handle.read(_COUNT_BYTES):
                count += block.count(b"\n")
                last = block[-1:]
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from err
    return count + (last != b"\n")


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: some file systems refuse)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
