"""The benchmark load generator's HTTP handling against a tiny real HTTP/1.1 server (``http.server``):
byte counts, keep-alive reuse, chunked and close-delimited bodies, and error counting."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.bench.loadgen import HttpConnection, LoadRequest, Op, percentile, request_once, run_load, run_ops


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # head and body go out in separate writes
    server: TinyServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _plain(self, status: int, body: bytes, *extra: tuple[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        _, kind, arg = self.path.split("/", 2)
        n = int(arg) if arg.isdigit() else 0
        if kind == "bytes":
            self._plain(200, b"x" * n)
        elif kind == "status":
            self._plain(n, b"nope")
        elif kind == "close":
            self._plain(200, b"c" * n, ("Connection", "close"))
            self.close_connection = True
        elif kind == "silent-close":  # closes the kept-alive connection without saying so
            self._plain(200, b"s" * n)
            self.close_connection = True
        elif kind == "eof":  # no length: the body ends when the connection does
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"e" * n)
            self.close_connection = True
        elif kind == "chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = bytes(i % 251 for i in range(n))
            for at in range(0, n, 1000):
                piece = data[at : at + 1000]
                self.wfile.write(f"{len(piece):x};ext=1\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\nX-Trailer: t\r\n\r\n")
        else:
            self._plain(404, b"no route")

    def do_PUT(self) -> None:
        length = int(self.headers["Content-Length"])
        got = 0
        while got < length:
            got += len(self.rfile.read(min(65536, length - got)))
        self._plain(201, json.dumps({"received": got}).encode(), ("Content-Type", "application/json"))


class TinyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.connections = 0

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.server_address[1])


@pytest.fixture(scope="module")
def server() -> Iterator[TinyServer]:
    srv = TinyServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


class ThreadClock:
    """A fake clock per thread (each client's own timeline, from 0): an op "takes" time by advancing
    its thread's clock, so the driver's deadline and rates are exact whatever the machine's load.
    A forked client process starts from the forking thread's time, 0 here, as the barrier does."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        now: float = getattr(self._local, "now", 0.0)
        return now

    def advance(self, seconds: float) -> None:
        self._local.now = self() + seconds


def wait_for_peer_close(sock: socket.socket | None, timeout: float = 30.0) -> None:
    """Until the peer's FIN has arrived on ``sock``: readable, and a peek reads end of stream."""
    assert sock is not None
    readable, _, _ = select.select([sock], [], [], timeout)
    assert readable, f"the server did not close the connection within {timeout} s"
    assert sock.recv(1, socket.MSG_PEEK) == b"", "the server sent bytes instead of closing"


def connections_during(server: TinyServer) -> int:
    with server.lock:
        return server.connections


def test_bytes_counted_and_connections_kept_alive(server: TinyServer) -> None:
    before = connections_during(server)
    req = LoadRequest("GET", "/bytes/100000")
    # a body buffer smaller than the body: it streams through (wraps) and is still fully counted
    stats = run_load(server.address, lambda i, seq: req, 2, count=40, body_buffer_bytes=4096)
    assert (stats.ops, stats.errors, stats.bytes) == (40, 0, 40 * 100_000)
    assert stats.statuses == {200: 40}
    assert stats.connects == 2
    assert connections_during(server) - before == 2  # one connection per client, reused throughout
    assert len(stats.latencies) == 40 and stats.elapsed > 0


def test_small_body_kept_in_the_buffer(server: TinyServer) -> None:
    conn = HttpConnection(server.address, body_buffer_bytes=1024)
    try:
        assert conn.request(LoadRequest("GET", "/bytes/10")) == (200, 10)
        assert conn.body is not None and bytes(conn.body) == b"x" * 10
        assert conn.request(LoadRequest("GET", "/bytes/5000")) == (200, 5000)
        assert conn.body is None  # did not fit: only the length is known
        assert conn.connects == 1
    finally:
        conn.close()


def test_hashed_bodies_must_fit_the_buffer(server: TinyServer) -> None:
    """``hash_bodies`` hashes each body as read: one larger than the body buffer is an error, not a
    silent hash of what was left of it."""
    fits = run_load(server.address, lambda i, seq: LoadRequest("GET", "/bytes/4000"), 1, count=5,
                    body_buffer_bytes=4096, hash_bodies=True)
    assert (fits.ops, fits.errors, fits.bytes) == (5, 0, 5 * 4000)
    too_big = run_load(server.address, lambda i, seq: LoadRequest("GET", "/bytes/5000"), 1, count=2,
                       body_buffer_bytes=4096, hash_bodies=True)
    assert too_big.ops == 0 and too_big.errors == 2
    assert any("does not fit the body buffer" in e for e in too_big.error_samples)


def test_put_body_sent_from_the_callers_buffer(server: TinyServer) -> None:
    payload = bytearray(b"p" * 300_000)  # above the small-body threshold: head and body sent separately
    reqs = [LoadRequest("PUT", "/sink", body=payload, expect=(201,)),
            LoadRequest("PUT", "/sink", body=b"tiny", expect=(201,))]
    conn = HttpConnection(server.address)
    try:
        for req in reqs:
            status, _ = conn.request(req)
            assert status == 201
            assert conn.body is not None
            assert json.loads(bytes(conn.body)) == {"received": req.body_length}
        assert conn.connects == 1
    finally:
        conn.close()
    stats = run_load(server.address, lambda i, seq: reqs[0], 1, count=3)
    assert stats.errors == 0 and stats.bytes == 3 * (300_000 + len(b'{"received": 300000}'))


def test_chunked_body_then_keep_alive(server: TinyServer) -> None:
    conn = HttpConnection(server.address)
    try:
        assert conn.request(LoadRequest("GET", "/chunked/5500")) == (200, 5500)
        assert conn.body is not None and bytes(conn.body) == bytes(i % 251 for i in range(5500))
        assert conn.request(LoadRequest("GET", "/bytes/7")) == (200, 7)
        assert conn.connects == 1
    finally:
        conn.close()


def test_head_has_no_body(server: TinyServer) -> None:
    conn = HttpConnection(server.address)
    try:
        assert conn.request(LoadRequest("HEAD", "/bytes/100000")) == (200, 0)
        assert conn.request(LoadRequest("GET", "/bytes/3")) == (200, 3)
        assert conn.connects == 1
    finally:
        conn.close()


def test_unexpected_statuses_are_counted_as_errors(server: TinyServer) -> None:
    ok, missing = LoadRequest("GET", "/bytes/10"), LoadRequest("GET", "/status/404")
    stats = run_load(server.address, lambda i, seq: missing if seq % 3 == 0 else ok, 1, count=30)
    assert (stats.ops, stats.errors) == (20, 10)
    assert stats.bytes == 20 * 10  # failed operations move no counted bytes
    assert stats.statuses == {200: 20, 404: 10}
    assert any("404" in s and "nope" in s for s in stats.error_samples)
    assert stats.connects == 1  # a complete error response leaves the connection usable
    tolerated = run_load(server.address, lambda i, seq: LoadRequest("GET", "/status/404", expect=(200, 404)), 1,
                         count=3)
    assert (tolerated.ops, tolerated.errors) == (3, 0)


def test_then_request_is_part_of_the_same_operation(server: TinyServer) -> None:
    put = LoadRequest("PUT", "/put", body=b"p" * 1000, expect=(201,))
    follow = {seq: LoadRequest("GET", f"/bytes/{seq}") for seq in range(6)}
    stats = run_load(server.address, lambda i, seq: put, 1, count=6, then=lambda i, seq: follow[seq])
    # six operations, each a PUT (1000 bytes sent, its JSON answer read) and its GET (seq bytes read)
    put_answer = len(b'{"received": 1000}')
    assert (stats.ops, stats.errors, len(stats.latencies)) == (6, 0, 6)
    assert stats.bytes == 6 * (1000 + put_answer) + sum(range(6))
    assert stats.statuses == {201: 6, 200: 6}
    assert stats.connects == 1
    failing = run_load(server.address, lambda i, seq: put, 1, count=4,
                       then=lambda i, seq: LoadRequest("GET", "/status/404"))
    assert (failing.ops, failing.errors) == (0, 4)  # an operation fails when its second request does


def test_connection_close_and_eof_delimited_bodies(server: TinyServer) -> None:
    stats = run_load(server.address, lambda i, seq: LoadRequest("GET", "/close/100"), 1, count=3)
    assert (stats.ops, stats.errors, stats.bytes, stats.connects) == (3, 0, 300, 3)
    stats = run_load(server.address, lambda i, seq: LoadRequest("GET", "/eof/123456"), 1, count=2)
    assert (stats.ops, stats.errors, stats.bytes, stats.connects) == (2, 0, 2 * 123456, 2)


def test_idle_close_is_retried_once(server: TinyServer) -> None:
    conn = HttpConnection(server.address)
    try:
        assert conn.request(LoadRequest("GET", "/silent-close/5")) == (200, 5)
        wait_for_peer_close(conn.sock)  # the server has closed its end: the next request meets EOF
        assert conn.request(LoadRequest("GET", "/bytes/4")) == (200, 4)
        assert conn.connects == 2
    finally:
        conn.close()


def test_unreachable_target_is_an_error_not_a_hang() -> None:
    from gateway.bench.launcher import free_port

    stats = run_load(("127.0.0.1", free_port()), lambda i, seq: LoadRequest("GET", "/"), 2, duration=0.2)
    assert stats.ops == 0 and stats.errors == 2
    assert all("ConnectionRefused" in s for s in stats.error_samples)


def test_run_ops_duration_and_tickets() -> None:
    seen: list[tuple[int, int]] = []

    def open_client(i: int) -> Op:
        def op(seq: int) -> int:
            seen.append((i, seq))
            if seq == 2:
                raise OSError("boom")
            return 1

        return op

    stats = run_ops(open_client, 3, count=10)
    assert sorted(seq for _, seq in seen) == list(range(10))  # each ticket once across clients
    assert (stats.ops, stats.errors, stats.bytes) == (9, 1, 9)
    seen.clear()
    clock = ThreadClock()

    def sleeper(i: int) -> Op:
        def op(seq: int) -> int:
            clock.advance(0.5)
            return 0

        return op

    stats = run_ops(sleeper, 2, duration=10.0, clock=clock)
    assert stats.ops == 40 and stats.elapsed == 10.0 and stats.window == 10.0  # 20 ops each until the deadline
    assert stats.ops_per_s == 4.0  # two clients, 2 ops/s each
    assert stats.latencies == [0.5] * 40
    with pytest.raises(ValueError, match="exactly one of duration and count"):
        run_ops(open_client, 1)


def test_rates_count_only_the_window() -> None:
    """An operation in flight at the deadline counts for its share inside the window: 3 s ops in a
    4 s window are 1 + 1/3 operations, a rate of 1/3 per second, not 2 ops over the 6 s until the last
    one finished."""
    clock = ThreadClock()

    def slow(i: int) -> Op:
        def op(seq: int) -> int:
            clock.advance(3.0)
            return 300

        return op

    stats = run_ops(slow, 1, duration=4.0, clock=clock)
    assert stats.ops == 2 and stats.elapsed == 6.0 and stats.window == 4.0
    assert stats.window_ops == pytest.approx(4 / 3)
    assert stats.ops_per_s == pytest.approx(1 / 3)
    assert stats.bytes_per_s == pytest.approx(100.0)


def test_clients_in_processes_run_in_separate_processes() -> None:
    """Each client is its own process (its own GIL); results and the window come back to the parent."""
    parent = os.getpid()
    clock = ThreadClock()  # each forked child advances its own copy

    def opener(i: int) -> Op:
        if i == 2:
            raise RuntimeError("cannot connect")

        def op(seq: int) -> int:
            clock.advance(0.5)
            if seq == 3 or os.getpid() == parent:
                raise ValueError("one bad op, or an op run in the parent")
            return 5

        return op

    stats = run_ops(opener, 3, duration=10.0, processes=True, clock=clock)
    assert stats.errors == 3  # one setup failure, one bad op per live client
    assert stats.ops == 2 * 19  # 20 ops each in the window, one of them failed
    assert stats.bytes == 5 * stats.ops
    assert stats.elapsed == 10.0 and stats.window == 10.0
    assert any("cannot connect" in e for e in stats.error_samples)


def test_processes_share_tickets_and_report_http_results(server: TinyServer) -> None:
    """Tickets are issued once across client processes; statuses and connections come back too."""
    reqs = [LoadRequest("GET", f"/bytes/{n}") for n in range(12)]
    stats = run_load(server.address, lambda i, seq: reqs[seq], 3, count=len(reqs), processes=True)
    assert (stats.ops, stats.errors) == (12, 0)
    assert stats.bytes == sum(range(12))  # each request exactly once
    assert stats.statuses == {200: 12} and stats.connects == 3


def test_request_once_and_percentile(server: TinyServer) -> None:
    assert request_once(server.address, LoadRequest("GET", "/bytes/12")) == (200, b"x" * 12)
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
