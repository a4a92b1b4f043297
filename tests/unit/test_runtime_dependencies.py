"""The gateway runs on what ``pyproject.toml`` declares: a fresh ``pip install -e ./client -e .`` must be
enough for ``kvgw serve`` (README's first command). Every third-party module the server's own code
imports has to come from a distribution in the closure of kvgw's runtime requirements, not from
something another install (LMCache, the test extra) happened to bring along: prometheus_client once
did, and only the CI's LMCache install kept ``kvgw serve`` starting."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

SERVER_MODULES = ("gateway.cli", "gateway.serve", "gateway.app", "gateway.service", "backends.s3", "backends.posix",
                  "backends.catalog.store", "gateway.cluster", "gateway.lifecycle")
OURS = ("gateway", "backends", "migrations", "kvgw_client")

_LOADED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({n: m.__file__ for n, m in sys.modules.items()
                  if n.split(".")[0] in ("gateway", "backends", "migrations") and getattr(m, "__file__", None)}))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(dist: str) -> set[str]:
    """``dist`` and every distribution its requirements pull in, with the extras each requirement asks
    for (``uvicorn[standard]``) and none of ``dist``'s own (markers honoured)."""
    seen: set[tuple[str, str]] = set()
    todo = [(dist, "")]
    while todo:
        name, extra = todo.pop()
        if (_normal(name), extra) in seen:
            continue
        seen.add((_normal(name), extra))
        for line in metadata.requires(name) or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, ""), *((req.name, wanted) for wanted in req.extras)]
    return {name for name, _ in seen}


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in the file, at module level or not."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_server_imports_only_declared_distributions() -> None:
    out = subprocess.run([sys.executable, "-c", _LOADED, *SERVER_MODULES], capture_output=True, text=True,
                         check=True).stdout
    loaded: dict[str, str] = json.loads(out)
    assert "gateway.app" in loaded and "backends.index" in loaded
    imported: dict[str, set[str]] = {}
    for module, path in loaded.items():
        for name in top_level_imports(Path(path)) - set(sys.stdlib_module_names) - set(OURS):
            imported.setdefault(name, set()).add(module)
    providers = metadata.packages_distributions()
    allowed = runtime_closure("kvgw")
    assert {"lmdb", "uvloop", "httptools", "prometheus-client"} <= allowed  # the closure is really walked
    undeclared = {name: sorted(by) for name, by in imported.items()
                  if not {_normal(d) for d in providers.get(name, ())} & allowed}
    assert not undeclared, f"imported by the server's modules but not in kvgw's runtime requirements: {undeclared}"


def _declared() -> dict[str, Requirement]:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    return {_normal(Requirement(line).name): Requirement(line) for line in project["dependencies"]}


DOCUMENTED_ENTRY_POINTS = {
    "nixl._api",  # NIXL's Python entry point as its own examples and vLLM import it (nixl 1.5.1, pinned in .ci)
}


def private_imports(path: Path) -> list[str]:
    """Modules of other packages that ``path`` imports by a private name (a dotted part starting with
    ``_``, like ``uvicorn._types``), which a release may change without notice."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        found += [name for name in names if name.split(".")[0] not in OURS and name not in DOCUMENTED_ENTRY_POINTS
                  and any(part.startswith("_") and not part.startswith("__") for part in name.split("."))]
    return found


def test_kvgw_imports_no_private_module_of_another_package() -> None:
    """kvgw depends on other packages' public APIs only (its HTTP server is its own, on httptools' public
    parser API); a private import would make a release of that package able to break kvgw silently."""
    root = Path(__file__).parents[2]
    files = [p for d in ("gateway", "backends", "migrations", "client/kvgw_client") for p in (root / d).rglob("*.py")]
    assert len(files) > 50
    private = {str(p.relative_to(root)): names for p in files if (names := private_imports(p))}
    assert not private, f"private modules of other packages imported: {private}"
    assert private_imports_sample() == ["uvicorn._types"]  # the check itself sees such an import


def private_imports_sample() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.py"
        sample.write_text("import os\nfrom uvicorn._types import ASGIReceiveEvent\nfrom gateway._x import y\n")
        return private_imports(sample)


def test_installed_versions_are_the_ones_kvgw_declares() -> None:
    """A stale environment (an older release left by another install) fails here, with the names,
    instead of as a puzzling failure deep in the suite."""
    declared = _declared()
    wrong = {name: (metadata.version(name), str(req.specifier)) for name, req in declared.items()
             if name != "kvgw-client" and not req.specifier.contains(metadata.version(name), prereleases=True)}
    assert not wrong, f"installed outside kvgw's declared ranges (installed, wanted): {wrong}"
