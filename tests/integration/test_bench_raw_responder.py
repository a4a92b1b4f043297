"""The raw-socket responder ``kvgw bench io`` measures lookups against (issue 14): it answers each
request on a keep-alive connection, bodies and pipelined requests included, with the canned bytes of
the first path part its request line holds."""

from __future__ import annotations

import socket
from pathlib import Path

from gateway.bench.baselines import RawResponder
from gateway.bench.loadgen import LoadRequest, run_load


def test_the_raw_responder_answers_each_request_with_its_canned_body(tmp_path: Path) -> None:
    responder = RawResponder(tmp_path, {"/exists": b'{"exists":[true]}', "/prefix": b'{"length":1}'}).start()
    try:
        body = b'{"keys": ["a"]}'
        request = b"POST /v1/buckets/b/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
        with socket.create_connection(responder.address, timeout=10) as conn:
            # two requests in one write, the second split across two: both answered, in order
            second = request % (b"prefix", len(body), body)
            conn.sendall(request % (b"exists", len(body), body) + second[:20])
            conn.sendall(second[20:])
            got = b""
            while got.count(b"HTTP/1.1 200 OK") < 2 or not got.endswith(b'{"length":1}'):
                chunk = conn.recv(65536)
                assert chunk, got
                got += chunk
        first, rest = got.split(b"HTTP/1.1 200 OK", 2)[1:]
        assert first.endswith(b'{"exists":[true]}') and b"content-length: 17" in first
        assert rest.endswith(b'{"length":1}')
    finally:
        responder.stop()


def test_a_stream_answer_is_that_many_bytes_on_the_same_connection(tmp_path: Path) -> None:
    """``--stream``: the raw socket stream ``kvgw bench io`` measures batch-get against (issue 14, item 2)."""
    size = 3 * (1 << 20) + 7
    responder = RawResponder(tmp_path, {"/exists": b'{"exists":[true]}'}, {"/batch-get": size}).start()
    try:
        req = LoadRequest("POST", "/v1/buckets/b/batch-get", body=b'{"keys": ["a"]}')
        stats = run_load(responder.address, lambda i, seq: req, 1, count=3, body_buffer_bytes=size)
        assert (stats.errors, stats.ops, stats.connects) == (0, 3, 1)
        assert stats.bytes == 3 * (req.body_length + size)
    finally:
        responder.stop()
