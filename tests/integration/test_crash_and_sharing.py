"""Crash safety (SIGKILL) and several gateways sharing one chunk directory."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import xxhash

from tests.conftest import ServerProcess


def _slow_put(server: ServerProcess, key: str, data: bytes, piece: int, pause: float) -> None:
    """Send a PUT body in pieces, pausing between them, until the server dies."""
    path = server.chunk_url(key).removeprefix(server.url)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {server.auth['Authorization']}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
            )
            for i in range(0, len(data), piece):
                sock.sendall(data[i : i + piece])
                time.sleep(pause)
            sock.settimeout(10)
            sock.recv(1024)
    except OSError:
        pass


def test_sigkill_at_any_moment_never_exposes_a_partial_chunk(
    server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    server = server_factory(data_dir=tmp_path / "data").start()
    rng = random.Random(7)
    data = os.urandom(6 << 20)
    outcomes = set()
    for attempt in range(6):
        key = f"crash-{attempt}"
        writers = [
            threading.Thread(target=_slow_put, args=(server, key, data, 256 << 10, 0.01)),
            threading.Thread(target=_slow_put, args=(server, f"{key}-fast", data, 6 << 20, 0.0)),
        ]
        for w in writers:
            w.start()
        time.sleep(rng.uniform(0.0, 0.35))
        server.kill()
        for w in writers:
            w.join()
        server.start()
        with httpx.Client(headers=server.auth, timeout=30) as c:
            for k in (key, f"{key}-fast"):
                got = c.get(server.chunk_url(k))
                assert got.status_code in (200, 404), got.status_code
                if got.status_code == 200:
                    assert got.content == data  # complete or absent, never partial
                    outcomes.add("complete")
                else:
                    outcomes.add("absent")
                    assert c.put(server.chunk_url(k), content=data).status_code == 201
                    assert c.get(server.chunk_url(k)).content == data
        # start-up removed every staged file left by the killed process
        assert list((server.data_dir / "fs" / "staging").iterdir()) == []
    assert "absent" in outcomes  # the kill really hit mid-write at least once


def test_two_gateways_share_one_directory(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    shared = tmp_path / "shared-fs"
    a = server_factory(data_dir=tmp_path / "a", env={"KVGW_FS_ROOT": str(shared)}).start()
    b = server_factory(data_dir=tmp_path / "b", env={"KVGW_FS_ROOT": str(shared)}).start()
    chain = [f"model@1@0@{i:04x}@bf16" for i in range(4)]
    blobs = [os.urandom(300_000) for _ in chain]
    with httpx.Client(headers=a.auth) as ca, httpx.Client(headers=b.auth) as cb:
        for key, blob in zip(chain, blobs, strict=True):
            assert ca.put(a.chunk_url(key), content=blob).status_code == 201
        # b's index has never seen these keys: every lookup falls through to the shared directory
        assert cb.post(f"{b.url}/v1/buckets/kvcache/prefix", json={"keys": chain}).json() == {"length": 4}
        assert cb.post(f"{b.url}/v1/buckets/kvcache/exists", json={"keys": [chain[3], "x"]}).json() == {
            "exists": [True, False]
        }
        head = cb.head(b.chunk_url(chain[0]))
        assert head.status_code == 200 and head.headers["x-kvgw-checksum"] == xxhash.xxh3_64_hexdigest(blobs[0])
        assert cb.get(b.chunk_url(chain[1])).content == blobs[1]
        # write-once holds across gateways
        r = cb.put(b.chunk_url(chain[2]), content=b"different")
        assert r.status_code == 200 and r.headers["x-kvgw-existed"] == "true"
        assert ca.get(a.chunk_url(chain[2])).content == blobs[2]
        # a delete on one gateway is a 404 on the other (its index entry is found dangling)
        assert ca.delete(a.chunk_url(chain[1])).status_code == 204
        assert cb.get(b.chunk_url(chain[1])).status_code == 404


def test_concurrent_puts_from_two_gateways_store_one_body(server_factory: type[ServerProcess],
                                                          tmp_path: Path) -> None:
    shared = tmp_path / "shared-fs"
    servers = [server_factory(data_dir=tmp_path / n, env={"KVGW_FS_ROOT": str(shared)}).start() for n in "ab"]
    bodies = [bytes([i]) * (3 << 20) for i in range(8)]
    statuses: list[int] = []

    def put(server: ServerProcess, body: bytes) -> None:
        with httpx.Client(headers=server.auth, timeout=60) as c:
            statuses.append(c.put(server.chunk_url("contended"), content=body).status_code)

    threads = [threading.Thread(target=put, args=(servers[i % 2], body)) for i, body in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [200] * 7 + [201]
    seen = set()
    for server in servers:
        with httpx.Client(headers=server.auth) as c:
            seen.add(c.get(server.chunk_url("contended")).content)
    assert len(seen) == 1 and seen.pop() in bodies
