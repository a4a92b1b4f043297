"""kvgw's HTTP server (gateway.dataplane) as clients see it, on a real ``kvgw serve``: a graceful stop
lets the request in flight finish and stores it whole; requests pipelined behind zero-copy answers
come back in order; bodies without a length; HTTP/1.0; HEAD answers carry the object's length and no
body; every answer carries a request id."""

from __future__ import annotations

import os
import signal
import socket

import httpx

from kvgw_client import wire
from tests.conftest import ServerProcess, wait_for

MiB = 1 << 20


def read_response(sock: socket.socket, buffer: bytearray, *, head_only: bool = False) -> tuple[int, dict[str, str],
                                                                                            bytes]:
    """One response from ``sock`` (``buffer`` keeps what arrived beyond it): status, headers, body
    (by content-length, or chunked)."""
    while b"\r\n\r\n" not in buffer:
        piece = sock.recv(1 << 20)
        assert piece, "closed before a response head"
        buffer += piece
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    buffer[:] = rest
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    status = int(lines[0].split()[1])
    if head_only or status in (100, 204, 304):
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            while b"\r\n" not in buffer:
                buffer += sock.recv(1 << 20)
            size_line, _, rest = bytes(buffer).partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += sock.recv(1 << 20)
            body += rest[:size]
            buffer[:] = rest[size + 2:]
            if size == 0:
                return status, headers, bytes(body)
    length = int(headers.get("content-length", "0"))
    while len(buffer) < length:
        piece = sock.recv(1 << 20)
        assert piece, "closed before the body's end"
        buffer += piece
    body = bytes(buffer[:length])
    del buffer[:length]
    return status, headers, body


def test_a_graceful_stop_finishes_the_put_in_flight_and_exits_0(server: ServerProcess) -> None:
    data = os.urandom(4 * MiB)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = (f"PUT /v1/buckets/kvcache/chunks/in-flight HTTP/1.1\r\nHost: k\r\n"
                f"Authorization: {server.auth['Authorization']}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        sock.sendall(head + data[: MiB])
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(server.port), "the stopping gateway to stop accepting connections")
        sock.sendall(data[MiB:])
        status, headers, _ = read_response(sock, bytearray())
        assert status == 201 and headers["connection"] == "close"
    assert server.proc.wait(30) == 0
    server.start()
    assert httpx.get(server.chunk_url("in-flight"), headers=server.auth).content == data


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_pipelined_requests_behind_zero_copy_answers_come_back_in_order(client: httpx.Client,
                                                                       server: ServerProcess) -> None:
    blobs = {f"p{i}": os.urandom(3 * MiB + i) for i in range(3)}
    for key, value in blobs.items():
        assert client.put(server.chunk_url(key), content=value).status_code == 201
    auth = server.auth["Authorization"]
    requests = b"".join(
        f"GET /v1/buckets/kvcache/chunks/{key} HTTP/1.1\r\nHost: k\r\nAuthorization: {auth}\r\n"
        f"{wire.H_VERIFY}: {wire.VERIFY_XXH3}\r\n\r\n".encode() for key in blobs)
    body = b'{"keys":["p0"]}'
    requests += (f"POST /v1/buckets/kvcache/exists HTTP/1.1\r\nHost: k\r\nAuthorization: {auth}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(requests)  # all four at once: answered one after the other, in order
        buffer = bytearray()
        for key, value in blobs.items():
            status, headers, got = read_response(sock, buffer)
            assert (status, got) == (200, value), key
            assert headers["x-kvgw-request-id"]
        status, _, got = read_response(sock, buffer)
        assert (status, got) == (200, b'{"exists":[true]}')


def test_bodies_without_a_length_http_1_0_and_head(client: httpx.Client, server: ServerProcess) -> None:
    data = os.urandom(100_000)
    chunked = client.put(server.chunk_url("chunked"), content=iter([data[:40_000], data[40_000:]]))
    assert chunked.status_code == 411  # the native API wants a length, and says so
    assert chunked.json()["error"]["code"] == "MissingContentLength"
    assert client.put(server.chunk_url("sized"), content=data).status_code == 201

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"GET /v1/buckets/kvcache/chunks/sized HTTP/1.0\r\nAuthorization: "
                     f"{server.auth['Authorization']}\r\n\r\n".encode())
        buffer = bytearray()
        status, headers, got = read_response(sock, buffer)
        assert (status, got) == (200, data) and headers["connection"] == "close"
        assert sock.recv(1) == b""  # HTTP/1.0 without keep-alive: closed after the answer

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"HEAD /v1/buckets/kvcache/chunks/sized HTTP/1.1\r\nHost: k\r\nAuthorization: "
                     f"{server.auth['Authorization']}\r\n\r\nGET /healthz HTTP/1.1\r\nHost: k\r\n\r\n".encode())
        buffer = bytearray()
        status, headers, _ = read_response(sock, buffer, head_only=True)
        assert status == 200 and headers["content-length"] == str(len(data))
        status, headers, got = read_response(sock, buffer)  # the HEAD sent no body: the next answer follows
        assert status == 200 and b'"status":"ok"' in got and headers["x-kvgw-request-id"]
