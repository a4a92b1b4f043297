"""Small responses leave in one write (gateway.api.holding): on a real socket and a real gateway."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time

import httpx

from gateway.api.holding import COPY_FREE_BYTES, HOLD_LIMIT, HoldingTransport
from kvgw_client import wire
from tests.conftest import ServerProcess


def received(sock: socket.socket, want: int, timeout: float = 5.0) -> bytes:
    """Read until ``want`` bytes arrived (the socket is non-blocking)."""
    data = b""
    deadline = time.monotonic() + timeout
    while len(data) < want and time.monotonic() < deadline:
        try:
            data += sock.recv(1 << 20)
        except BlockingIOError:
            time.sleep(0.001)
    return data


def nothing_sent(sock: socket.socket) -> bool:
    try:
        sock.recv(1 << 20)
    except BlockingIOError:
        return True
    return False


async def test_small_writes_are_held_until_flushed_large_ones_go_at_once() -> None:
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    holding = HoldingTransport(transport, loop)
    try:
        holding.write(b"HTTP/1.1 200 OK\r\n\r\n")
        holding.write(b'{"exists":[true]}')
        assert nothing_sent(peer) and holding.get_write_buffer_size() == 36
        holding.flush()  # the response is complete
        assert received(peer, 36) == b'HTTP/1.1 200 OK\r\n\r\n{"exists":[true]}'

        big = b"x" * (HOLD_LIMIT + 1)
        holding.write(b"frame")
        holding.write(big)  # passes the limit: sent now, behind what was held
        assert received(peer, 5 + len(big)) == b"frame" + big

        holding.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # outside a response: waits one loop turn at most
        assert nothing_sent(peer)
        await asyncio.sleep(0)
        assert received(peer, 25) == b"HTTP/1.1 100 Continue\r\n\r\n"

        holding.write(b"last")
        holding.close()  # flushes before closing
        assert received(peer, 4) == b"last"
    finally:
        peer.close()
        transport.close()


def data_segments_in(sock: socket.socket) -> int:
    """``tcpi_data_segs_in`` of Linux's ``struct tcp_info`` (since 4.6): TCP segments that carried data."""
    return int(struct.unpack_from("<I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 152)[0])


def test_a_gateway_json_answer_is_one_tcp_segment(server: ServerProcess) -> None:
    """Head and body of an exists answer leave in one write: one segment per answer, not two."""
    keys = [f"one-write-{i}" for i in range(64)]
    with httpx.Client(base_url=server.url, headers=server.auth) as client:
        for key in keys[:3]:
            assert client.put(server.chunk_url(key), content=b"v").status_code == 201
    body = json.dumps({"keys": keys}).encode()
    request = (f"POST /v1/buckets/kvcache/exists HTTP/1.1\r\nHost: x\r\n"
               f"Authorization: {server.auth['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    answer = json.dumps({"exists": [True] * 3 + [False] * 61}, separators=(",", ":")).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        before = data_segments_in(sock)
        for _ in range(20):
            sock.sendall(request + body)
            response = b""
            while not response.endswith(answer):
                piece = sock.recv(1 << 16)
                assert piece, "connection closed"
                response += piece
            assert response.startswith(b"HTTP/1.1 200")
        assert data_segments_in(sock) - before == 20


def test_a_batch_get_of_large_chunks_is_valid_chunked_http(server: ServerProcess) -> None:
    """Large chunked body pieces are framed by ``chunked_without_copy``, small ones by uvicorn: the
    stream still parses as chunked HTTP and as a batch stream, on a connection that is then reused."""
    payloads = {"large-a": os.urandom(COPY_FREE_BYTES * 4 + 3), "small": b"s" * 100,
                "large-b": os.urandom(COPY_FREE_BYTES)}
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30.0) as client:
        for key, data in payloads.items():
            assert client.put(server.chunk_url(key), content=data).status_code == 201
        keys = [*payloads, "never-stored"]
        for _ in range(2):  # keep-alive: the second call reuses the connection
            with client.stream("POST", "/v1/buckets/kvcache/batch-get", json={"keys": keys}) as r:
                assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
                parser = wire.BatchParser()
                frames = [f for piece in r.iter_bytes() for f in parser.feed(piece)]
            assert parser.complete
            assert [f.payload for f in frames[:3]] == list(payloads.values())
            assert frames[3].status == wire.FRAME_MISSING
