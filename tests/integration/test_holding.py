"""Responses as kvgw's HTTP server writes them (gateway.dataplane.cycle): a small answer leaves in one
write, a batch-get of large chunks is valid chunked HTTP; on a real socket and a real gateway."""

from __future__ import annotations

import json
import os
import socket
import struct

import httpx

from gateway.dataplane.cycle import LARGE_BODY
from kvgw_client import wire
from tests.conftest import ServerProcess


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
    """Large chunked body pieces go out beside their framing (and, from a client that verifies, from
    the file by sendfile), small ones joined to it: the stream still parses as chunked HTTP and as a
    batch stream, on a connection that is then reused."""
    payloads = {"large-a": os.urandom(LARGE_BODY * 64 + 3), "small": b"s" * 100,
                "large-b": os.urandom(LARGE_BODY * 4)}
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
