"""A real S3 server for tests: a ``moto_server`` subprocess over HTTP, or an external endpoint.

Fixtures (``tests/conftest.py`` re-exports them)::

    s3_endpoint   session: the shared server; ``KVGW_TEST_S3_ENDPOINT`` / ``_ACCESS_KEY`` /
                  ``_SECRET_KEY`` (MinIO, Ceph, AWS) replace moto
    s3_bucket     function: a fresh bucket on ``s3_endpoint``, emptied and dropped afterwards
    moto_server   function: a private moto process a test may stop, restart, pause (SIGSTOP) and
                  resume; always moto, since an external endpoint is not ours to stop

Never stop the shared server: other tests use it. ``FaultProxy`` sits between a tier and a server and
drops the reply to one chosen request (a lost reply, followed by botocore's retry).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.s3_settings import S3TierSettings
from gateway.bench.launcher import free_port
from tests.requirements import require_or_skip

ENDPOINT_ENV = "KVGW_TEST_S3_ENDPOINT"
ACCESS_KEY_ENV = "KVGW_TEST_S3_ACCESS_KEY"
SECRET_KEY_ENV = "KVGW_TEST_S3_SECRET_KEY"
REGION_ENV = "KVGW_TEST_S3_REGION"
MOTO_KEY = "testing"


@dataclass
class MotoServer:
    """``python -m moto.server`` on a fixed port; the port survives ``restart`` (state does not)."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoServer:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"moto-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited early:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/moto-api/", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"moto_server did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def stop(self) -> None:
        """Kill the process (and with it every object); the port refuses connections until ``start``."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> MotoServer:
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted (by the kernel) but never answered; state is kept."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()


@dataclass
class S3Endpoint:
    """Where a test's S3 server answers, and how to talk to it outside the tier under test."""

    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    server: MotoServer | None = None  # None for an external endpoint

    def admin(self) -> Any:
        """A plain (sync) boto3 client, for arranging and inspecting what the tier did."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.url, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2},
                          connect_timeout=5, read_timeout=30),
        )

    def settings(self, bucket: str, **overrides: Any) -> S3TierSettings:
        values: dict[str, Any] = {
            "endpoint_url": self.url, "region": self.region, "bucket": bucket,
            "access_key": self.access_key, "secret_key": self.secret_key, "addressing_style": "path",
            "connect_timeout": 2.0, "read_timeout": 10.0, "operation_timeout": 20.0,
            # roomy request-path budgets: a loaded test machine must not turn a slow answer into an outage
            # (outage tests set their own)
            "lookup_timeout": 2.0, "request_timeout": 5.0,
        }
        values.update(overrides)
        return S3TierSettings(**values)

    def create_bucket(self) -> str:
        name = f"kvgw-t-{uuid.uuid4().hex[:16]}"
        params: dict[str, Any] = {"Bucket": name}
        if self.region != "us-east-1":
            params["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self.admin().create_bucket(**params)
        return name

    def drop_bucket(self, name: str) -> None:
        """Empty and delete a bucket; best effort (the server may be down after an outage test)."""
        with contextlib.suppress(Exception):
            admin = self.admin()
            for page in admin.get_paginator("list_multipart_uploads").paginate(Bucket=name):
                for up in page.get("Uploads", []):
                    admin.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
            for page in admin.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    admin.delete_objects(Bucket=name, Delete={"Objects": keys})
            admin.delete_bucket(Bucket=name)


def _moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    url = os.environ.get(ENDPOINT_ENV)
    if url:
        access, secret = os.environ.get(ACCESS_KEY_ENV), os.environ.get(SECRET_KEY_ENV)
        if not access or not secret:
            pytest.fail(f"{ENDPOINT_ENV} is set: set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} too")
        yield S3Endpoint(url, access, secret, os.environ.get(REGION_ENV, "us-east-1"))
        return
    if not _moto_available():
        require_or_skip("moto[server] is not installed (pip install -e '.[test]')")
    server = MotoServer().start()
    try:
        yield S3Endpoint(server.url, MOTO_KEY, MOTO_KEY, server=server)
    finally:
        server.close()


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> Iterator[str]:
    name = s3_endpoint.create_bucket()
    yield name
    s3_endpoint.drop_bucket(name)


@pytest.fixture
def moto_server() -> Iterator[S3Endpoint]:
    """A private moto process, free to stop and restart (bucket ``kvgw-private`` exists at start)."""
    if not _moto_available():
        require_or_skip("moto[server] is not installed (pip install -e '.[test]')")
    server = MotoServer().start()
    endpoint = S3Endpoint(server.url, MOTO_KEY, MOTO_KEY, server=server)
    endpoint.admin().create_bucket(Bucket="kvgw-private")
    try:
        yield endpoint
    finally:
        server.close()


class FaultProxy:
    """A TCP proxy in front of a server that can swallow the reply to one request.

    ``drop_reply_to(prefix)``: the next request whose first bytes start with ``prefix`` (e.g.
    ``b"PUT /bucket/key"``) reaches the server, but when its reply comes back the proxy closes the
    client connection instead of forwarding it: the request took effect and the client never heard.
    """

    def __init__(self, upstream_url: str) -> None:
        host_port = upstream_url.split("://", 1)[1].split("/", 1)[0]
        host, _, port = host_port.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._drop_prefix: bytes | None = None
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop_reply_to(self, prefix: bytes) -> None:
        with self._lock:
            self._drop_prefix = prefix

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            doomed = threading.Event()
            threading.Thread(target=self._pump_requests, args=(client, upstream, doomed), daemon=True).start()
            threading.Thread(target=self._pump_replies, args=(upstream, client, doomed), daemon=True).start()

    def _pump_requests(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                with self._lock:
                    if self._drop_prefix is not None and data.startswith(self._drop_prefix):
                        self._drop_prefix = None
                        doomed.set()
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _pump_replies(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if doomed.is_set():
                    self.dropped += 1
                    break
                dst.sendall(data)
        for sock in (dst, src):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
