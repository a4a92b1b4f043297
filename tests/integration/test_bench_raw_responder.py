"""The raw-socket responder ``kvgw bench io`` measures lookups against (issue 14): it answers each
request on a keep-alive connection, bodies and pipelined requests included, with the canned bytes of
the first path part its request line holds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from gateway.bench.baselines import RawResponder, files_batch_request, files_target
from gateway.bench.loadgen import LoadRequest, ProtocolError, request_once, run_load
from kvgw_client import wire


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


def test_the_verified_sender_serves_files_and_batches_and_refuses_changed_bytes(tmp_path: Path) -> None:
    """``--files``: the verified sender ``kvgw bench io`` measures GET and batch-get against: a file's
    bytes, a folder as a batch-get kvgw's own client parses (checksums included), and no answer once a
    file's bytes differ from what its first read found."""
    root = tmp_path / "www"
    (root / "batch").mkdir(parents=True)
    payloads = [random.Random(i).randbytes(300_000 if i else 3) for i in range(3)]
    for i, payload in enumerate(payloads):
        (root / "batch" / f"obj{i:03d}").write_bytes(payload)
    responder = RawResponder(tmp_path, {"/exists": b'{"exists":[true]}'}, files=root).start()
    try:
        status, body = request_once(responder.address, LoadRequest("GET", files_target("batch/obj001")))
        assert (status, body) == (200, payloads[1])
        status, body = request_once(responder.address, files_batch_request("batch", b'{"keys": ["a"]}'))
        parser = wire.BatchParser()
        frames = list(parser.feed(body))
        assert status == 200 and parser.complete
        assert [bytes(f.payload) for f in frames] == payloads
        (root / "batch" / "obj001").write_bytes(payloads[2])  # same name, other bytes: no answer
        with pytest.raises(ProtocolError, match="closed"):
            request_once(responder.address, LoadRequest("GET", files_target("batch/obj001")), timeout=5)
    finally:
        responder.stop()
