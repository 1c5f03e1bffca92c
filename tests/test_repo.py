"""Repository-level invariants: CLI surface and README <-> CI agreement (layering:
tests/test_dependencies.py)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.cli import NmtCli

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("prep", "bpe", "train", "average", "translate", "score")


def test_help_lists_every_subcommand(nmt_cli: NmtCli) -> None:
    result = nmt_cli.run("--help")
    assert result.returncode == 0, result.err
    for name in COMMANDS:
        assert re.search(rf"^\W*{name}\s", result.out, re.MULTILINE), name


def test_version(nmt_cli: NmtCli) -> None:
    from nmt import __version__

    result = nmt_cli.run("--version")
    assert result.returncode == 0
    assert result.out.strip() == f"nmt {__version__}"


def test_every_option_help_shows_its_default(nmt_cli: NmtCli) -> None:
    """Each option that takes a value and has a default says so in --help."""
    for name in COMMANDS:
        result = nmt_cli.invoke(name, "--help")
        assert result.returncode == 0, (name, result.err)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", readme, re.DOTALL)
    assert len(blocks) >= 2, "README must open with two command blocks"
    test_command = blocks[1].strip()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci, "the README's test command must appear verbatim in .ci/run"


def test_tests_on_slow_fixtures_are_marked_slow_at_collection(request) -> None:
    """conftest's SLOW_FIXTURES marks every test that uses one, so the fast loop
    (`pytest -m "not slow"`) leaves it out without a hand-written mark."""
    from conftest import SLOW_FIXTURES, pytest_collection_modifyitems

    class Item:  # what the hook reads and writes of a collected test
        def __init__(self, fixturenames: list[str]) -> None:
            self.fixturenames, self.marks = fixturenames, []

        def add_marker(self, mark: object) -> None:
            self.marks.append(mark)

    costly, cheap = Item(["tmp_path", *SLOW_FIXTURES]), Item(["tmp_path"])
    pytest_collection_modifyitems(request.config, [costly, cheap])  # type: ignore[list-item]
    assert [m.name for m in costly.marks] == ["slow"] and cheap.marks == []
    # In a run that collected them (the full suite), the real ones carry the mark.
    users = [item for item in request.session.items
             if SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ()))]
    assert all(item.get_closest_marker("slow") for item in users)


def test_every_environment_switch_is_listed_and_read_through_switches() -> None:
    """The NMT_* variables the library reads are the ones nmt/switches.py lists (NMT_MIRROR
    is `nmt prep --mirror`'s, read by typer), each read through `switch()` when used."""
    import re

    from nmt.switches import SWITCHES

    named: set[str] = set()
    for path in sorted((REPO / "nmt").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(r"\bNMT_[A-Z0-9_]+\b", text))
        if path.name != "switches.py":
            assert "environ.get(\"NMT_" not in text, f"{path}: read NMT_* through switch()"
    assert named - {"NMT_MIRROR"} == set(SWITCHES), "list each switch in nmt/switches.py"
