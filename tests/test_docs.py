"""The docs hold together: the generated references are current (docs/generate.py --check),
every relative link of README.md and docs/**/*.md reaches its file and heading, no link
points at a dated heading (a dated section is a record that later work supersedes; a link
to it from a page about today's behaviour goes stale), and README and the long guides stay
under their sizes. Links to URLs are not fetched."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.links import Link, anchors, heading_slug, links, resolve

REPO = Path(__file__).resolve().parents[1]


def _pages() -> list[Path]:
    """The Markdown files whose links are checked: README.md and docs/**/*.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _where(link: Link) -> str:
    """`file:line -> target`, the file relative to the repository."""
    return f"{link.path.relative_to(REPO).as_posix()}:{link.line} -> {link.target}"


def _generate() -> ModuleType:
    """docs/generate.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_current() -> None:
    result = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_relative_links_resolve() -> None:
    """Each relative link names a file that exists and, with a #fragment, a heading slug or
    `<a id>` of a Markdown target."""
    broken = []
    for page in _pages():
        for link in links(page):
            target, fragment = resolve(link, REPO)
            if target is None:
                continue
            if not target.exists():
                broken.append(f"{_where(link)}: no such file")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{_where(link)}: no heading or anchor #{fragment}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_link_targets_a_dated_heading() -> None:
    dated = []
    for page in _pages():
        for link in links(page):
            target, fragment = resolve(link, REPO)
            if target is None or not fragment or target.suffix != ".md" or not target.exists():
                continue
            anchor = anchors(target).get(fragment)
            if anchor is not None and anchor.dated:
                dated.append(f"{_where(link)}: heading {anchor.heading!r}")
    assert not dated, "links to dated headings:\n" + "\n".join(dated)


@pytest.mark.parametrize(("heading", "slug"), [
    ("Learning-rate schedules (`--lr-schedule`)", "learning-rate-schedules---lr-schedule"),
    ("The fused loss: `--fused-loss auto|on|off`", "the-fused-loss---fused-loss-autoonoff"),
    ("nmt's [Python API](api.md) & more", "nmts-python-api--more"),
    ("max_tokens, d_k", "max_tokens-d_k"),
])
def test_heading_slug_follows_github(heading: str, slug: str) -> None:
    assert heading_slug(heading) == slug


def test_anchors_and_links_as_github_reads_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Intro\n\n## Intro\n\nSetext (2026-12-04)\n---\n\n"
                    '<a id="kept"></a>\n### Speed 2026-11-30\n\n'
                    "A [link\nover lines](other.md#x 'title') and `[code](no.md)`.\n\n"
                    "```\n# not a heading\n[nor](a-link.md)\n```\n\n"
                    "[ref]: ./ref.md#intro\n", encoding="utf-8")
    found = anchors(page)
    assert list(found) == ["intro", "intro-1", "setext-2026-12-04", "speed-2026-11-30",
                           "kept"]
    assert found["setext-2026-12-04"].dated and found["kept"].dated
    assert not found["intro"].dated
    assert [(link.line, link.target) for link in links(page)] == [
        (12, "other.md#x"), (19, "./ref.md#intro")]


def test_generated_blocks_are_filled_and_unknown_names_refused() -> None:
    generate = _generate()
    known = {"table": lambda: "| a |\n|---|\n| 1 |\n"}
    text = ("intro\n<!-- generated: table -->\nold\n<!-- /generated: table -->\n"
            "```\n<!-- generated: quoted -->\n```\n")
    assert generate.fill_blocks(text, "docs/x.md", known) == (
        "intro\n<!-- generated: table -->\n| a |\n|---|\n| 1 |\n"
        "<!-- /generated: table -->\n```\n<!-- generated: quoted -->\n```\n")
    with pytest.raises(generate.GenerateError, match=r"docs/x\.md:2: unknown generator 'nope'"):
        generate.fill_blocks("x\n<!-- generated: nope -->\n<!-- /generated: nope -->\n",
                             "docs/x.md", known)
    with pytest.raises(generate.GenerateError, match=r"docs/x\.md:1: .* not closed"):
        generate.fill_blocks("<!-- generated: table -->\n", "docs/x.md", known)


@pytest.mark.parametrize(("page", "limit"), [("README.md", 8_000),
                                             ("docs/performance.md", 30_000),
                                             ("docs/training.md", 30_000)])
def test_pages_stay_short_enough_to_read(page: str, limit: int) -> None:
    """README is what it is and how to start; the two long guides stay guides (issue 70):
    measured history goes to the git log, figures to bench/results/."""
    size = len((REPO / page).read_bytes())
    assert size < limit, f"{page} is {size:,} bytes; keep it under {limit:,}"
