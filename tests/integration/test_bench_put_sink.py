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
from tests.pagecache import cached_pages


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


def test_direct_sink_stores_every_body_around_the_page_cache(tmp_path: Path) -> None:
    """``direct`` (``kvgw bench io --direct-writes``): bodies land in page-aligned memory and their whole
    pieces go to the disk with O_DIRECT, as kvgw's direct writes do; the files hold exactly what was sent
    and (but for a partial last piece) no page-cache pages."""
    sink = PutSink(tmp_path, tmp_path / "sink", fsync=True, direct=True).start()
    try:
        whole, tail = os.urandom(4 * WRITE_PIECE), os.urandom(WRITE_PIECE + 5)
        done = run_load(sink.address, lambda i, seq: LoadRequest("PUT", f"/sink/{seq}", body=(whole, tail)[seq],
                                                                 expect=(201,)), 1, count=2)
        assert done.errors == 0, done.error_samples
        files = list((tmp_path / "sink" / "final").iterdir())
        assert sorted(cached_pages(str(p))[0] for p in files) == [0, 1]  # the 5-byte tail's page at most
        assert sorted(p.read_bytes() for p in files) == sorted([whole, tail])
    finally:
        sink.stop()


def test_receive_only_sink_takes_every_body_and_answers_deletes(tmp_path: Path) -> None:
    """The receive-only sink (issue 31's PUT floor) reads each body to its last byte, also when it ends
    a few bytes into a piece (its waits for 512 KiB at a time must never outlast the body), and answers
    the DELETE of a PUT+DELETE pair with 204, storing nothing."""
    sink = PutSink(tmp_path, None, fsync=False).start()
    try:
        bodies = [os.urandom(n) for n in (1, 3 * WRITE_PIECE + 3392, 4 * WRITE_PIECE, 600 << 10)]
        done = run_load(sink.address, lambda i, seq: LoadRequest("PUT", "/sink", body=bodies[seq % 4], expect=(201,)),
                        4, count=40, then=lambda i, seq: LoadRequest("DELETE", "/sink", expect=(204,)))
        assert (done.ops, done.errors) == (40, 0), done.error_samples
        assert done.statuses == {201: 40, 204: 40}
        assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".out")]
    finally:
        sink.stop()
