"""Blocking lookups (``KvgwClient.blocking.exists`` / ``prefix``) made on the calling thread
(``KvgwClient.lookup_now`` over ``kvgw_client.calls``), against a scripted HTTP server on a real socket:
the answer however it is framed and split, connections the gateway closed, failures handed to the
call policy (retries, deadline, circuit), leases remembered, and the I/O loop never needed. The real
gateway's lookups are tested in ``tests/integration/client/test_http_client.py``."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import Callable

import pytest

from kvgw_client.config import RetryPolicy, Timeouts
from kvgw_client.errors import CircuitOpen, ProtocolError, Rejected, Unavailable
from kvgw_client.health import CircuitState
from kvgw_client.http import KvgwClient
from tests.unit.client.scripted import chunked, head, send_in_pieces, server_of

Serve = Callable[..., KvgwClient]
KEYS = ["model@a/0", "model@a/1", "model@a/2"]


def json_answer(doc: object, *, status: str = "200 OK", framing: str = "length", rng: random.Random | None = None,
                extra: str = "") -> bytes:
    body = json.dumps(doc).encode()
    if framing == "chunked":
        return head(status, framing="transfer-encoding: chunked\r\n", extra=extra,
                    ctype="application/json") + chunked(body, rng or random.Random(0))
    if framing == "close":
        return head(status, framing="connection: close\r\n", extra=extra, ctype="application/json") + body
    return head(status, framing=f"content-length: {len(body)}\r\n", extra=extra, ctype="application/json") + body


def body_of(request: bytes) -> dict[str, object]:
    doc = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_an_answer_arrives_whole_however_it_is_framed_and_split(serve: Serve, framing: str) -> None:
    rng = random.Random(framing)

    def respond(conn: socket.socket, n: int) -> bool:
        doc = {"exists": [True, False, True]} if n % 2 == 0 else {"length": 2}
        send_in_pieces(conn, json_answer(doc, framing=framing, rng=rng), rng, small=True)
        return framing != "close"

    client = serve(respond)
    for _ in range(2):  # twice: the second on the kept connection (or a new one after a close)
        assert client.blocking.exists(KEYS) == [True, False, True]
        assert client.blocking.prefix(KEYS) == 2
    requests = server_of(client).requests
    assert [r.split(b"\r\n", 1)[0] for r in requests] == [
        b"POST /v1/buckets/kvcache/exists HTTP/1.1", b"POST /v1/buckets/kvcache/prefix HTTP/1.1"] * 2
    assert all(body_of(r) == {"keys": KEYS} for r in requests)
    assert server_of(client).connections == (4 if framing == "close" else 1)
    assert client.counters.get("exists.calls") == 2 and client.counters.get("exists.retries") == 0


def test_the_calling_thread_makes_the_lookup_while_the_io_loop_is_busy(serve: Serve) -> None:
    """The lookup needs nothing of the client's I/O loop: it is answered while that loop is stuck in a
    callback that only ends once the lookup has returned (through the loop, the two would wait for
    each other until the guard below gives up)."""
    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(json_answer({"exists": [True, True, False]}))
        return True

    client = serve(respond)
    stuck, release = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        stuck.set()
        release.wait(60)

    answers: list[list[bool]] = []
    lookup = threading.Thread(target=lambda: answers.extend(
        [client.blocking.exists(KEYS), client.blocking.exists(KEYS, timeout=5.0)]))
    client.io.loop.call_soon_threadsafe(hold_the_loop)
    assert stuck.wait(10)
    try:
        lookup.start()
        lookup.join(30)  # a guard against a hang, not a measurement
        assert answers == [[True, True, False]] * 2
    finally:
        release.set()
        lookup.join()


def test_a_connection_the_gateway_closed_while_idle_is_replaced(serve: Serve) -> None:
    """The gateway ends each keep-alive connection after its answer without saying so: the next lookup
    finds its kept connection closed before any answer and goes out again on a new one: no failure,
    no retry counted."""
    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(json_answer({"length": 3}))
        return False

    client = serve(respond)
    for _ in range(3):
        assert client.blocking.prefix(KEYS) == 3
    assert server_of(client).connections == 3
    assert client.counters.get("prefix.retries") == 0 and client.stats()["failures"] == {}


def test_a_failed_first_attempt_is_the_call_policys_first_attempt(serve: Serve) -> None:
    """A 503 to the attempt made on the calling thread is retried by the call policy on the I/O loop,
    counted as one call with one retry."""
    def respond(conn: socket.socket, n: int) -> bool:
        if n == 0:
            conn.sendall(json_answer({"error": {"code": "Unavailable", "message": "busy"}},
                                     status="503 Service Unavailable"))
        else:
            conn.sendall(json_answer({"exists": [False, True, True]}))
        return True

    client = serve(respond, retry=RetryPolicy(attempts=3, backoff=0.0))
    assert client.blocking.exists(KEYS) == [False, True, True]
    assert len(server_of(client).requests) == 2
    assert client.counters.get("exists.calls") == 1 and client.counters.get("exists.retries") == 1
    assert client.health is CircuitState.CLOSED


def test_a_refusal_is_the_gateways_error_and_a_quiet_lookups_neutral_answer(serve: Serve) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(json_answer({"error": {"code": "NoSuchBucket", "message": "no bucket kvcache",
                                            "request_id": "r-1"}}, status="404 Not Found"))
        return True

    client = serve(respond, retry=RetryPolicy(attempts=3, backoff=0.0))
    with pytest.raises(Rejected, match="no bucket kvcache") as info:
        client.blocking.exists(KEYS)
    assert info.value.status == 404 and info.value.request_id == "r-1"
    assert client.blocking.prefix(KEYS, quiet=True) == 0
    assert client.blocking.exists(KEYS, quiet=True) == [False] * 3
    assert len(server_of(client).requests) == 3  # a refusal is not retried


@pytest.mark.parametrize("bad", [b"HTTP/9 what\r\n\r\n", b"not json"], ids=["status", "body"])
def test_a_malformed_answer_is_a_protocol_error(serve: Serve, bad: bytes) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(bad if bad.startswith(b"HTTP") else head(framing=f"content-length: {len(bad)}\r\n") + bad)
        return False

    client = serve(respond)
    with pytest.raises(ProtocolError):
        client.blocking.exists(KEYS)
    assert client.blocking.exists(KEYS, quiet=True) == [False] * 3


def test_a_gateway_that_does_not_answer_ends_at_the_callers_deadline(serve: Serve) -> None:
    """The deadline ends the call with one failure, the deadline's, also when it runs out during the
    attempt made on the calling thread."""
    stop = threading.Event()

    def respond(conn: socket.socket, n: int) -> bool:
        stop.wait(30)
        return False

    client = serve(respond, retry=RetryPolicy(attempts=3, backoff=0.0))
    try:
        with pytest.raises(Unavailable, match=r"exists: no answer within 0\.2s") as info:
            client.blocking.exists(KEYS, timeout=0.2)
        assert info.value.timeout
        assert client.blocking.prefix(KEYS, quiet=True, timeout=0.2) == 0
        assert client.stats()["failures"] == {"exists.timeout": 1, "prefix.timeout": 1}
    finally:
        stop.set()


def test_an_open_circuit_fails_fast_without_a_request(serve: Serve) -> None:
    stop = threading.Event()

    def respond(conn: socket.socket, n: int) -> bool:
        stop.wait(30)
        return False

    client = serve(respond, timeouts=Timeouts(control=0.1))
    try:
        for _ in range(3):
            assert client.blocking.exists(KEYS, quiet=True) == [False] * 3
        assert client.health is CircuitState.OPEN
        sent = len(server_of(client).requests)
        with pytest.raises(CircuitOpen):
            client.blocking.exists(KEYS)
        assert len(server_of(client).requests) == sent
    finally:
        stop.set()


def test_a_lease_granted_to_a_blocking_lookup_covers_the_next_lookup(serve: Serve) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        if n == 0:
            conn.sendall(json_answer({"exists": [True, True, False],
                                      "lease": {"granted_ms": 60_000, "chunks": 2, "bytes": 10}}))
        else:
            conn.sendall(json_answer({"exists": [True, True]}))
        return True

    client = serve(respond, lease_ms=60_000)
    assert client.blocking.exists(KEYS) == [True, True, False]
    assert client.blocking.exists(KEYS[:2]) == [True, True]  # both hits leased a moment ago: no lease asked
    first, second = (body_of(r) for r in server_of(client).requests)
    assert first == {"keys": KEYS, "lease_ms": 60_000}
    assert second == {"keys": KEYS[:2]}


def test_an_invalid_key_is_refused_before_any_request(serve: Serve) -> None:
    client = serve(lambda conn, n: False)
    with pytest.raises(Rejected, match="control character"):
        client.blocking.exists(["fine", "bad\x01key"])
    assert client.blocking.prefix(["", "x"], quiet=True) == 0
    assert client.blocking.exists([]) == [] and client.blocking.prefix([]) == 0
    assert server_of(client).requests == []


def test_a_blocking_lookup_from_an_event_loop_thread_is_refused(serve: Serve) -> None:
    client = serve(lambda conn, n: False)

    async def on_a_loop() -> None:
        client.blocking.exists(KEYS)

    with pytest.raises(RuntimeError, match="event loop thread"):
        asyncio.run(on_a_loop())
    assert server_of(client).requests == []


@pytest.mark.parametrize("doc", [{"exists": [True, 1, False]}, {"exists": [True, False]}, {"length": 9},
                                 {"exists": "yes"}], ids=["not-a-bool", "too-few", "length-too-big", "not-a-list"])
def test_an_answer_of_the_wrong_shape_is_a_protocol_error(serve: Serve, doc: dict[str, object]) -> None:
    def respond(conn: socket.socket, n: int) -> bool:
        conn.sendall(json_answer(doc))
        return True

    client = serve(respond)
    lookup = client.blocking.prefix if "length" in doc else client.blocking.exists
    with pytest.raises(ProtocolError, match="expected"):
        lookup(KEYS)
