"""The kvgw wheel: which top-level packages it installs, and that the installed copy finds its catalog
migrations as package resources (not as a path relative to the source checkout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

PROBE = r"""
import json, sys
import sqlalchemy
from alembic import command
import backends
from backends.catalog.store import alembic_config, migrations_dir
url = "sqlite:///" + sys.argv[1]
command.upgrade(alembic_config(url), "head")
engine = sqlalchemy.create_engine(url)
print(json.dumps({"backends": backends.__file__, "migrations": migrations_dir(),
                  "tables": sorted(sqlalchemy.inspect(engine).get_table_names())}))
"""


@pytest.mark.slow
def test_wheel_installs_kvgw_packages_only_and_migrates_from_site_packages(tmp_path: Path) -> None:
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("gateway", "backends", "migrations"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(src)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("kvgw-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(tmp_path / "site")
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"gateway", "backends", "migrations"}  # no tests/, client/ or other generic names
    assert {"migrations/script.py.mako", "migrations/env.py", "migrations/versions/0001_initial.py"} <= set(names)

    # the installed copy, run from elsewhere, must not reach back into the checkout; and it finds its
    # migrations through the import system, even on another sys.path entry than backends/
    (tmp_path / "site2").mkdir()
    (tmp_path / "site" / "migrations").rename(tmp_path / "site2" / "migrations")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(tmp_path / "site2")])}
    probe = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "catalog.db")],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["backends"].startswith(str(tmp_path / "site")), result
    assert Path(result["migrations"]) == tmp_path / "site2" / "migrations"
    assert {"buckets", "credentials", "alembic_version"} <= set(result["tables"]), result["tables"]
