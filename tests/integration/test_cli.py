"""The ``kvgw`` command's catalog and maintenance subcommands, on a real data directory."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main as kvgw
from tests.conftest import REPO


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvgw(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def root_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGW_ROOT_ACCESS_KEY", "KVCLIROOT")
    monkeypatch.setenv("KVGW_ROOT_SECRET_KEY", "cli-root-secret")


def test_db_upgrade_creates_the_catalog(tmp_path: Path) -> None:
    code, out, _ = run("db", "upgrade", "--data-dir", str(tmp_path))
    assert code == 0 and "up to date" in out
    assert (tmp_path / "catalog.sqlite").exists()
    assert (tmp_path / "secret.key").stat().st_mode & 0o777 == 0o600


def test_bucket_create_update_list(tmp_path: Path) -> None:
    d = str(tmp_path)
    code, out, _ = run("bucket", "create", "models", "--data-dir", d, "--ttl", "600", "--capacity-bytes", "1000",
                       "--eviction-policy", "prefix-lru", "--write-through")
    assert code == 0
    created = json.loads(out)
    assert created["default_ttl_seconds"] == 600 and created["write_through"] is True
    code, out, _ = run("bucket", "update", "models", "--data-dir", d, "--high-watermark", "0.95")
    updated = json.loads(out)
    assert code == 0 and updated["high_watermark"] == 0.95
    assert updated["default_ttl_seconds"] == 600  # fields not given are kept
    code, out, _ = run("bucket", "list", "--data-dir", d, "--json")
    assert code == 0 and {json.loads(line)["name"] for line in out.splitlines()} == {"models"}


@pytest.mark.parametrize(
    "flags",
    [
        ["--eviction-policy", "nope"],
        ["--high-watermark", "0.5", "--low-watermark", "0.7"],
        ["--capacity-bytes", "0"],
    ],
)
def test_bucket_policy_is_validated(tmp_path: Path, flags: list[str]) -> None:
    code, _, err = run("bucket", "create", "bad-policy", "--data-dir", str(tmp_path), *flags)
    assert code == 2 and err.startswith("kvgw: ")
    code, out, _ = run("bucket", "list", "--data-dir", str(tmp_path))
    assert "bad-policy" not in out


def test_invalid_bucket_name(tmp_path: Path) -> None:
    code, _, err = run("bucket", "create", "Not_Valid", "--data-dir", str(tmp_path))
    assert code == 2 and "invalid bucket name" in err


def test_cred_create_prints_the_secret_once(tmp_path: Path) -> None:
    d = str(tmp_path)
    run("bucket", "create", "models", "--data-dir", d)
    code, out, _ = run("cred", "create", "--data-dir", d, "--bucket", "models", "--write")
    cred = json.loads(out)
    assert code == 0 and cred["access_key"].startswith("KV") and len(cred["secret_key"]) >= 30
    catalog_bytes = b"".join(p.read_bytes() for p in tmp_path.glob("catalog.sqlite*"))
    assert cred["access_key"].encode() in catalog_bytes  # the row is there, its secret is not
    assert cred["secret_key"].encode() not in catalog_bytes


def test_serve_refuses_the_index_on_a_network_filesystem(tmp_path: Path) -> None:
    """The real check reads /proc/mounts; run the CLI in a subprocess with the type forced to nfs."""
    script = (
        "import sys, backends.index as ix; ix.filesystem_type = lambda p: 'nfs4'; "
        "from gateway.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run([sys.executable, "-c", script, "serve", "--data-dir", str(tmp_path), "--port", "1"],
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "KVGW_ROOT_ACCESS_KEY": "a", "KVGW_ROOT_SECRET_KEY": "b",
                                 "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "client")])})
    assert result.returncode == 2
    assert "network filesystem" in result.stderr
