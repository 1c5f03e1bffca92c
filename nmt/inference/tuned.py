"""The decoding settings `nmt tune` keeps in a run directory (`decoding.json`), and how
`nmt translate`, the Python API and `nmt serve` take them up: a model file inside a run
directory that holds one decodes with its settings unless the caller gives its own (an
explicit --alpha always wins), and the user is told once, on stderr."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nmt.config import DecodeConfig
from nmt.errors import DataError
from nmt.fileio import atomic_write_bytes

DECODING_FILE = "decoding.json"
FORMAT = "nmt-decoding-v1"
# What decoding.json may set: the settings `nmt tune` chooses.
TUNED = ("alpha", "beam")


def decoding_file(models: Sequence[Path]) -> Path | None:
    """The decoding.json that applies to `models` (checkpoint files): the one beside them
    when they all lie in one directory that has one, else None (an ensemble across runs
    was tuned by no one)."""
    dirs = {Path(m).resolve().parent for m in models}
    if len(dirs) != 1:
        return None
    path = dirs.pop() / DECODING_FILE
    return path if path.is_file() else None


def read_decoding(path: Path) -> dict[str, Any]:
    """The settings in decoding.json at `path`, checked: {"alpha": 1.0, "beam": 4}
    (those it sets). DataError naming the file and what to do when it is not one."""
    fix = f"run `nmt tune` again or delete {path}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable decoding.json ({err}); {fix}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("settings"), dict):
        raise DataError(f"{path}: not a decoding.json of `nmt tune` (format {FORMAT}); {fix}")
    settings = {k: v for k, v in data["settings"].items() if k in TUNED}
    try:
        DecodeConfig(**settings)
    except (TypeError, ValueError) as err:
        raise DataError(f"{path}: invalid settings {settings} ({err}); {fix}") from err
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in settings.values()):
        raise DataError(f"{path}: settings must be numbers, got {settings}; {fix}")
    if "beam" in settings and not isinstance(settings["beam"], int):
        raise DataError(f"{path}: beam must be a whole number, got {settings['beam']}; {fix}")
    return settings


def tuned_settings(models: Sequence[Path]) -> tuple[dict[str, Any], Path | None]:
    """The tuned settings that apply to `models` and the file they came from ({} and None
    when there is none)."""
    path = decoding_file(models)
    return ({}, None) if path is None else (read_decoding(path), path)


def describe(settings: dict[str, Any], path: Path, overridden: Sequence[str] = ()) -> str:
    """The line said once on stderr: which tuned settings are used, and how to override
    them (`overridden`: those the caller gave, which win)."""
    used = {k: v for k, v in settings.items() if k not in overridden}
    if not used:
        return f"{path}: tuned {_pairs(settings)} overridden by the options given"
    return f"decoding with {_pairs(used)} from {path} (nmt tune); options given override it"


def _pairs(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items())


def write_decoding(run: Path, settings: dict[str, Any], record: dict[str, Any]) -> Path:
    """Write RUN/decoding.json atomically: `settings` (of TUNED) and, beside them, the
    `record` of how they were chosen (rule, dev set, table)."""
    assert set(settings) <= set(TUNED), settings
    payload = {"format": FORMAT, "settings": settings, **record}
    path = run / DECODING_FILE
    text = json.dumps(payload, indent=1, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, lambda handle: handle.write(text.encode("utf-8")))
    return path
