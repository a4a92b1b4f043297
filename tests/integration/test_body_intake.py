"""The body intake (gateway.dataplane.intake): large PUT bodies are read straight into the app's pieces.

On a real gateway over raw sockets, so the bytes arrive as a client sends them: back to back and
pipelined on one connection, paused mid-body, behind ``Expect: 100-continue``, cut off, stalled, or not
matching their checksum. Every stored chunk is read back whole; every refused one stays invisible.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from gateway.dataplane.intake import INTAKE_MIN_BYTES, INTAKE_PIECE_BYTES, PARTIAL_AFTER
from tests.conftest import ServerProcess

BIG = 2 * INTAKE_PIECE_BYTES + 12_345  # three pieces, the last one short
IDLE_TIMEOUT = 3.0  # the gateway's body idle deadline here (> PARTIAL_AFTER, so a pause is survived)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("intake") / "data",
                           env={"KVGW_BODY_IDLE_TIMEOUT": str(IDLE_TIMEOUT)}).start()
    yield server
    server.stop()


def put_head(server: ServerProcess, key: str, length: int, *extra: bytes) -> bytes:
    lines = [f"PUT /v1/buckets/kvcache/chunks/{key} HTTP/1.1".encode(), b"Host: kvgw",
             f"Authorization: {server.auth['Authorization']}".encode(), f"Content-Length: {length}".encode(), *extra]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def get_head(server: ServerProcess, key: str) -> bytes:
    return (f"GET /v1/buckets/kvcache/chunks/{key} HTTP/1.1\r\nHost: kvgw\r\n"
            f"Authorization: {server.auth['Authorization']}\r\n\r\n").encode()


class Responses:
    """Reads HTTP/1.1 responses (each with a Content-Length) off one socket, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffered = b""

    def _fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the gateway closed the connection")
        self.buffered += data

    def next(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffered:
            self._fill()
        head, _, self.buffered = self.buffered.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffered) < length:
            self._fill()
        body, self.buffered = self.buffered[:length], self.buffered[length:]
        return int(status_line.split()[1]), headers, body


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=IDLE_TIMEOUT * 4)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def receives(server: ServerProcess) -> dict[str, float]:
    """``kvgw_threaded_receives_total`` by result: how the gateway's threaded receives have ended."""
    text = httpx.get(f"{server.url}/metrics", headers=server.auth, timeout=10).text
    return {sample.labels["result"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "kvgw_threaded_receives_total"}


def ended_since(before: dict[str, float], server: ServerProcess) -> dict[str, float]:
    return {result: count - before.get(result, 0.0) for result, count in receives(server).items()
            if count != before.get(result, 0.0)}


def stored(server: ServerProcess, key: str) -> bytes | None:
    answer = httpx.get(server.chunk_url(key), headers=server.auth, timeout=30)
    return answer.content if answer.status_code == 200 else None


def test_the_intake_takes_bodies_from_its_threshold_and_pieces_are_its_write_unit() -> None:
    assert INTAKE_MIN_BYTES <= INTAKE_PIECE_BYTES < BIG


@pytest.mark.parametrize(("first_size", "second_size"), [(BIG, INTAKE_MIN_BYTES), (100_000, 100_000)],
                         ids=["through the intake", "below its threshold"])
def test_puts_back_to_back_and_a_get_pipelined_behind_them_on_one_connection(
        gateway: ServerProcess, first_size: int, second_size: int) -> None:
    """The second PUT (and the GET) arrive while the first is still being answered: uvicorn queues them.
    The first's answer must not close the connection because the queued PUT's body is still coming."""
    first, second = os.urandom(first_size), os.urandom(second_size)  # INTAKE_MIN_BYTES: the least it takes
    wire_bytes = (put_head(gateway, "bb-1", len(first)) + first + put_head(gateway, "bb-2", len(second)) + second
                  + get_head(gateway, "bb-1"))
    with connect(gateway) as sock:
        sock.sendall(wire_bytes)  # one stream: the intake must stop exactly where each body ends
        responses = Responses(sock)
        for body in (first, second):
            status, headers, _ = responses.next()
            assert status == 201
            assert headers["x-kvgw-checksum"] == xxhash.xxh3_64_hexdigest(body)
        status, _, got = responses.next()
        assert status == 200 and got == first
    assert stored(gateway, "bb-2") == second
    for key in ("bb-1", "bb-2"):
        assert httpx.delete(gateway.chunk_url(key), headers=gateway.auth).status_code == 204


def test_a_body_sent_in_one_go_is_received_by_a_worker_thread(gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    before = receives(gateway)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "threaded", len(body)) + body)
        assert Responses(sock).next()[0] == 201
    # one threaded receive, to the end unless a piece took longer than its deadline to arrive
    assert sum(ended_since(before, gateway).get(result, 0) for result in ("complete", "slow")) == 1
    assert stored(gateway, "threaded") == body


def test_a_body_that_pauses_mid_piece_is_stored_whole(gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    before = receives(gateway)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "paused", len(body)) + body[:300_000])
        time.sleep(PARTIAL_AFTER * 1.5)  # the app gets the partial piece, and waits on within its deadline
        sock.sendall(body[300_000:])
        status, _, _ = Responses(sock).next()
    assert status == 201
    # a worker thread took the body (and, unless the gateway reached it only after the pause, gave it back
    # to the event loop when the pause outlasted a piece's deadline)
    assert sum(ended_since(before, gateway).get(result, 0) for result in ("complete", "slow")) == 1
    assert stored(gateway, "paused") == body


def test_expect_100_continue_is_answered_before_the_body_is_sent(gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "continued", len(body), b"Expect: 100-continue"))
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(64)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        status, _, _ = Responses(sock).next()
    assert status == 201
    assert stored(gateway, "continued") == body


def test_a_body_the_client_abandons_stores_nothing_and_the_gateway_serves_on(gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "abandoned", len(body)) + body[: INTAKE_PIECE_BYTES + 1000])
    after = os.urandom(BIG)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "after-abandoned", len(after)) + after)
        assert Responses(sock).next()[0] == 201
    assert stored(gateway, "abandoned") is None
    assert stored(gateway, "after-abandoned") == after


def test_a_stalled_body_gets_its_error_after_the_idle_deadline_and_stores_nothing(gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    before = receives(gateway)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "stalled", len(body)) + body[: INTAKE_PIECE_BYTES + 1000])
        status, headers, answer = Responses(sock).next()  # nothing more is sent
        assert status == 400 and b"IncompleteBody" in answer and headers["connection"] == "close"
        assert sock.recv(1) == b""  # the rest of that body will never be parsed as a request
    assert ended_since(before, gateway) == {"slow": 1}  # no thread waited for it
    assert stored(gateway, "stalled") is None


def test_a_body_that_does_not_match_its_checksum_is_refused_and_the_connection_serves_on(
        gateway: ServerProcess) -> None:
    body = os.urandom(BIG)
    wrong = f"X-Kvgw-Checksum: {xxhash.xxh3_64_intdigest(body) ^ 1:016x}".encode()
    fine = os.urandom(BIG)
    with connect(gateway) as sock:
        sock.sendall(put_head(gateway, "mismatch", len(body), wrong) + body)
        responses = Responses(sock)
        status, _, answer = responses.next()
        assert status == 400 and b"BadDigest" in answer
        sock.sendall(put_head(gateway, "after-mismatch", len(fine)) + fine)  # the same connection
        assert responses.next()[0] == 201
    assert stored(gateway, "mismatch") is None
    assert stored(gateway, "after-mismatch") == fine
