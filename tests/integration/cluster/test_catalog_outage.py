"""Issue 11, section 4: PostgreSQL unreachable. Reads keep serving from the index and the tiers; writes
keep working with their events queued in memory, up to ``KVGW_CLUSTER_MAX_QUEUED_EVENTS``, past which
PUTs are refused with 503 saying why; when the catalog answers again the queue is published in order
and the other gateways catch up."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from gateway.bench.launcher import free_port
from tests.conftest import ServerProcess, wait_for
from tests.integration.cluster.conftest import Launch


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut`` closes every connection and refuses new ones
    (the database is gone), ``restore`` listens again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open = False

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        with self._lock:
            self._open = True
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if not self._open:  # accepted while being cut
                    client.close()
                    upstream.close()
                    continue
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self._open = False
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        self.start()


@pytest.fixture
def proxy(pg_url: str) -> Iterator[TcpProxy]:
    parts = urlsplit(pg_url)
    assert parts.hostname is not None
    p = TcpProxy((parts.hostname, parts.port or 5432)).start()
    yield p
    p.cut()


def _via(pg_url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(pg_url)
    netloc = f"{parts.username}@127.0.0.1:{proxy.port}" if parts.username else f"127.0.0.1:{proxy.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _listed(server: ServerProcess) -> list[str]:
    with httpx.Client(headers=server.auth, timeout=30) as c:
        keys: list[str] = c.post(f"{server.url}/v1/buckets/kvcache/list", json={"limit": 1000}).json()["keys"]
        return keys


def test_writes_queue_while_postgresql_is_down_and_publish_when_it_is_back(
    launch: Launch, pg_url: str, proxy: TcpProxy
) -> None:
    a = launch("a", KVGW_CATALOG_URL=_via(pg_url, proxy), KVGW_WORKERS="1", KVGW_CLUSTER_MAX_QUEUED_EVENTS="6")
    b = launch("b")
    data = os.urandom(20_000)
    with httpx.Client(headers=a.auth, timeout=30) as ca:
        assert ca.put(a.chunk_url("before"), content=data).status_code == 201
        wait_for(lambda: _listed(b) == ["before"], "b follows a")
        proxy.cut()
        written = []
        for i in range(6):  # writes go on: their events wait in memory
            key = f"during{i}"
            assert ca.put(a.chunk_url(key), content=data).status_code == 201, i
            written.append(key)
        assert ca.get(a.chunk_url("during0")).content == data  # and reads
        assert ca.head(a.chunk_url("before")).status_code == 200
        refused = ca.put(a.chunk_url("one-too-many"), content=data)  # past the bound: refused, saying why
        assert refused.status_code == 503
        assert "unreachable" in refused.json()["error"]["message"]
        wait_for(lambda: ca.get(f"{a.url}/v1/admin/stats").json()["cluster"]["feed"]["publishing"] is False,
                 "a reports that it cannot publish")
        assert ca.get(f"{a.url}/v1/admin/stats").json()["cluster"]["feed"]["queued"] == 6
        proxy.restore()
        wait_for(lambda: sorted(_listed(b)) == sorted(["before", *written]), "b got the queued events", 60)
        wait_for(lambda: ca.put(a.chunk_url("after"), content=data).status_code == 201, "writes resume", 60)
    with httpx.Client(headers=b.auth, timeout=30) as cb:
        wait_for(lambda: cb.get(f"{b.url}/v1/admin/stats").json()["cluster"]["usage"].get("kvcache", {})
                 .get("fs_chunks") == 8, "the shared usage ledger has every write")


def test_a_gateway_without_its_catalog_stays_ready_and_says_so(launch: Launch, pg_url: str, proxy: TcpProxy) -> None:
    """Every gateway shares the catalog: taking them all out of service for it would stop the reads and
    writes that still work. Ready (200), ``catalog: unreachable``, in /readyz and in the metric."""
    a = launch("a", KVGW_CATALOG_URL=_via(pg_url, proxy), KVGW_WORKERS="1")
    data = os.urandom(20_000)
    with httpx.Client(headers=a.auth, timeout=30) as ca:
        assert ca.put(a.chunk_url("before"), content=data).status_code == 201
        assert ca.get(f"{a.url}/readyz").json()["checks"]["catalog"] == "ok"
        proxy.cut()
        wait_for(lambda: ca.get(f"{a.url}/readyz").json()["checks"]["catalog"].startswith("unreachable: "),
                 "readyz says the catalog is unreachable")
        ready = ca.get(f"{a.url}/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert ca.get(a.chunk_url("before")).content == data  # reads go on
        assert ca.put(a.chunk_url("during"), content=data).status_code == 201  # and writes
        metrics = ca.get(f"{a.url}/metrics").text
        assert 'kvgw_readiness{check="catalog",state="unreachable"} 1.0' in metrics
        assert "kvgw_ready 1.0" in metrics
        proxy.restore()
        wait_for(lambda: ca.get(f"{a.url}/readyz").json()["checks"]["catalog"] == "ok", "the catalog is back", 60)
