"""Shared fixtures: real gateway processes, real directories, real databases.

``KVGW_REQUIRE_SERVICES=1`` (set by CI) turns every "service absent, skipping" into a failure, so a
green CI run proves the PostgreSQL, S3 and mount-dependent tests really ran: skip for a missing service,
package or data set only through ``require_or_skip`` / ``require_module`` (``tests/requirements.py``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from gateway.bench.launcher import KvgwProcess
from tests.requirements import require_module, require_or_skip, services_required  # noqa: F401
from tests.rgw.fixtures import rgw_cluster, rgw_endpoint, rgw_outage  # noqa: F401
from tests.s3server import moto_server, s3_bucket, s3_endpoint  # noqa: F401

ROOT_AK = "KVTESTROOTACCESSKEY0"
ROOT_SK = "test-root-secret-key-0123456789"
REPO = Path(__file__).resolve().parents[1]


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll until ``condition()`` is true: for effects a real server process makes in the background.

    Never a fixed sleep then an assert: a loaded machine only makes this wait longer. The deadline is
    generous; when it passes the test fails saying ``what`` did not happen.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s: {what}")
        time.sleep(interval)


async def wait_for_async(
    condition: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.05
) -> None:
    """``wait_for`` inside an event loop: for background tasks of an in-process gateway that expose
    no event to await (the condition is re-checked between loop turns)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(interval)


@dataclass
class ServerProcess(KvgwProcess):
    """A real ``kvgw serve`` subprocess on a free port (``gateway.bench.launcher``, as the benches run
    it), with the tests' root credentials and a fast catalog refresh."""

    def __post_init__(self) -> None:
        self.env = {"KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK,
                    "KVGW_CATALOG_REFRESH_SECONDS": "0.5", **self.env}

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ROOT_AK}:{ROOT_SK}"}

    def chunk_url(self, key: str, bucket: str = "kvcache") -> str:
        return f"{self.url}/v1/buckets/{bucket}/chunks/{quote(key, safe='')}"


def create_bucket(server: ServerProcess, name: str, *flags: str) -> None:
    """``kvgw bucket create NAME FLAGS`` on a running gateway's data directory, as an operator runs it
    (the gateway sees the bucket at its next catalog refresh, within ``KVGW_CATALOG_REFRESH_SECONDS``)."""
    made = subprocess.run([sys.executable, "-m", "gateway.cli", "bucket", "create", name, *flags,
                           "--data-dir", str(server.data_dir)],
                          env={**os.environ, "KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK},
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr


def fs_usage(server: ServerProcess, bucket: str) -> int:
    """Bytes the gateway counts on ``bucket``'s filesystem tier (``/v1/admin/stats``)."""
    stats = httpx.get(f"{server.url}/v1/admin/stats", headers=server.auth, timeout=10).json()
    found: int = stats["usage"].get(bucket, {}).get("fs_bytes", 0)
    return found


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    class Factory(ServerProcess):
        def start(self, timeout: float = 30.0) -> ServerProcess:
            started.append(self)
            return super().start(timeout)

    yield Factory
    for server in started:
        server.stop()


@pytest.fixture
def server(server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "data").start()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30.0) as c:
        yield c


# -- PostgreSQL --------------------------------------------------------------------------------

PG_URL = os.environ.get("KVGW_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema in the test database, dropped afterwards; the URL pins it as search_path."""
    from sqlalchemy import create_engine, text

    engine = create_engine(PG_URL)
    schema = f"kvgw_test_{uuid.uuid4().hex[:12]}"
    try:
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:
        engine.dispose()
        require_or_skip(f"PostgreSQL at {PG_URL} unreachable: {type(exc).__name__}")
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    engine.dispose()


# -- small filesystems -------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, for disk-full tests (needs root)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                            capture_output=True)
    if result.returncode != 0:
        require_or_skip(f"cannot mount a tmpfs: {result.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def leases_granted(server: ServerProcess) -> int:
    """Read leases a single-process gateway granted so far (``leases`` in its admin stats)."""
    stats = httpx.get(f"{server.url}/v1/admin/stats", headers=server.auth, timeout=30).json()
    return int(stats["leases"]["granted"])
