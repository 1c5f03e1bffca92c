"""Results as data: the record every measured figure the docs quote becomes, and the one
place that builds, checks, reads and appends records (bench/results/README.md has the
schema).

The benches that measure the docs' figures call `add_argument` for their `--record [PATH]`
flag and `append(make(...))` at the end, so a figure goes from the run into
bench/results/<kind>.jsonl with its date, commit, command and machine (`nmt doctor`'s
report) without being copied by hand; bench/results/tables.py renders the docs' tables from
these files. Plain data: importing this module imports neither torch nor nmt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KINDS = ("demo", "translate-cpu", "train-cpu", "gpu-train", "gpu-translate", "tune",
         "wmt-rehearsal")
SYSTEMS = ("nmt", "ctranslate2", "fairseq", "sentencepiece")
REQUIRED = ("kind", "date", "commit", "command", "cpu", "system", "settings", "figures")
CPU_FIELDS = ("model", "flags", "class")
GPU_FIELDS = ("device", "driver", "torch", "cuda")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}(-dirty)?$")


def default_path(kind: str) -> Path:
    """Where records of `kind` live: bench/results/<kind>.jsonl."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return HERE / f"{kind}.jsonl"


def problems(record: Any) -> list[str]:
    """What is wrong with one record (empty: well-formed): the required fields, their
    types, a known kind and system, a date, a commit, the CPU's facts (and a GPU record's
    GPU facts), numbers or nested numbers among the figures."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    found = [f"missing {name!r}" for name in REQUIRED if name not in record]
    if found:
        return found
    if record["kind"] not in KINDS:
        found.append(f"kind {record['kind']!r} is not one of {KINDS}")
    if record["system"] not in SYSTEMS:
        found.append(f"system {record['system']!r} is not one of {SYSTEMS}")
    if not isinstance(record["date"], str) or not _DATE.match(record["date"]):
        found.append(f"date {record['date']!r} is not YYYY-MM-DD")
    if not isinstance(record["commit"], str) or not _COMMIT.match(record["commit"]):
        found.append(f"commit {record['commit']!r} is not a short hash")
    if not isinstance(record["command"], str) or not record["command"]:
        found.append("command is empty")
    cpu = record["cpu"]
    if not isinstance(cpu, dict) or any(name not in cpu for name in CPU_FIELDS):
        found.append(f"cpu needs {CPU_FIELDS}")
    elif not isinstance(cpu["flags"], list):
        found.append("cpu flags is not a list")
    if str(record["kind"]).startswith("gpu-"):
        gpu = record.get("gpu")
        if not isinstance(gpu, dict) or any(name not in gpu for name in GPU_FIELDS):
            found.append(f"a GPU record needs gpu with {GPU_FIELDS}")
    if not isinstance(record["settings"], dict):
        found.append("settings is not an object")
    figures = record["figures"]
    if not isinstance(figures, dict) or not figures:
        found.append("figures is not a non-empty object")
    elif not any(_numbers(value) for value in figures.values()):
        found.append("figures hold no number")
    return found


def _numbers(value: Any) -> bool:
    """Whether `value` is a number or a list/object holding one."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    if isinstance(value, dict):
        return any(_numbers(v) for v in value.values())
    if isinstance(value, list):
        return any(_numbers(v) for v in value)
    return False


def load(kind: str, path: Path | None = None) -> list[dict[str, Any]]:
    """The records of `kind` in file order (the order they were measured in), each checked;
    a malformed line or a record of another kind is a ValueError naming its line."""
    path = path or default_path(kind)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON: {error}") from None
        wrong = problems(record)
        if not wrong and record["kind"] != kind:
            wrong = [f"kind {record['kind']!r} in the {kind} file"]
        if wrong:
            raise ValueError(f"{path}:{number}: {'; '.join(wrong)}")
        records.append(record)
    return records


def cpu_facts(doctor: dict[str, Any] | None) -> dict[str, Any]:
    """The CPU as `nmt doctor --json` reports it under "cpu": model, vector flags, class
    (what nmt sees it as under the ISA caps in force), the caps, the cores."""
    cpu = (doctor or {}).get("cpu") or {}
    return {"model": cpu.get("model"), "flags": list(cpu.get("flags") or []),
            "class": cpu.get("class"), "caps": dict(cpu.get("caps") or {}),
            "cores": cpu.get("cores")}


def gpu_facts(doctor: dict[str, Any] | None) -> dict[str, Any] | None:
    """The first GPU as `nmt doctor --json` reports it (device, driver, torch, CUDA), or
    None where it saw none."""
    doctor = doctor or {}
    gpus = doctor.get("gpus") or {}
    devices = gpus.get("devices") or []
    if not devices:
        return None
    torch = doctor.get("torch") or {}
    return {"device": devices[0].get("name"), "count": len(devices),
            "memory_gib": devices[0].get("memory_gib"), "driver": gpus.get("driver"),
            "torch": torch.get("version"), "cuda": torch.get("cuda")}


def git_commit(repo: Path = REPO) -> str:
    """`git rev-parse --short HEAD` of the checkout measured, "-dirty" added where tracked
    files differ from it ("unknown" outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                              capture_output=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, text=True, capture_output=True, check=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command that measured, as typed from the repository root: `python` and the
    script's arguments."""
    return shlex.join(["python", *(sys.argv if argv is None else argv)])


def make(kind: str, system: str, settings: dict[str, Any], figures: dict[str, Any],
         doctor: dict[str, Any] | None, *, command: str | None = None,
         note: str | None = None, run: str | None = None, date: str | None = None,
         commit: str | None = None) -> dict[str, Any]:
    """One record: today's date, this checkout's commit and command line unless given, the
    CPU (and for GPU kinds the GPU) from `doctor` (`nmt.doctor.report()`)."""
    record: dict[str, Any] = {
        "kind": kind, "date": date or datetime.date.today().isoformat(),
        "commit": commit or git_commit(), "command": command or command_line(),
        "cpu": cpu_facts(doctor), "system": system, "settings": settings,
        "figures": figures}
    if kind.startswith("gpu-"):
        record["gpu"] = gpu_facts(doctor) or {name: None for name in GPU_FIELDS}
    if run:
        record["run"] = run
    if note:
        record["note"] = note
    wrong = problems(record)
    if wrong:
        raise ValueError(f"record not well-formed: {'; '.join(wrong)}")
    return record


def run_id() -> str:
    """An id shared by the records one bench run appends (UTC time to the second and the
    process id), so a table can pair a run's nmt and peer records."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y-%m-%dT%H:%M:%SZ}-{os.getpid()}"


def append(records: Iterable[dict[str, Any]], path: Path) -> int:
    """Append `records`, one JSON line each, in one write to a file opened for appending
    (a reader never sees half a line; two benches appending at once do not interleave
    within a line). Returns how many were written."""
    lines = "".join(json.dumps(record, sort_keys=False) + "\n" for record in records)
    if not lines:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = lines.encode("utf-8")
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"{path}: wrote {written} of {len(data)} bytes")
    finally:
        os.close(fd)
    return lines.count("\n")


def add_argument(parser: argparse.ArgumentParser, kind: str) -> None:
    """`--record [PATH]`: append this run's records to PATH, by default
    bench/results/<kind>.jsonl."""
    parser.add_argument("--record", nargs="?", type=Path, const=default_path(kind),
                        default=None, metavar="PATH",
                        help=f"Append this run's records (bench/results/README.md) to PATH "
                             f"(default {default_path(kind).relative_to(REPO)}).")


def write(records: list[dict[str, Any]], path: Path | None) -> None:
    """Append `records` to `path` where --record asked for it, saying so on stderr."""
    if path is None:
        return
    count = append(records, path)
    print(f"recorded {count} record(s) in {path}", file=sys.stderr)
