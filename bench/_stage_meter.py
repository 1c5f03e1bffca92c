"""Runs one command as a measured stage: wall time, CPU time, peak memory, disk it leaves.

The command runs in its own session; a thread samples the proportional set size (Pss, from
/proc/PID/smaps_rollup: shared pages split among the processes sharing them, so forked
workers are not counted twice) of every process in that session, and the peak of the sum is
the stage's memory. CPU time is the user + system time of the command and every descendant
it waited for (os.wait4). Each stderr line is kept with the second it arrived, so a caller
can split a stage into phases by the lines a command prints.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Measured:
    """One stage's cost, and its stderr lines as (seconds since start, text)."""

    command: list[str]
    returncode: int
    wall_s: float
    cpu_s: float
    peak_mib: float
    lines: list[tuple[float, str]] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        """The record's figures, rounded."""
        return {"wall_s": round(self.wall_s, 2), "cpu_s": round(self.cpu_s, 2),
                "peak_mib": round(self.peak_mib, 1)}

    def at(self, text: str) -> float | None:
        """When the first stderr line holding `text` arrived (None if none did)."""
        return next((t for t, line in self.lines if text in line), None)


def _session_pss_kib(sid: int) -> int:
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            # Fields after the command's ")" : state ppid pgrp session ...
            if int(stat[stat.rindex(")") + 2:].split()[3]) != sid:
                continue
            for line in Path(entry.path, "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue  # the process ended meanwhile
    return total


def run_stage(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
              stdout: Path | None = None, interval: float = 0.25) -> Measured:
    """Run `command` to its end, measuring it; stdout goes to `stdout` (else discarded)."""
    out = open(stdout, "wb") if stdout is not None else subprocess.DEVNULL
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE,
                            start_new_session=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _session_pss_kib(proc.pid))
            done.wait(interval)

    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append((time.perf_counter() - start, raw.decode("utf-8", "replace").rstrip()))

    threads = [threading.Thread(target=sample, daemon=True),
               threading.Thread(target=read, daemon=True)]
    for thread in threads:
        thread.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    for thread in threads:
        thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if stdout is not None:
        out.close()  # type: ignore[union-attr]
    # (usage.ru_maxrss is no use here: a forked child starts with its parent's RSS.)
    return Measured(command, proc.returncode, wall, usage.ru_utime + usage.ru_stime,
                    peak[0] / 1024, lines)


def disk_bytes(*paths: Path) -> int:
    """Bytes the files under `paths` occupy (allocated blocks, as du counts them)."""
    total = 0
    for root in paths:
        if root.is_file():
            total += root.stat().st_blocks * 512
            continue
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    total += (Path(dirpath) / name).lstat().st_blocks * 512
                except OSError:
                    continue
    return total
