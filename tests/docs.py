"""The README and the pages under ``docs/`` as the tests read them: a page, a section of a page, its
fenced code blocks and its links.

The README is short (what kvgw is, the two commands, first steps, one configuration per engine); the
reference lives in ``docs/``. Tests that check a snippet check it wherever it is written: the README's
short form and the page's full one.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def text(path: Path | str) -> str:
    """A page's text; ``path`` relative to the repository (``"docs/vllm.md"``) or absolute."""
    return (REPO / path).read_text()


def pages() -> list[Path]:
    """The README and every Markdown page under ``docs/``."""
    return [README, *sorted(DOCS.glob("*.md"))]


def headings(markdown: str) -> list[tuple[int, int, str]]:
    """``(line number, level, title)`` of every heading outside fenced code (a ``# comment`` in a shell
    or PromQL block is not a heading)."""
    found: list[tuple[int, int, str]] = []
    fenced = False
    for number, line in enumerate(markdown.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"(#{1,6}) (.+)", line)
        if match and not fenced:
            found.append((number, len(match.group(1)), match.group(2).strip()))
    return found


def section(markdown: str, title: str) -> str:
    """The section headed ``title`` (any level), up to the next heading of the same or a higher level;
    ValueError if the page has no such heading."""
    lines = markdown.splitlines()
    marks = headings(markdown)
    for i, (start, level, heading) in enumerate(marks):
        if heading == title:
            end = next((n for n, lvl, _ in marks[i + 1:] if lvl <= level), len(lines))
            return "\n".join(lines[start:end]) + "\n"
    raise ValueError(f"no heading {title!r}")


def code_blocks(markdown: str, language: str) -> list[str]:
    """The contents of every fenced block of ``language`` (```` ```sh ````, ```` ```yaml ````, ...)."""
    return re.findall(rf"^```{re.escape(language)}\n(.*?)^```", markdown, re.S | re.M)


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower())
    return slug.replace(" ", "-")


def links(markdown: str) -> list[str]:
    """Targets of Markdown links and images outside fenced code."""
    found: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            found += re.findall(r"\]\(([^)\s]+)\)", line)
    return found
