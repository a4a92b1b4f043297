"""``pip install ./client`` alone: an inference host gets kvgw's client without the server's dependencies.

A fresh virtual environment (no system site-packages) gets the client distribution through pip. The
packages an inference image already has (LMCache, torch, aiohttp, ...) are made visible through one
``.pth`` entry to a directory of links into this interpreter's site-packages that leaves out every
server-only distribution (FastAPI, Starlette, uvicorn, LMDB, SQLAlchemy, Alembic, psycopg) and kvgw
itself. Then, run from a directory outside the repository: ``kvgw_client`` and its LMCache modules
import, and the server's dependencies do not.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO

SERVER_ONLY = ("fastapi", "starlette", "uvicorn", "lmdb", "sqlalchemy", "alembic", "psycopg", "pydantic_settings")
"""Distributions the server needs and an inference host must not be made to install (lower-case prefixes)."""

NEVER_LINKED = ("kvgw", "__editable__", "gateway", "backends", "migrations", "pip", "setuptools", "_distutils_hack")
"""kvgw itself (the test installs the client for real) and the venv's own packaging tools."""

PROBE = r"""
import importlib, importlib.util, json, sys
result = {"client": [], "absent": {}}
for name in ("kvgw_client", "kvgw_client.http", "kvgw_client.wire", "kvgw_client.keys", "kvgw_client.prefetch"):
    importlib.import_module(name)
    result["client"].append(name)
if importlib.util.find_spec("lmcache") is not None:
    for name in ("kvgw_client.lmcache.connector", "kvgw_client.lmcache.l2_adapter"):
        importlib.import_module(name)
        result["client"].append(name)
for name in ("fastapi", "lmdb", "sqlalchemy", "gateway", "backends"):
    try:
        importlib.import_module(name)
        result["absent"][name] = False
    except ImportError:
        result["absent"][name] = True
print(json.dumps(result))
"""


def _link_farm(farm: Path) -> None:
    """Link every top-level entry of this interpreter's site-packages into ``farm``, less the excluded."""
    farm.mkdir()
    for sitedir in site.getsitepackages():
        for entry in Path(sitedir).iterdir():
            name = entry.name.lower().replace("-", "_")
            if name.startswith(SERVER_ONLY) or name.startswith(NEVER_LINKED) or entry.suffix == ".pth":
                continue
            target = farm / entry.name
            if not target.exists():
                target.symlink_to(entry)


@pytest.mark.slow
def test_client_installs_and_imports_without_the_server(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    farm = tmp_path / "host-packages"
    _link_farm(farm)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "inference-image.pth").write_text(f"{farm}\n")
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER")}

    # Built here (this interpreter has the build backend), installed there from the wheel alone: --no-index
    # proves its dependencies are met by what the host already has, not fetched.
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(REPO / "client")],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("kvgw_client-*.whl")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", str(wheel)],
        capture_output=True, text=True, env=clean_env, cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, env=clean_env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "kvgw_client.http" in result["client"]
    lmcache_visible = subprocess.run([sys.executable, "-c", "import lmcache"], capture_output=True).returncode == 0
    if lmcache_visible:
        assert "kvgw_client.lmcache.connector" in result["client"]
        assert "kvgw_client.lmcache.l2_adapter" in result["client"]
    assert result["absent"] == {"fastapi": True, "lmdb": True, "sqlalchemy": True, "gateway": True, "backends": True}
    # the installed client is the distribution from client/, not a path into the repository
    where = subprocess.run([python, "-c", "import kvgw_client; print(kvgw_client.__file__)"],
                           capture_output=True, text=True, env=clean_env, cwd=tmp_path).stdout.strip()
    assert where.startswith(str(env_dir)), where
