"""Shared fixtures: real gateway processes, real directories, real databases.

``KVGW_REQUIRE_SERVICES=1`` (set by CI) turns every "service absent, skipping" into a failure, so a
green CI run proves the PostgreSQL, S3 and mount-dependent tests really ran.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.s3server import moto_server, s3_bucket, s3_endpoint  # noqa: F401

ROOT_AK = "KVTESTROOTACCESSKEY0"
ROOT_SK = "test-root-secret-key-0123456789"
REPO = Path(__file__).resolve().parents[1]


def require_or_skip(reason: str) -> None:
    """Skip locally; fail when CI demands every service (KVGW_REQUIRE_SERVICES=1)."""
    if os.environ.get("KVGW_REQUIRE_SERVICES") == "1":
        pytest.fail(f"required service missing: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    """A real ``kvgw serve`` subprocess on a free port."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ROOT_AK}:{ROOT_SK}"}

    def chunk_url(self, key: str, bucket: str = "kvcache") -> str:
        from urllib.parse import quote

        return f"{self.url}/v1/buckets/{bucket}/chunks/{quote(key, safe='')}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        env = dict(os.environ)
        env.update(
            KVGW_ROOT_ACCESS_KEY=ROOT_AK,
            KVGW_ROOT_SECRET_KEY=ROOT_SK,
            KVGW_LOG_LEVEL="warning",
            KVGW_CATALOG_REFRESH_SECONDS="0.5",
        )
        env.update(self.env)
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server-{self.port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgw serve exited early:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"kvgw serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flushing; what a crash looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()


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
