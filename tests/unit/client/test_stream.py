"""Batch-get streams read by ``kvgw_client.stream`` (through ``KvgwClient.batch_get_into``), against a
scripted HTTP server on a real socket: every way a gateway (or something between) may frame, split,
cut, stall or refuse the answer. The real gateway's batch-get is tested in
``tests/integration/client/test_http_client.py``; this file covers the wire shapes it does not send."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import xxhash

from kvgw_client import wire
from kvgw_client.errors import ProtocolError, Rejected, ServerError, Unavailable
from kvgw_client.framing import ItemStatus
from kvgw_client.http import KvgwClient
from tests.unit.client.scripted import chunked, head, send_in_pieces, server_of


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
    sent = server_of(client).requests[0]
    first, *lines = sent.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert first == b"POST /v1/buckets/kvcache/batch-get HTTP/1.1"
    names = {line.split(b":")[0].lower() for line in lines}
    assert {b"host", b"content-type", b"content-length", wire.H_VERIFY.lower().encode()} <= names
    assert sent.endswith(b'{"keys": ["k0"]}')


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
    assert server_of(client).connections == 3


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
    assert server_of(client).connections == 2
