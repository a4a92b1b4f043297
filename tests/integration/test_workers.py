"""``kvgw serve --workers N``: worker processes share the port and the index, every API behaves the same
whichever answers, a killed worker is replaced, and SIGTERM drains in-flight requests."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, wait_for


def worker_pid(server: ServerProcess) -> int:
    """The pid of the worker that answers a fresh connection."""
    with httpx.Client(headers=server.auth, timeout=10) as client:
        pid: int = client.get(f"{server.url}/v1/admin/stats").json()["process"]["pid"]
        return pid


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.fixture
def workers(server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "d", extra_args=["--workers", "2"]).start()


def test_two_workers_share_the_port_and_the_index(workers: ServerProcess) -> None:
    assert workers.proc is not None
    kids = children_of(workers.proc.pid)
    assert len(kids) == 2
    seen: set[int] = set()
    wait_for(lambda: seen.add(worker_pid(workers)) or seen == kids, "both workers answer requests")
    # whatever worker takes a write, every worker reads it at once (one LMDB index, one tier)
    for i in range(20):
        with httpx.Client(headers=workers.auth, timeout=10) as writer:
            assert writer.put(workers.chunk_url(f"w-{i}"), content=f"chunk {i}".encode()).status_code == 201
        with httpx.Client(headers=workers.auth, timeout=10) as reader:
            assert reader.get(workers.chunk_url(f"w-{i}")).content == f"chunk {i}".encode()
            assert reader.post(f"{workers.url}/v1/buckets/kvcache/exists",
                               json={"keys": [f"w-{i}"]}).json() == {"exists": [True]}


def test_a_killed_worker_is_replaced(workers: ServerProcess) -> None:
    assert workers.proc is not None
    before = children_of(workers.proc.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(children_of(workers.proc.pid)) == 2 and victim not in children_of(workers.proc.pid),
             "the supervisor starts a new worker")
    assert httpx.get(f"{workers.url}/readyz", timeout=10).status_code == 200
    assert workers.proc.poll() is None


def test_sigterm_drains_in_flight_requests(workers: ServerProcess) -> None:
    assert workers.proc is not None
    body = os.urandom(16 << 20)
    with httpx.Client(headers=workers.auth, timeout=30) as client:
        assert client.put(workers.chunk_url("big"), content=body).status_code == 201
    # a GET whose body the client reads slowly, in flight when the server is told to stop
    sock = socket.create_connection(("127.0.0.1", workers.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    auth = workers.auth["Authorization"]
    sock.sendall(f"GET /v1/buckets/kvcache/chunks/big HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode())
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    workers.proc.send_signal(signal.SIGTERM)
    received = len(first.split(b"\r\n\r\n", 1)[1])
    while True:
        piece = sock.recv(1 << 20)
        if not piece:
            break
        received += len(piece)
        time.sleep(0.001)
    sock.close()
    assert received == len(body)  # the whole chunk, though the stop came mid-response
    assert workers.proc.wait(60) == 0


def test_workers_do_not_outlive_a_killed_supervisor(workers: ServerProcess) -> None:
    """A worker holds the data directory's lock and serves the shared socket: when the supervisor is
    SIGKILLed (no chance to stop its workers), the kernel ends the workers too (PR_SET_PDEATHSIG), so a
    new gateway can take the data directory."""
    assert workers.proc is not None
    kids = children_of(workers.proc.pid)
    assert len(kids) == 2
    workers.kill()
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in kids), "the workers of a killed supervisor")
    workers.start()  # the data directory is free again
    assert httpx.get(f"{workers.url}/readyz", timeout=10).status_code == 200
