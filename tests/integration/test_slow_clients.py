"""Slow, idle, excess and malformed clients on real sockets against a real ``kvgw serve``.

Every answer given below the apps (parse errors, header timeouts, connection caps) is kvgw's JSON
error with a request id, and the connection is closed after it; stalled clients are closed; normal
requests keep working while a thousand stalled connections are open (their latency is measured by
``kvgw bench slow-clients``, not here).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess

AUTH = f"Authorization: Bearer {ROOT_AK}:{ROOT_SK}\r\n".encode()
PUT_HEAD = b"PUT /v1/buckets/kvcache/chunks/k HTTP/1.1\r\nHost: a\r\n" + AUTH
WAIT = 30.0  # generous: how long a test waits for the server to act, never what it asserts


def exchange(server: ServerProcess, raw: bytes, *, source: str = "127.0.0.1") -> bytes:
    """Send ``raw``, then read until the server closes (failing if it keeps the connection open)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT, source_address=(source, 0)) as sock:
        if raw:
            sock.sendall(raw)
        return read_to_close(sock)


def read_to_close(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            pytest.fail(f"the server kept the connection open after {out[:200]!r}")
        except ConnectionResetError:
            return out
        if not piece:
            return out
        out += piece


def json_error(reply: bytes, status: int) -> dict[str, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), reply[:300]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json"
    error: dict[str, str] = json.loads(body)["error"]
    assert error["request_id"] and headers["x-kvgw-request-id"] == error["request_id"]
    return error


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        data_dir=tmp_path_factory.mktemp("slow") / "data",
        env={"KVGW_HEADER_TIMEOUT": "1", "KVGW_BODY_IDLE_TIMEOUT": "1", "KVGW_MAX_CONNECTIONS_PER_CLIENT": "8"},
    ).start()
    yield server
    server.stop()


MALFORMED = {
    "control byte in the path": b"GET /v1/\x01x HTTP/1.1\r\nHost: a\r\n\r\n",
    "space in the path": b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
    "Content-Length -1": PUT_HEAD + b"Content-Length: -1\r\n\r\n",
    "Content-Length 10^23": PUT_HEAD + b"Content-Length: 100000000000000000000000\r\n\r\n",
    "Content-Length abc": PUT_HEAD + b"Content-Length: abc\r\n\r\n",
    "Content-Length twice": PUT_HEAD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "Content-Length with chunked": (
        PUT_HEAD + b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n"
    ),
    "broken chunked body": PUT_HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\nzz\r\nabc\r\n",
    "garbage request line": b"HELLO THERE\r\n\r\n",
    "HTTP/9.9": b"GET /healthz HTTP/9.9\r\nHost: a\r\n\r\n",
    "binary garbage": bytes(range(256)),
}


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
def test_parser_rejections_are_json_errors(guarded: ServerProcess, raw: bytes) -> None:
    error = json_error(exchange(guarded, raw), 400)
    assert error["code"] == "InvalidRequest" and "could not be parsed" in error["message"]


S3_HEAD = (b"PUT /kvcache/obj HTTP/1.1\r\nHost: a\r\nx-amz-date: 20261128T000000Z\r\n"
           b"x-amz-content-sha256: UNSIGNED-PAYLOAD\r\n")
S3_MALFORMED = {
    "Content-Length abc": S3_HEAD + b"Content-Length: abc\r\n\r\n",
    "broken chunked body": S3_HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\nzz\r\nabc\r\n",
    "presigned URL, Content-Length abc": (b"PUT /kvcache/o?X-Amz-Signature=ab HTTP/1.1\r\nHost: a\r\n"
                                          b"Content-Length: abc\r\n\r\n"),
}


@pytest.mark.parametrize("raw", list(S3_MALFORMED.values()), ids=list(S3_MALFORMED))
def test_parser_rejections_of_s3_requests_are_s3_xml_errors(guarded: ServerProcess, raw: bytes) -> None:
    """An S3 SDK parses S3's ``<Error>``, not kvgw's JSON: what carries SigV4's marks is answered so."""
    head, _, body = exchange(guarded, raw).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert lines[0].startswith("HTTP/1.1 400 ") and headers["content-type"] == "application/xml"
    assert b"<Code>InvalidRequest</Code>" in body and b"could not be parsed" in body
    request_id = headers["x-amz-request-id"]
    assert f"<RequestId>{request_id}</RequestId>".encode() in body


def test_broken_chunked_body_stores_nothing(guarded: ServerProcess) -> None:
    key = "broken-chunked"
    raw = MALFORMED["broken chunked body"].replace(b"/chunks/k ", f"/chunks/{key} ".encode())
    json_error(exchange(guarded, raw), 400)
    assert httpx.head(guarded.chunk_url(key), headers=guarded.auth).status_code == 404


def test_a_64_kib_url_is_414(guarded: ServerProcess) -> None:
    error = json_error(exchange(guarded, b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: a\r\n\r\n"), 414)
    assert error["code"] == "URITooLong"


def test_extra_bytes_after_a_body_end_the_connection_after_its_answer(guarded: ServerProcess) -> None:
    reply = exchange(guarded, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n\x00\x01garbage\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b"HTTP/1.1") == 1


def test_a_slow_request_head_gets_408_and_is_closed(guarded: ServerProcess) -> None:
    error = json_error(exchange(guarded, b"GET /heal"), 408)
    assert error["code"] == "RequestTimeout"


def test_a_connection_that_sends_nothing_is_closed(guarded: ServerProcess) -> None:
    assert exchange(guarded, b"") == b""


def test_a_slow_head_on_a_kept_alive_connection_gets_408(guarded: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        first = b""
        while b'"status":"ok"' not in first:
            first += sock.recv(65536)
        sock.sendall(b"GET /heal")
        assert json_error(read_to_close(sock), 408)["code"] == "RequestTimeout"


def test_a_stalled_body_is_answered_and_closed(guarded: ServerProcess) -> None:
    raw = PUT_HEAD.replace(b"/chunks/k ", b"/chunks/stalled ") + b"Content-Length: 100\r\n\r\nabc"
    error = json_error(exchange(guarded, raw), 400)
    assert error["code"] == "IncompleteBody"
    assert httpx.head(guarded.chunk_url("stalled"), headers=guarded.auth).status_code == 404


def test_connections_per_client_are_capped(guarded: ServerProcess) -> None:
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(("127.0.0.1", guarded.port), timeout=WAIT,
                                                              source_address=("127.0.0.3", 0)))
                for _ in range(8)]
        for sock in held:  # each counted once it is accepted: one round trip on each proves it
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        error = json_error(exchange(guarded, b"", source="127.0.0.3"), 503)
        assert error["code"] == "ServiceUnavailable" and "127.0.0.3" in error["message"]
        # another client address is not affected
        assert exchange(guarded, b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                        source="127.0.0.4").startswith(b"HTTP/1.1 200 ")
    # once they are closed, the address may connect again
    deadline = time.monotonic() + WAIT
    while True:
        reply = exchange(guarded, b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                         source="127.0.0.3")
        if reply.startswith(b"HTTP/1.1 200 ") or time.monotonic() > deadline:
            break
    assert reply.startswith(b"HTTP/1.1 200 ")


def test_total_connections_are_capped(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_MAX_CONNECTIONS": "4"}).start()
    with contextlib.ExitStack() as stack:
        for i in range(4):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=WAIT,
                                                                 source_address=(f"127.0.0.{10 + i}", 0)))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        error = json_error(exchange(server, b"", source="127.0.0.20"), 503)
        assert error["code"] == "ServiceUnavailable"


@pytest.mark.slow
def test_normal_requests_work_while_a_thousand_stalled_connections_are_open(
    server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_HEADER_TIMEOUT": "600",
                                                          "KVGW_BODY_IDLE_TIMEOUT": "600"}).start()
    with contextlib.ExitStack() as stack:
        for i in range(1000):
            source = f"127.0.1.{1 + i % 50}"  # 20 per address: under the default per-client cap
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=WAIT,
                                                                 source_address=(source, 0)))
            # half send a partial request line, half a PUT whose body stalls
            sock.sendall(b"GET /v1/buck" if i % 2 else PUT_HEAD + b"Content-Length: 1000\r\n\r\nabc")
        with httpx.Client(base_url=server.url, headers=server.auth, timeout=WAIT) as client:
            for n in range(20):
                key = f"while-stalled-{n}"
                assert client.put(server.chunk_url(key), content=b"x" * 1000).status_code == 201
                assert client.get(server.chunk_url(key)).content == b"x" * 1000
                exists = client.post("/v1/buckets/kvcache/exists", json={"keys": [key, "absent"]}).json()
                assert exists == {"exists": [True, False]}
            stats = client.get("/v1/admin/stats")
            assert stats.status_code == 200
