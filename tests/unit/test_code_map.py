"""The Code map (``docs/code-map.md``) matches the tree: every module of the server and the client is
named there, and every path named there exists."""

from __future__ import annotations

import re

from tests.docs import REPO

PACKAGES = ("gateway", "backends", "client/kvgw_client")


def code_map() -> str:
    return (REPO / "docs" / "code-map.md").read_text()


def named_paths(text: str) -> set[str]:
    """Backticked names, resolved: a full path, or a bare ``name.py`` under the path last named in its line."""
    found: set[str] = set()
    for line in text.splitlines():
        base = ""
        for token in re.findall(r"`([^`]+)`", line):
            if "/" in token and (token.endswith(".py") or token.endswith("/")):
                found.add(token)
                base = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
            elif token.endswith(".py") and base:
                found.add(base + token)
    return found


def test_every_module_is_in_the_code_map() -> None:
    named = named_paths(code_map())
    missing = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__init__.py" or rel.startswith("gateway/client/"):
                continue  # packages are named by their directory; gateway/client/ is one entry
            if rel not in named:
                missing.append(rel)
    assert missing == [], f"modules missing from docs/code-map.md: {missing}"


def test_every_named_path_exists() -> None:
    absent = sorted(p for p in named_paths(code_map()) if not (REPO / p).exists())
    assert absent == [], f"docs/code-map.md names paths that do not exist: {absent}"
