"""The links of Markdown files and the anchors their targets offer, as GitHub renders them,
for tests/test_docs.py: `links(path)` lists a file's link targets with their lines,
`anchors(path)` the fragments a link into it may name (heading slugs, `<a id=...>`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A code span: a run of backticks, text without a blank line, the same run again.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:[^\n]|\n(?![ \t]*\n))+?)(?<!`)\1(?!`)")
TARGET = r"(<[^>\n]*>|[^\s()<>]+(?:\([^\s()]*\)[^\s()<>]*)*)"
TITLE = r"""(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?"""
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*" + TARGET + TITLE + r"\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*" + TARGET, re.MULTILINE)
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""",
                       re.IGNORECASE)
HTML_ANCHOR = re.compile(r"""<a\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""",
                         re.IGNORECASE)
ATX = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
LIST_OR_HTML = re.compile(r"^ {0,3}(?:[-*+][ \t]|\d+[.)][ \t]|<)")
SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|//)")  # http:, mailto:, //host
# A dated heading: an ISO date, or a year opening a parenthesis ("(2026-11, ...)").
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\(\d{4}-")


@dataclass(frozen=True)
class Link:
    """A link target written in `path` at `line` (1-based)."""

    path: Path
    line: int
    target: str


@dataclass(frozen=True)
class Anchor:
    """A fragment a file offers: `heading` is the heading's text it comes from (for an
    `<a id>`, the heading on its line or the next non-blank one), "" if none."""

    name: str
    heading: str

    @property
    def dated(self) -> bool:
        """Whether the heading carries a date (a section that goes stale by design)."""
        return bool(DATE.search(self.heading))


def _blank(text: str, start: int, end: int) -> str:
    """`text` with [start, end) made spaces, its newlines kept (offsets and lines hold)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def without_fences(text: str) -> str:
    """`text` with the lines of fenced code blocks blanked."""
    lines, fence = text.split("\n"), ""
    for i, line in enumerate(lines):
        opens = FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = ""
            lines[i] = " " * len(line)
        elif opens:
            fence = opens.group(1)
            lines[i] = " " * len(line)
    return "\n".join(lines)


def without_code(text: str) -> str:
    """`text` with fenced code and code spans blanked: what is left is prose and links."""
    text = without_fences(text)
    for match in reversed(list(CODE_SPAN.finditer(text))):
        text = _blank(text, match.start(), match.end())
    return text


def links(path: Path) -> list[Link]:
    """Every link target in Markdown file `path` (inline, reference definitions, HTML
    href/src), outside code, in file order."""
    text = without_code(path.read_text(encoding="utf-8"))
    found = []
    for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK):
        for match in pattern.finditer(text):
            target = match.group(1).strip("<>")
            found.append(Link(path, text.count("\n", 0, match.start(1)) + 1, target))
    return sorted(found, key=lambda link: link.line)


def heading_slug(heading: str) -> str:
    """GitHub's slug of a heading's Markdown text, before de-duplication: the rendered
    text (links to their text, tags and escapes dropped), lowercased, every character but
    letters, digits, `_`, `-` and spaces removed, spaces made `-`."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"\\([^\w\s])", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _headings(text: str) -> list[tuple[int, str]]:
    """(0-based line, text) of each ATX and setext heading of fence-free `text`; a setext
    heading's text is its paragraph's lines joined, its line the first of them."""
    lines = text.split("\n")
    found = []
    for i, line in enumerate(lines):
        atx = ATX.match(line)
        if atx:
            found.append((i, atx.group(1) or ""))
            continue
        if not SETEXT.match(line):
            continue
        start = i
        while start > 0 and lines[start - 1].strip() and not ATX.match(lines[start - 1]):
            start -= 1
        paragraph = lines[start:i]
        if paragraph and not any("|" in p for p in paragraph) and not LIST_OR_HTML.match(
                paragraph[0]):
            found.append((start, " ".join(p.strip() for p in paragraph)))
    return found


def anchors(path: Path) -> dict[str, Anchor]:
    """The fragments a link into Markdown file `path` may name: each heading's slug, made
    unique as GitHub does (a repeat gets -1, -2, ...), and each `<a id>` / `<a name>`."""
    text = without_fences(path.read_text(encoding="utf-8"))
    headings = _headings(text)
    found: dict[str, Anchor] = {}
    counts: dict[str, int] = {}
    for _, heading in headings:
        base = slug = heading_slug(heading)
        while slug in counts:  # github-slugger's rule
            counts[base] += 1
            slug = f"{base}-{counts[base]}"
        counts[slug] = 0
        found[slug] = Anchor(slug, heading)
    lines = text.split("\n")
    by_line = dict(headings)
    prose = without_code(text)
    for match in HTML_ANCHOR.finditer(prose):
        line = prose.count("\n", 0, match.start())
        after = next((i for i in range(line + 1, len(lines)) if lines[i].strip()), line)
        heading = by_line.get(line, by_line.get(after, ""))
        found.setdefault(match.group(1), Anchor(match.group(1), heading))
    return found


def resolve(link: Link, repo: Path) -> tuple[Path | None, str]:
    """The file a relative link names and its fragment; (None, "") for a URL with a scheme
    (http:, mailto:), which is not checked. A leading `/` is the repository's root."""
    if SCHEME.match(link.target):
        return None, ""
    from urllib.parse import unquote

    target, _, fragment = link.target.partition("#")
    target = unquote(target.split("?")[0])
    if not target:
        return link.path, unquote(fragment)
    base = repo if target.startswith("/") else link.path.parent
    return (base / target.lstrip("/")).resolve(), unquote(fragment)
