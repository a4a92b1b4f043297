"""The README stays what a newcomer reads in ten minutes, and the pages under ``docs/`` hang together:
the two commands as written, one configuration per engine, every link and anchor resolving, every page
reachable from the README.

The snippets themselves are run elsewhere, each where its subject is tested: the first steps against a
real ``kvgw serve`` (``tests/integration/test_first_steps.py``), the engine configurations by the
engines' own classes (``tests/integration/lmcache/test_readme_snippets.py``, ``sglang/test_backend.py``,
``vllm/test_obj_tier.py``), the code map against the tree (``tests/unit/test_code_map.py``).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from tests.docs import DOCS, README, REPO, anchor, code_blocks, headings, links, pages, section, text

MAX_README_LINES = 200
"""About ten minutes of reading; the reference belongs in docs/."""

SERVE = "pip install -e ./client -e . && kvgw serve"
TEST = 'pip install -e ./client -e ".[test]" && python -m pytest -q tests'


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_the_two_commands_as_written() -> None:
    blocks = [b.strip() for b in code_blocks(section(README.read_text(), "The two commands"), "sh")]
    assert blocks == [SERVE, TEST]


def test_the_readme_has_what_a_newcomer_needs() -> None:
    readme = README.read_text()
    top = [title for _, level, title in headings(readme) if level == 2]
    assert top == ["The two commands", "First steps", "Connect an engine", "Benchmarks", "Where to go next"]
    engines = [title for _, level, title in headings(section(readme, "Connect an engine")) if level == 3]
    assert [e.split(" ")[0] for e in engines] == ["LMCache", "SGLang", "vLLM's", "S3"]


def _target(page: Path, link: str) -> tuple[Path, str]:
    path, _, fragment = link.partition("#")
    return ((page.parent / path).resolve() if path else page), fragment


def test_every_link_and_anchor_resolves() -> None:
    broken = []
    for page in pages():
        for link in links(page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            target, fragment = _target(page, link)
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)}: {link} (no such file)")
            elif fragment and target.suffix == ".md" and fragment not in {
                anchor(title) for _, _, title in headings(target.read_text())
            }:
                broken.append(f"{page.relative_to(REPO)}: {link} (no such heading)")
    assert broken == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen = {README.resolve()}
    todo = deque([README])
    while todo:
        page = todo.popleft()
        for link in links(page.read_text()):
            target, _ = _target(page, link)
            if target.suffix == ".md" and target.exists() and target not in seen:
                seen.add(target)
                todo.append(target)
    unreachable = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in seen)
    assert unreachable == []


def test_each_page_has_one_title() -> None:
    for page in pages():
        titles = [title for _, level, title in headings(text(page)) if level == 1]
        assert len(titles) == 1, f"{page.relative_to(REPO)}: {titles}"
