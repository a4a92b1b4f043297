"""The PUT sink (``gateway.bench.baselines.serve_put_sink``), the floor ``kvgw bench io`` measures kvgw's
PUTs against: it must store exactly the bytes it was sent, one file per PUT, whatever the body's size
and however the requests share a connection; a floor that dropped bytes would flatter itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gateway.bench.baselines import WRITE_PIECE, PutSink
from gateway.bench.loadgen import LoadRequest, run_load


@pytest.mark.parametrize("fsync", [True, False])
def test_stores_every_body_whole(tmp_path: Path, fsync: bool) -> None:
    sink = PutSink(tmp_path, tmp_path / "sink", fsync=fsync).start()
    try:
        bodies = [os.urandom(n) for n in (1, WRITE_PIECE - 1, WRITE_PIECE, 3 * WRITE_PIECE + 12345)]
        done = run_load(sink.address, lambda i, seq: LoadRequest("PUT", f"/sink/{seq}", body=bodies[seq],
                                                                 expect=(201,)), 1, count=len(bodies))
        assert done.errors == 0, done.error_samples
        stored = sorted(p.read_bytes() for p in (tmp_path / "sink" / "final").iterdir())
        assert stored == sorted(bodies)
        assert not list((tmp_path / "sink" / "staging").iterdir())
        sink.clear()
        assert not list((tmp_path / "sink" / "final").iterdir())
    finally:
        sink.stop()


def test_pipelined_puts_on_one_connection(tmp_path: Path) -> None:
    sink = PutSink(tmp_path, tmp_path / "sink", fsync=False).start()
    try:
        first, second = os.urandom(WRITE_PIECE + 7), os.urandom(5)
        wire = b"".join(b"PUT /sink HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
                        for b in (first, second))
        with socket.create_connection(sink.address, timeout=10) as conn:
            conn.sendall(wire)
            answers = b""
            while answers.count(b"201 Created") < 2:
                chunk = conn.recv(4096)
                assert chunk, f"connection closed after {answers!r}"
                answers += chunk
        assert sorted(p.read_bytes() for p in (tmp_path / "sink" / "final").iterdir()) == sorted([first, second])
    finally:
        sink.stop()


def test_delete_removes_what_the_connection_stored_last(tmp_path: Path) -> None:
    """PUT+DELETE pairs (``kvgw bench io``'s recycling PUT cells) leave nothing behind, and each DELETE
    removes its own connection's file, not another client's."""
    sink = PutSink(tmp_path, tmp_path / "sink", fsync=False).start()
    try:
        body = os.urandom(WRITE_PIECE + 3)
        put = LoadRequest("PUT", "/sink", body=body, expect=(201,))
        delete = LoadRequest("DELETE", "/sink", expect=(204,))
        done = run_load(sink.address, lambda i, seq: put, 3, count=12, then=lambda i, seq: delete)
        assert (done.ops, done.errors) == (12, 0), done.error_samples
        assert done.statuses == {201: 12, 204: 12}
        assert not list((tmp_path / "sink" / "final").iterdir())
        kept = run_load(sink.address, lambda i, seq: put, 2, count=2)
        assert kept.errors == 0
        assert [p.read_bytes() for p in (tmp_path / "sink" / "final").iterdir()] == [body, body]
    finally:
        sink.stop()
