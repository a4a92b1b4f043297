"""Batch-get streams read by ``kvgw_client.stream`` (through ``KvgwClient.batch_get_into``), against a
scripted HTTP server on a real socket: every way a gateway (or something between) may frame, split,
cut, stall or refuse the answer. The real gateway's batch-get is tested in
``tests/integration/client/test_http_client.py``; this file covers the wire shapes it does not send."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import xxhash

from kvgw_client import wire
from kvgw_client.config import ClientSettings, RetryPolicy, Timeouts
from kvgw_client.errors import ProtocolError, Rejected, ServerError, Unavailable
from kvgw_client.framing import ItemStatus
from kvgw_client.http import KvgwClient

Respond = Callable[[socket.socket, int], bool]
"""Writes the answer to request number ``n`` (0-based, over all connections); True keeps the
connection open for the next request."""


class ScriptedServer:
    """Reads each HTTP request (head and Content-Length body) and answers it with ``respond``."""

    instances: list[ScriptedServer] = []

    def __init__(self, respond: Respond) -> None:
        ScriptedServer.instances.append(self)
        self.respond = respond
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(data) < length:
                    data += conn.recv(65536)
                with self._lock:
                    self.requests.append(head + b"\r\n\r\n" + data[:length])
                    n = len(self.requests) - 1
                data = data[length:]
                try:
                    if not self.respond(conn, n):
                        return
                except OSError:
                    return

    def close(self) -> None:
        self._sock.close()


def batch_body(payloads: list[bytes | None], *, corrupt: int | None = None) -> bytes:
    """A batch-get body: a frame per payload (None: missing), frame ``corrupt`` with a wrong checksum."""
    out = [wire.encode_batch_header(len(payloads))]
    for i, payload in enumerate(payloads):
        if payload is None:
            out.append(wire.encode_frame_header(wire.FRAME_MISSING))
            continue
        checksum = xxhash.xxh3_64_intdigest(payload) ^ (1 if i == corrupt else 0)
        out += [wire.encode_frame_header(wire.FRAME_OK, len(payload), checksum), payload]
    out.append(wire.encode_batch_trailer(len(payloads)))
    return b"".join(out)


def head(status: str = "200 OK", *, framing: str, extra: str = "", ctype: str = wire.BATCH_CONTENT_TYPE) -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\n{framing}{extra}\r\n".encode()


def chunked(body: bytes, rng: random.Random) -> bytes:
    """``body`` in chunked transfer coding, chunks of random sizes (1 byte to 1 MiB)."""
    out, at = [], 0
    while at < len(body):
        n = min(len(body) - at, rng.choice((1, 7, 24, 4096, 65536, 1 << 20)))
        out += [b"%x\r\n" % n, body[at : at + n], b"\r\n"]
        at += n
    return b"".join(out) + b"0\r\n\r\n"


def chunked_as_the_gateway_sends(payloads: list[bytes | None]) -> bytes:
    """A batch-get body in chunked transfer coding the way kvgw's gateway sends it: one chunk for the
    batch header, one per frame header, one per payload, one for the trailer."""
    parts = [wire.encode_batch_header(len(payloads))]
    for payload in payloads:
        if payload is None:
            parts.append(wire.encode_frame_header(wire.FRAME_MISSING))
        else:
            parts += [wire.encode_frame_header(wire.FRAME_OK, len(payload), xxhash.xxh3_64_intdigest(payload)), payload]
    parts.append(wire.encode_batch_trailer(len(payloads)))
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def send_in_pieces(conn: socket.socket, data: bytes, rng: random.Random, *, small: bool) -> None:
    """``data`` in random pieces with pauses, so reads end anywhere: inside a head, a chunk-size line, a
    frame header or a payload."""
    at = 0
    while at < len(data):
        n = rng.randint(1, 40) if small else rng.randint(1, 3 << 20)
        conn.sendall(data[at : at + n])
        at += n
        if rng.random() < 0.05:
            time.sleep(0.001)


@pytest.fixture
def serve() -> Iterator[Callable[[Respond], KvgwClient]]:
    opened: list[tuple[ScriptedServer, KvgwClient]] = []

    def start(respond: Respond, *, read_timeout: float = 10.0, pool_size: int = 32) -> KvgwClient:
        server = ScriptedServer(respond)
        settings = ClientSettings(url=f"http://127.0.0.1:{server.port}", bucket="kvcache", pool_size=pool_size,
                                  timeouts=Timeouts(read=read_timeout), retry=RetryPolicy(attempts=1))
        client = KvgwClient(settings)
        opened.append((server, client))
        return client

    yield start
    for server, client in opened:
        client.close()
        server.close()


def read_all(client: KvgwClient, sizes: list[int], *, quiet: bool = False) -> tuple[list[ItemStatus], list[bytearray]]:
    buffers = [bytearray(n) for n in sizes]
    statuses = client.blocking.batch_get_into([f"k{i}" for i in range(len(sizes))],
                                              lambda i, n: memoryview(buffers[i])[:n], quiet=quiet)
    return statuses, buffers


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
@pytest.mark.parametrize("small", [True, False], ids=["tiny-pieces", "large-pieces"])
def test_payloads_arrive_whole_however_the_answer_is_framed_and_split(serve, framing: str, small: bool) -> None:
    rng = random.Random(f"{framing}-{small}")
    payloads: list[bytes | None] = [rng.randbytes(n) for n in (1, 0, 5000, 300_000)] + [None]
    if not small:
        payloads.append(rng.randbytes(3 << 20))
    body = batch_body(payloads)

    def respond(conn: socket.socket, n: int) -> bool:
        if framing == "chunked":
            data = head(framing="transfer-encoding: chunked\r\n") + chunked(body, rng)
        elif framing == "length":
            data = head(framing=f"content-length: {len(body)}\r\n") + body
        else:
            data = head(framing="connection: close\r\n") + body
        send_in_pieces(conn, data, rng, small=small)
        return framing != "close"

    client = serve(respond)
    sizes = [len(p or b"") for p in payloads]
    for _ in range(2):  # twice: the second on the kept connection (or a new one after a close)
        statuses, buffers = read_all(client, sizes)
        assert statuses == [ItemStatus.MISSING if p is None else ItemStatus.OK for p in payloads]
        assert [bytes(b) for b, p in zip(buffers, payloads, strict=True) if p is not None] == [
            p for p in payloads if p is not None]


def test_payloads_are_received_straight_into_their_destinations(serve) -> None:
    """The zero-copy path is engaged: of 16 MiB of payload sent in large pieces, almost nothing passes
    through the reader's small buffer (``batch_get.bytes_copied``)."""
    rng = random.Random(7)
    payloads: list[bytes | None] = [rng.randbytes(4 << 20) for _ in range(4)]
    body = batch_body(payloads)

    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(head(framing="transfer-encoding: chunked\r\n") + chunked_as_the_gateway_sends(payloads))
        return True

    client = serve(respond)
    statuses, buffers = read_all(client, [4 << 20] * 4)
    assert statuses == [ItemStatus.OK] * 4
    assert [bytes(b) for b in buffers] == payloads
    counters = client.stats()["counters"]
    assert isinstance(counters, dict)
    assert counters["batch_get.bytes"] == len(body)
    assert counters["batch_get.bytes_copied"] < len(body) // 20


def test_the_request_is_a_verifying_batch_get(serve) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        body = batch_body([b"x"])
        conn.sendall(head(framing=f"content-length: {len(body)}\r\n") + body)
        return True

    client = serve(respond)
    assert read_all(client, [1])[0] == [ItemStatus.OK]
    sent = _server_of(client).requests[0]
    first, *lines = sent.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert first == b"POST /v1/buckets/kvcache/batch-get HTTP/1.1"
    names = {line.split(b":")[0].lower() for line in lines}
    assert {b"host", b"content-type", b"content-length", wire.H_VERIFY.lower().encode()} <= names
    assert sent.endswith(b'{"keys": ["k0"]}')


def _server_of(client: KvgwClient) -> ScriptedServer:
    port = int(client.settings.url.rsplit(":", 1)[1])
    return next(s for s in ScriptedServer.instances if s.port == port)


def test_an_error_answer_becomes_the_gateways_error(serve) -> None:
    error = b'{"error": {"code": "SlowDown", "message": "busy", "request_id": "r-1"}}'

    def respond(conn: socket.socket, n: int) -> bool:
        status = "503 Service Unavailable" if n == 0 else "404 Not Found"
        conn.sendall(head(status, framing=f"content-length: {len(error)}\r\n", ctype="application/json") + error)
        return True

    client = serve(respond)
    with pytest.raises(ServerError) as info:
        read_all(client, [1])
    assert (info.value.status, info.value.code, info.value.request_id) == (503, "SlowDown", "r-1")
    with pytest.raises(Rejected) as rejected:
        read_all(client, [1])
    assert rejected.value.status == 404


def test_a_stream_cut_mid_payload_keeps_what_arrived_and_loses_the_rest(serve) -> None:
    payloads: list[bytes | None] = [b"a" * 1000, b"b" * 100_000, b"c" * 10]
    body = batch_body(payloads)
    cut = body.index(b"b" * 100_000) + 50_000

    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(head(framing=f"content-length: {len(body)}\r\n") + body[:cut])
        return False

    client = serve(respond)
    statuses, buffers = read_all(client, [1000, 100_000, 10], quiet=True)
    assert statuses == [ItemStatus.OK, ItemStatus.LOST, ItemStatus.LOST]
    assert bytes(buffers[0]) == payloads[0]
    with pytest.raises(Unavailable):
        read_all(client, [1000, 100_000, 10])


def test_a_damaged_payload_is_corrupt_and_the_others_are_kept(serve) -> None:
    payloads: list[bytes | None] = [b"a" * 70_000, b"b" * 70_000]
    body = batch_body(payloads, corrupt=0)

    def respond(conn: socket.socket, n: int) -> bool:
        if n == 0:
            conn.sendall(head(framing="transfer-encoding: chunked\r\n") + chunked(body, random.Random(3)))
        else:  # the client's damage report
            conn.sendall(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}')
        return True

    client = serve(respond)
    statuses, buffers = read_all(client, [70_000, 70_000], quiet=True)
    assert statuses == [ItemStatus.CORRUPT, ItemStatus.OK]
    assert bytes(buffers[1]) == payloads[1]


def test_a_connection_the_gateway_closed_while_idle_is_replaced(serve) -> None:
    """The gateway ends a keep-alive connection after the first answer without saying so: the next
    batch-get goes out again on a new connection and succeeds."""
    body = batch_body([b"z" * 10])

    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(head(framing=f"content-length: {len(body)}\r\n") + body)
        return False  # closes without "connection: close"

    client = serve(respond)
    for _ in range(3):
        statuses, buffers = read_all(client, [10])
        assert statuses == [ItemStatus.OK] and bytes(buffers[0]) == b"z" * 10
    assert _server_of(client).connections == 3


@pytest.mark.parametrize("bad", [b"zz\r\n", b"5\r\nabcdefg\r\n", b"HTTP/9 what\r\n\r\n"],
                         ids=["size", "crlf", "status"])
def test_a_malformed_answer_is_a_protocol_error(serve, bad: bytes) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        if bad.startswith(b"HTTP"):
            conn.sendall(bad)
        else:
            conn.sendall(head(framing="transfer-encoding: chunked\r\n") + bad)
        time.sleep(0.05)
        return False

    client = serve(respond)
    with pytest.raises(ProtocolError, match="malformed"):
        read_all(client, [5])


def test_a_gateway_that_stops_sending_times_out(serve) -> None:
    stop = threading.Event()
    body = batch_body([b"q" * 1000])

    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(head(framing=f"content-length: {len(body)}\r\n") + body[:100])
        stop.wait(10)
        return False

    client = serve(respond, read_timeout=0.2)
    try:
        with pytest.raises(Unavailable) as info:
            read_all(client, [1000])
        assert info.value.timeout
    finally:
        stop.set()


def test_an_interim_answer_is_skipped(serve) -> None:
    body = batch_body([b"ok"])

    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + head(framing=f"content-length: {len(body)}\r\n") + body)
        return True

    client = serve(respond)
    statuses, buffers = read_all(client, [2])
    assert statuses == [ItemStatus.OK] and bytes(buffers[0]) == b"ok"


def test_concurrent_streams_share_at_most_pool_size_connections(serve) -> None:
    body = batch_body([b"p" * 100_000])

    def respond(conn: socket.socket, n: int) -> bool:
        time.sleep(0.02)  # each answer takes a while, so the calls overlap
        conn.sendall(head(framing=f"content-length: {len(body)}\r\n") + body)
        return True

    client = serve(respond, pool_size=2)
    results: list[list[ItemStatus]] = []
    threads = [threading.Thread(target=lambda: results.append(read_all(client, [100_000])[0])) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [[ItemStatus.OK]] * 6
    assert _server_of(client).connections == 2
