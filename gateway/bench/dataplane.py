"""``kvgw bench dataplane``: which HTTP data plane serves kvgw's hot calls best (issue 31, item 1).

Three minimal servers do the same work from the same LMDB index (kvgw's record format, read as
``baselines.IndexedLookups`` reads it: ``digest_many``, ``alive_in``) and the same chunk files, and answer
the same calls from the same load generator (``gateway.bench.loadgen``), in alternating rounds:

- ``uvicorn+ASGI``: uvicorn's stock httptools protocol (``http="httptools"``, uvloop) running a raw ASGI
  app: the ordinary path (no lookup lane, no body intake, no kvgw subclass). GET bodies: the chunk file
  mapped and sent as one body message;
- ``own protocol``: ``DataPlaneProtocol``, an ``asyncio.BufferedProtocol`` on uvloop driving httptools'
  public ``HttpRequestParser`` and answering every call inside the protocol (no task, no ASGI scope or
  messages); GET bodies go out with ``os.sendfile`` from the chunk file (uvloop has no ``loop.sendfile``:
  it raises ``NotImplementedError`` for its transports, so the protocol sends on a duplicate of the
  socket's descriptor while the transport's buffer is empty, and waits for writability on it); a large
  PUT body is read by the event loop straight into one reused 2 MiB buffer of the connection's (the
  parser sees only the bytes that came with the head). The same server also answers GET by writing the
  mapped file to its transport (``own protocol, mmap``: GET cells only, to weigh ``sendfile`` against it
  on the same protocol), and receives a large PUT body in a worker thread that reads the socket itself
  (woken per 512 KiB by ``SO_RCVLOWAT``) and writes each piece, as kvgw's threaded receives do (``own
  protocol, thread``: PUT cells only). A compact prototype for this bench, not production code: no authentication,
  error bodies, deadlines or metrics;
- ``granian RSGI``: granian (a Rust HTTP server; its Python side on uvloop) running an RSGI app:
  ``await protocol()`` for a small body, ``async for chunk in protocol`` for a large one,
  ``response_file`` for GET bodies (sent by granian's Rust side), ``response_bytes`` /
  ``response_empty`` for the rest; one worker, granian's defaults otherwise. Skipped with one line when
  granian is not installed (``pip install -e ".[bench]"``).

The baselines, in the same rounds: **nginx** (``sendfile``; ``baselines.Nginx``, as ``kvgw bench io``
runs it) serving the same files for GET; the **raw-socket responder** of ``kvgw bench floor`` answering
``exists`` from the same index (a HEAD with canned bytes) for the lookups; the **PUT sink** without fsync
(``baselines.serve_put_sink``: a thread per connection, ``recv_into`` one buffer, the same temp file and
link) for a PUT into a file; its **receive-only** variant (``--receive-only``: each body received into one
reused buffer and dropped) for the PUT sink call.

Calls: ``HEAD`` of one chunk (one index read), ``exists`` of 64 keys (JSON in, 64 index reads, JSON out),
``GET`` of an 8 MiB chunk (page cache warm), ``PUT file``: 8 MiB into a file (temp file + link, fsync
off), each followed by a DELETE of it on the same connection and timed with it (as ``kvgw bench io``
recycles page-cache pages), ``PUT sink``: 8 MiB received into a reused buffer and dropped; at 1 and 8
clients (each a process with one keep-alive connection). Per cell: p50 latency, throughput, and the
server's CPU (every process and thread of it, from /proc) per call or per GiB; each as a ratio to the
call's baseline in the same round, the median of the per-round ratios. Medians of ``--rounds`` rounds,
the servers of a cell in reversed order every other round.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import itertools
import json
import mmap
import os
import platform
import select
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gateway.bench import procstat
from gateway.bench.baselines import (
    BaselineProcess,
    IndexedLookups,
    Nginx,
    PutSink,
    RawResponder,
    StagedFile,
    find_nginx,
)
from gateway.bench.floor import exists_body, lookup_keys
from gateway.bench.io import BUCKET, chunk_target, lookup_answers
from gateway.bench.loadgen import Address, LoadRequest, MakeRequest, Stats, request_once, run_load

MiB = 1 << 20
GiB = 1 << 30

UVICORN = "uvicorn+ASGI"
PROTOCOL = "own protocol"
GRANIAN = "granian RSGI"
PROTOCOL_MAPPED = "own protocol, mmap"  # the same server answering GET by writing a mapping, not sendfile
PROTOCOL_THREADED = "own protocol, thread"  # the same server receiving large PUT bodies in a worker thread
CANDIDATES = (UVICORN, PROTOCOL, PROTOCOL_MAPPED, PROTOCOL_THREADED, GRANIAN)
MAPPED_PART = b"/mapped/"  # GET .../mapped/<key>: the own protocol writes the mapped file (PROTOCOL_MAPPED)
THREADED_PART = b"/threaded/"  # PUT .../threaded/...: the own protocol receives in a thread (PROTOCOL_THREADED)
KINDS = {UVICORN: "uvicorn", PROTOCOL: "protocol", GRANIAN: "granian"}  # --serve KIND
NGINX = "nginx sendfile"
FLOOR = "raw-socket floor"
PUT_SINK = "PUT sink (file)"
RECEIVE_SINK = "receive-only sink"

HEAD = "HEAD"
EXISTS = "exists 64"
GET = "GET"
PUT_FILE = "PUT file"
PUT_SINK_CALL = "PUT sink"
CALLS = {"head": HEAD, "exists": EXISTS, "get": GET, "put": PUT_FILE, "sink": PUT_SINK_CALL}
BASELINE = {HEAD: FLOOR, EXISTS: FLOOR, GET: NGINX, PUT_FILE: PUT_SINK, PUT_SINK_CALL: RECEIVE_SINK}
BULK = (GET, PUT_FILE, PUT_SINK_CALL)  # throughput in MB/s and CPU per GiB; the rest per call
VARIANTS = {PROTOCOL_MAPPED: (GET,), PROTOCOL_THREADED: (PUT_FILE, PUT_SINK_CALL)}  # the own protocol's, by call

SINK_PATH = "/sink"
PROBE_PATH = "/probe"
INTAKE_MIN_BYTES = 1 << 20  # PUT bodies from this size on: received straight into the connection's buffer
PIECE_BYTES = 2 * MiB  # that buffer: the filesystem tier's write unit
READ_BYTES = 256 * 1024  # the protocol's read buffer for heads and small bodies
DATA_ENV = "KVGW_DATAPLANE_DATA"  # the data directory, for the granian worker (it imports rsgi_app)


# -- the data every server reads ---------------------------------------------------------------------

def get_keys(objects: int) -> list[str]:
    return [f"dataplane-get-{i:03d}" for i in range(objects)]


def prepare(data: Path, objects: int, size: int) -> None:
    """The LMDB index (kvgw's record format: database ``chunks``, and ``expiry`` empty) holding the 64
    lookup keys of ``kvgw bench floor`` and ``objects`` chunks of ``size`` random bytes, stored as files
    named by their digest under ``data/files`` (nginx's root); a ``probe`` file there too."""
    import lmdb
    import xxhash

    from backends.index import IndexEntry
    from kvgw_client.keys import digest_many

    files = data / "files"
    files.mkdir(parents=True, exist_ok=True)
    (files / PROBE_PATH.strip("/")).write_bytes(b"ok")
    env = lmdb.open(str(data / "index"), map_size=1 << 30, max_dbs=16)
    chunks = env.open_db(b"chunks")
    env.open_db(b"expiry")  # the index's expiry order (``alive_in`` reads it): empty, nothing here expires
    payload = bytearray(os.urandom(size))
    with env.begin(write=True, db=chunks) as txn:
        for key, digest in zip(lookup_keys(), digest_many(BUCKET, lookup_keys()), strict=True):
            txn.put(digest, IndexEntry(BUCKET, key, 4096, 0, 1.0).pack())
        for i, (key, digest) in enumerate(zip(get_keys(objects), digest_many(BUCKET, get_keys(objects)), strict=True)):
            payload[:8] = i.to_bytes(8, "little")
            (files / digest.hex()).write_bytes(payload)
            txn.put(digest, IndexEntry(BUCKET, key, size, xxhash.xxh3_64_intdigest(payload), 1.0).pack())
    env.close()


class Store(IndexedLookups):
    """What every server answers from: ``exists_json`` (the floor's own code), ``stat`` of one key (one
    index read: the chunk's file, size and checksum)."""

    def __init__(self, data: Path) -> None:
        super().__init__(data / "index", BUCKET)
        self.files = str(data / "files")

    def stat(self, key: str) -> tuple[str, int, str] | None:
        """(file path, size, etag) of ``key``, or None."""
        from backends.index import RECORD
        from kvgw_client.keys import chunk_digest

        digest = chunk_digest(BUCKET, key)
        with self._env.begin(db=self._chunks) as txn:
            raw = txn.get(digest)
            if raw is None:
                return None
            size, checksum = RECORD.unpack_from(raw)[:2]
        return f"{self.files}/{digest.hex()}", size, f'"{checksum:016x}"'


class Puts:
    """PUT bodies stored as the PUT sink stores them (``StagedFile``, fsync off) under ``data/puts/KIND``;
    a DELETE removes the file its connection stored last (``kvgw bench io``'s PUT + DELETE pairs)."""

    def __init__(self, data: Path, kind: str) -> None:
        self.staging, self.final = data / "puts" / kind / "staging", data / "puts" / kind / "final"
        for folder in (self.staging, self.final):
            folder.mkdir(parents=True, exist_ok=True)
        self._names = itertools.count()
        self._last: dict[str, str] = {}  # connection -> the file it stored last

    def stage(self) -> StagedFile:
        return StagedFile(str(self.staging), str(self.final), f"{os.getpid()}-{next(self._names)}", fsync=False)

    def stored(self, connection: str, path: str) -> None:
        self._last[connection] = path

    def delete(self, connection: str) -> bool:
        path = self._last.pop(connection, None)
        if path is None:
            return False
        os.unlink(path)
        return True

    def forget(self, connection: str) -> None:
        self._last.pop(connection, None)


def key_of(path: str) -> str:
    return path.rsplit("/", 1)[1]


# -- (a) uvicorn's httptools protocol + a raw ASGI app -------------------------------------------------

Scope = dict[str, Any]
Message = dict[str, Any]


def asgi_app(store: Store, puts: Puts) -> Callable[[Scope, Callable[[], Any], Callable[[Message], Any]], Any]:
    """The calls as a plain ASGI app answers them (uvicorn's request cycle, a task per request)."""
    json_headers = [(b"content-type", b"application/json")]

    async def respond(send: Callable[[Message], Any], status: int, headers: list[tuple[bytes, bytes]],
                      body: bytes | memoryview = b"") -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        connection = "{}:{}".format(*scope["client"])
        if method == "PUT":
            staged = None if path == SINK_PATH else puts.stage()
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if staged is not None:
                        staged.abort()
                    return
                if staged is not None and message["body"]:
                    staged.write(message["body"])
                more = message.get("more_body", False)
            if staged is not None:
                puts.stored(connection, staged.finish())
            await respond(send, 201, [(b"content-length", b"0")])
            return
        body = b""
        if method == "POST":
            parts, more = [], True
            while more:
                message = await receive()
                parts.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"".join(parts)
        if method == "POST" and path.endswith("/exists"):
            answer = store.exists_json(body)
            await respond(send, 200, [*json_headers, (b"content-length", b"%d" % len(answer))], answer)
        elif method in ("HEAD", "GET") and path != PROBE_PATH:
            found = store.stat(key_of(path))
            if found is None:
                await respond(send, 404, [(b"content-length", b"0")])
                return
            file, size, etag = found
            headers = [(b"content-length", b"%d" % size), (b"etag", etag.encode())]
            if method == "HEAD":
                await respond(send, 200, headers)
                return
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)  # as kvgw's tier maps a chunk (on the loop: bench code)
            try:
                mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            await respond(send, 200, headers, memoryview(mapped))
        elif method == "DELETE":
            await respond(send, 204 if puts.delete(connection) else 404, [])
        else:
            await respond(send, 200, [(b"content-length", b"2")], b"ok")

    return app


def serve_uvicorn(port: int, data: Path) -> None:
    import uvicorn

    uvicorn.run(asgi_app(Store(data), Puts(data, "uvicorn")), host="127.0.0.1", port=port, loop="uvloop",
                http="httptools", lifespan="off", log_level="warning", access_log=False)


# -- (b) kvgw's own protocol on httptools' public parser -----------------------------------------------

class Intake:
    """A large PUT body received into one reused buffer of ``PIECE_BYTES``: each full piece (and the
    last) written to ``staged``, or dropped (``staged`` None: the sink)."""

    def __init__(self, buffer: memoryview, length: int, staged: StagedFile | None) -> None:
        self.buffer = buffer
        self.length = length
        self.staged = staged
        self.fill = 0  # bytes in the buffer
        self.got = 0  # body bytes so far

    @property
    def left(self) -> int:
        return self.length - self.got

    def window(self) -> memoryview:
        """Where the next read goes: never past the piece or the body."""
        return self.buffer[self.fill : self.fill + min(self.left, self.buffer.nbytes - self.fill)]

    def received(self, n: int) -> None:
        self.fill += n
        self.got += n
        if self.fill == self.buffer.nbytes or not self.left:
            if self.staged is not None:
                self.staged.write(self.buffer[: self.fill])
            self.fill = 0

    def take(self, data: bytes) -> None:
        """Body bytes the parser handed over (those that came with the head): copied in."""
        view = memoryview(data)
        while view:
            part = self.window()[: len(view)]
            part[:] = view[: part.nbytes]
            view = view[part.nbytes :]
            self.received(part.nbytes)


THREAD_WAKE_BYTES = 512 << 10  # a receiving thread sleeps until this much has arrived (SO_RCVLOWAT), as kvgw's
_RECEIVERS = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="dataplane-body")


def receive_rest(sock: socket.socket, intake: Intake) -> None:
    """In a worker thread: the rest of ``intake``'s body read from ``sock`` (non-blocking: polled, woken
    per ``THREAD_WAKE_BYTES`` with ``SO_RCVLOWAT``) into its buffer, each piece written by
    ``intake.received`` in this thread. Raises ConnectionError if the client goes away or stalls 10 s."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    lowat = 1
    try:
        while intake.left:
            window = intake.window()
            wanted = min(THREAD_WAKE_BYTES, window.nbytes)
            if wanted != lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                lowat = wanted
            try:
                got = sock.recv_into(window)
            except BlockingIOError:
                if not poller.poll(10_000):
                    raise ConnectionError("the client stalled mid-body") from None
                continue
            if not got:
                raise ConnectionError("the client went away mid-body")
            intake.received(got)
    finally:
        if lowat != 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # as the event loop had it


@dataclass
class Sending:
    """A GET answer going out: ``head`` by ``send``, then ``[offset, end)`` of ``fd`` by ``os.sendfile``."""

    head: memoryview
    fd: int
    offset: int
    end: int
    waiting: bool = False  # a writability callback is registered


class DataPlaneProtocol(asyncio.BufferedProtocol):
    """One connection of the own-protocol prototype: httptools' public parser fed from the protocol's
    read buffer, each call answered when its message is complete, in the protocol (no task).

    Bench code: requests are answered in order (one pipelined behind a GET still sending waits for it);
    anything malformed closes the connection."""

    def __init__(self, store: Store, puts: Puts, loop: asyncio.AbstractEventLoop) -> None:
        import httptools

        self._httptools = httptools
        self.store = store
        self.puts = puts
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.inview = memoryview(bytearray(READ_BYTES))
        self.piece: memoryview | None = None  # the connection's body buffer, made at its first large PUT
        self.url = b""
        self.length = 0
        self.body: list[bytes] = []
        self.intake: Intake | None = None
        self.direct = False  # the intake reads the socket itself (the parser is bypassed for the body)
        self.threaded = False  # ... in a worker thread (THREADED_PART)
        self.sending: Sending | None = None
        self.queued: list[tuple[bytes, bytes, bytes]] = []
        self.transport: asyncio.Transport | None = None
        self.out: socket.socket | None = None  # a duplicate of the socket: sendfile and writability waits
        self.connection = ""

    # -- asyncio --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport (no subclass of it)
        sock = transport.get_extra_info("socket")
        self.out = socket.socket(fileno=os.dup(sock.fileno()))
        self.connection = "{}:{}".format(*transport.get_extra_info("peername")[:2])

    def connection_lost(self, exc: Exception | None) -> None:
        if self.sending is not None:
            self._end_sending()
        if self.intake is not None and self.intake.staged is not None:
            self.intake.staged.abort()
        self.puts.forget(self.connection)
        if self.out is not None:
            self.out.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.intake.window() if self.direct and self.intake is not None else self.inview

    def buffer_updated(self, nbytes: int) -> None:
        if self.direct and self.intake is not None:
            self.intake.received(nbytes)
            if not self.intake.left:
                self.direct = False
                self.parser = self._httptools.HttpRequestParser(self)  # the old one still expects the body
                self._finish_put()
            return
        try:
            self.parser.feed_data(self.inview[:nbytes])
        except self._httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
            return
        if self.intake is not None:  # a large PUT's body goes on: read it straight into the buffer
            if self.threaded:
                self._receive_in_thread(self.intake)
            else:
                self.direct = True

    def _receive_in_thread(self, intake: Intake) -> None:
        """The rest of the body received and written by a worker thread (``PROTOCOL_THREADED``), reads
        paused meanwhile; the answer goes out from the loop when it is done."""
        assert self.transport is not None and self.out is not None
        self.transport.pause_reading()
        future = _RECEIVERS.submit(receive_rest, self.out, intake)

        def done() -> None:
            self.parser = self._httptools.HttpRequestParser(self)  # the old one still expects the body
            if future.exception() is not None:
                assert self.transport is not None
                self.transport.abort()
                return
            self._finish_put()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

        future.add_done_callback(lambda _: self.loop.call_soon_threadsafe(done))

    def eof_received(self) -> bool | None:
        return None

    # -- httptools' callbacks --

    def on_message_begin(self) -> None:
        self.url = b""
        self.length = 0
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 14 and name.lower() == b"content-length":
            self.length = int(value)

    def on_headers_complete(self) -> None:
        if self.length >= INTAKE_MIN_BYTES and self.parser.get_method() == b"PUT":
            if self.piece is None:
                self.piece = memoryview(bytearray(PIECE_BYTES))
            staged = None if self.url.endswith(SINK_PATH.encode()) else self.puts.stage()
            self.intake = Intake(self.piece, self.length, staged)
            self.threaded = THREADED_PART in self.url

    def on_body(self, body: bytes) -> None:
        if self.intake is not None:
            self.intake.take(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.intake is not None:
            self._finish_put()
            return
        request = (self.parser.get_method(), self.url, b"".join(self.body))
        if self.sending is not None:
            self.queued.append(request)
        else:
            self._answer(*request)

    # -- answers --

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def _finish_put(self) -> None:
        intake, self.intake = self.intake, None
        assert intake is not None
        if intake.staged is not None:
            self.puts.stored(self.connection, intake.staged.finish())
        self._write(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")

    def _answer(self, method: bytes, url: bytes, body: bytes) -> None:
        if method == b"POST" and url.endswith(b"/exists"):
            answer = self.store.exists_json(body)
            self._write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(answer), answer))
        elif method in (b"HEAD", b"GET") and url != PROBE_PATH.encode():
            found = self.store.stat(key_of(url.decode()))
            if found is None:
                self._write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                return
            file, size, etag = found
            head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\netag: %s\r\n\r\n" % (size, etag.encode())
            if method == b"HEAD":
                self._write(head)
            elif MAPPED_PART in url:
                self._write_mapped(head, file, size)
            else:
                self._send_file(head, file, size)
        elif method == b"PUT":  # a small body
            if not url.endswith(SINK_PATH.encode()):
                staged = self.puts.stage()
                staged.write(body)
                self.puts.stored(self.connection, staged.finish())
            self._write(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
        elif method == b"DELETE":
            deleted = self.puts.delete(self.connection)
            self._write(b"HTTP/1.1 204 No Content\r\n\r\n" if deleted else
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        else:
            self._write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    def _write_mapped(self, head: bytes, file: str, size: int) -> None:
        """The file mapped and handed to the transport: uvloop writes what the socket takes at once and
        keeps (a reference to) the rest, sent as the socket drains (``PROTOCOL_MAPPED``)."""
        assert self.transport is not None
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.transport.writelines([head, memoryview(mapped)])

    def _send_file(self, head: bytes, file: str, size: int) -> None:
        assert self.transport is not None
        if self.transport.get_write_buffer_size():  # earlier bytes still queued: keep the order
            self._write_mapped(head, file, size)
            return
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        self.sending = Sending(memoryview(head), fd, 0, size)
        self._pump()

    def _pump(self) -> None:
        sending, out = self.sending, self.out
        assert sending is not None and out is not None and self.transport is not None
        try:
            while sending.head:
                sending.head = sending.head[out.send(sending.head, socket.MSG_MORE) :]
            while sending.offset < sending.end:
                sent = os.sendfile(out.fileno(), sending.fd, sending.offset, sending.end - sending.offset)
                if not sent:
                    raise ConnectionError("sendfile sent nothing")
                sending.offset += sent
        except BlockingIOError:
            if not sending.waiting:
                sending.waiting = True
                self.loop.add_writer(out.fileno(), self._pump)
                self.transport.pause_reading()
            return
        except OSError:
            self._end_sending()
            self.transport.abort()
            return
        self._end_sending()
        while self.queued and self.sending is None:
            self._answer(*self.queued.pop(0))

    def _end_sending(self) -> None:
        sending, self.sending = self.sending, None
        if sending is None:
            return
        os.close(sending.fd)
        if sending.waiting and self.out is not None and self.transport is not None:
            self.loop.remove_writer(self.out.fileno())
            if not self.transport.is_closing():
                self.transport.resume_reading()


def serve_protocol(port: int, data: Path) -> None:
    import uvloop

    store, puts = Store(data), Puts(data, "protocol")
    loop = uvloop.new_event_loop()
    loop.run_until_complete(loop.create_server(lambda: DataPlaneProtocol(store, puts, loop), "127.0.0.1", port,
                                               backlog=1024))
    loop.run_forever()


# -- (c) granian's RSGI interface ----------------------------------------------------------------------

class RsgiApp:
    """The calls as an RSGI app (granian): the data directory comes from ``KVGW_DATAPLANE_DATA``."""

    def __init__(self) -> None:
        self.store: Store | None = None
        self.puts: Puts | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        data = Path(os.environ[DATA_ENV])
        self.store, self.puts = Store(data), Puts(data, "granian")

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        store, puts = self.store, self.puts
        if store is None or puts is None:
            self.__rsgi_init__(asyncio.get_running_loop())
            store, puts = self.store, self.puts
            assert store is not None and puts is not None
        method, path = scope.method, scope.path
        if method == "PUT":
            staged = None if path == SINK_PATH else puts.stage()
            try:
                async for chunk in protocol:
                    if staged is not None:
                        staged.write(chunk)
            except BaseException:
                if staged is not None:
                    staged.abort()
                raise
            if staged is not None:
                puts.stored(scope.client, staged.finish())
            protocol.response_empty(201, [])
        elif method == "POST" and path.endswith("/exists"):
            protocol.response_bytes(200, [("content-type", "application/json")],
                                    store.exists_json(await protocol()))
        elif method in ("HEAD", "GET") and path != PROBE_PATH:
            found = store.stat(key_of(path))
            if found is None:
                protocol.response_empty(404, [])
                return
            file, size, etag = found
            if method == "HEAD":
                protocol.response_empty(200, [("content-length", str(size)), ("etag", etag)])
            else:
                protocol.response_file(200, [("etag", etag)], file)
        elif method == "DELETE":
            protocol.response_empty(204 if puts.delete(scope.client) else 404, [])
        else:
            protocol.response_bytes(200, [], b"ok")


rsgi_app = RsgiApp()


def granian_version() -> str | None:
    if importlib.util.find_spec("granian") is None:
        return None
    return importlib.metadata.version("granian")


def serve_granian(port: int, data: Path) -> None:
    """granian's own command line in this process (``exec``: its pid is this one's), one worker."""
    os.environ[DATA_ENV] = str(data)
    os.execv(sys.executable, [sys.executable, "-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1",
                              "--port", str(port), "--workers", "1", "--loop", "uvloop", "--http", "1", "--no-ws",
                              "--log-level", "warning", "gateway.bench.dataplane:rsgi_app"])


SERVE = {"uvicorn": serve_uvicorn, "protocol": serve_protocol, "granian": serve_granian}


class Candidate(BaselineProcess):
    """One of the three servers, in its own process (``python -m gateway.bench.dataplane --serve KIND``)."""

    module = "gateway.bench.dataplane"

    def __init__(self, workdir: Path, data: Path, kind: str) -> None:
        self.name = f"dataplane-{kind}"
        super().__init__(workdir)
        self.data = data
        self.kind = kind

    def start(self) -> Candidate:
        self._spawn(["--serve", self.kind, "--data", str(self.data)], PROBE_PATH)
        return self

    def pids(self) -> list[int]:
        """The process and its children (granian's worker)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *procstat.children(self.proc.pid)]


# -- measuring ----------------------------------------------------------------------------------------

@dataclass
class Sample:
    server: str
    call: str
    clients: int
    rnd: int
    stats: Stats
    cpu: float  # server CPU seconds over the run

    @property
    def p50_ms(self) -> float:
        return self.stats.percentile(0.5) * 1e3

    @property
    def p99_ms(self) -> float:
        return self.stats.percentile(0.99) * 1e3

    @property
    def throughput(self) -> float:
        """MB/s for the bulk calls, calls/s for the rest."""
        return self.stats.bytes_per_s / 1e6 if self.call in BULK else self.stats.ops_per_s

    @property
    def cpu_cost(self) -> float:
        """Server CPU s/GiB for the bulk calls, µs per call for the rest."""
        if self.call in BULK:
            return self.cpu / (self.stats.bytes / GiB) if self.stats.bytes else float("nan")
        return self.cpu / self.stats.ops * 1e6 if self.stats.ops else float("nan")


@dataclass
class Server:
    name: str
    address: Address
    pids: Callable[[], list[int]]


@dataclass
class Bench:
    args: argparse.Namespace
    size: int
    servers: dict[str, Server]
    samples: list[Sample] = field(default_factory=list)

    def requests(self, call: str) -> tuple[dict[str, MakeRequest], MakeRequest | None]:
        """Per server, what its clients send for ``call``; and the request that follows each (DELETE)."""
        keys = get_keys(self.args.objects)
        out: dict[str, MakeRequest] = {}
        then: MakeRequest | None = None
        if call == HEAD:
            head = LoadRequest("HEAD", chunk_target(lookup_keys()[0]))
            out = dict.fromkeys(self.servers, lambda i, seq: head)
        elif call == EXISTS:
            exists = LoadRequest("POST", f"/v1/buckets/{BUCKET}/exists", body=exists_body(),
                                 headers=[("Content-Type", "application/json")])
            out = dict.fromkeys(self.servers, lambda i, seq: exists)
        elif call == GET:
            from kvgw_client.keys import digest_many

            gets = [LoadRequest("GET", chunk_target(k)) for k in keys]
            direct = [LoadRequest("GET", f"/{d.hex()}") for d in digest_many(BUCKET, keys)]
            mapped = [LoadRequest("GET", f"/v1/buckets/{BUCKET}/mapped/{k}") for k in keys]
            out = {name: (lambda i, seq: gets[(i + seq) % len(gets)]) for name in self.servers}
            out[NGINX] = lambda i, seq: direct[(i + seq) % len(direct)]
            out[PROTOCOL_MAPPED] = lambda i, seq: mapped[(i + seq) % len(mapped)]
        else:
            payload = bytes(os.urandom(self.size))
            put = LoadRequest("PUT", chunk_target("dataplane-put") if call == PUT_FILE else SINK_PATH, body=payload,
                              expect=(201,))
            threaded = LoadRequest("PUT", f"/v1/buckets/{BUCKET}/threaded/dataplane-put" if call == PUT_FILE else
                                   f"/threaded{SINK_PATH}", body=payload, expect=(201,))
            out = dict.fromkeys(self.servers, lambda i, seq: put)
            out[PROTOCOL_THREADED] = lambda i, seq: threaded
            if call == PUT_FILE:
                delete = LoadRequest("DELETE", chunk_target("dataplane-put"), expect=(204,))
                then = lambda i, seq: delete  # noqa: E731
        return {name: make for name, make in out.items() if name in self.runs(call)}, then

    def runs(self, call: str) -> list[str]:
        return [n for n in (*CANDIDATES, BASELINE[call]) if n in self.servers and call in VARIANTS.get(n, (call,))]

    def measure(self, name: str, call: str, clients: int, rnd: int, make: MakeRequest,
                then: MakeRequest | None) -> Sample:
        server = self.servers[name]
        pids = server.pids()
        cpu0 = procstat.total_cpu_seconds(pids)
        stats = run_load(server.address, make, clients, duration=self.args.duration, processes=clients > 1,
                         then=then)
        sample = Sample(name, call, clients, rnd, stats, procstat.total_cpu_seconds(pids) - cpu0)
        if stats.errors or not stats.ops:
            raise RuntimeError(f"{name} {call} x{clients}: {stats.errors} errors of {stats.ops + stats.errors}, "
                               f"{stats.error_samples[:2]}")
        self.samples.append(sample)
        return sample

    def check(self) -> None:
        """Every server answers every call as the others do, before anything is measured."""
        want_exists = lookup_answers()["/exists"]
        for call in CALLS.values():
            makes, then = self.requests(call)
            for name, make in makes.items():
                request = make(0, 0)
                if then is not None or call == GET:  # the DELETE shares the PUT's connection; a GET's body is large
                    done = run_load(self.servers[name].address, make, 1, count=1, then=then)
                    if done.errors:
                        raise RuntimeError(f"{name} {call}: {done.error_samples}")
                    if call == GET and done.bytes != self.size:
                        raise RuntimeError(f"{name} answered GET with {done.bytes} bytes, not {self.size}")
                    continue
                status, body = request_once(self.servers[name].address, request)
                if status not in request.expect:
                    raise RuntimeError(f"{name} answered {call} with {status} {body[:200]!r}")
                if call == EXISTS and body.replace(b" ", b"") != want_exists:
                    raise RuntimeError(f"{name} answered exists with {body[:200]!r}")

    def run(self) -> None:
        self.check()
        calls = [CALLS[c] for c in self.args.calls]
        for rnd in range(self.args.rounds):
            for call in calls:
                makes, then = self.requests(call)
                for clients in self.args.clients:
                    order = list(makes) if rnd % 2 == 0 else list(makes)[::-1]
                    for name in order:
                        self.measure(name, call, clients, rnd, makes[name], then)
                        if call in (PUT_FILE, PUT_SINK_CALL):
                            os.sync()
                print(f"  round {rnd + 1}/{self.args.rounds}: {call} done", file=sys.stderr, flush=True)


# -- the report ---------------------------------------------------------------------------------------

def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")  # CPU is read in clock ticks: a very short run may show none


def summarise(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Per (call, clients): each server's medians and its ratios to the call's baseline (the median of
    the per-round ratios; None without a baseline)."""
    cells: list[dict[str, Any]] = []
    for call, clients in dict.fromkeys((s.call, s.clients) for s in samples):
        mine = [s for s in samples if (s.call, s.clients) == (call, clients)]
        base_name = BASELINE[call]
        base = {s.rnd: s for s in mine if s.server == base_name}
        servers: dict[str, Any] = {}
        for name in dict.fromkeys(s.server for s in mine):
            runs = [s for s in mine if s.server == name]
            figures: dict[str, Any] = {
                "rounds": len(runs),
                "p50_ms": _median([s.p50_ms for s in runs]),
                "p99_ms": _median([s.p99_ms for s in runs]),
                "throughput": _median([s.throughput for s in runs]),
                "cpu": _median([s.cpu_cost for s in runs]),
                "errors": sum(s.stats.errors for s in runs),
            }
            paired = [(s, base[s.rnd]) for s in runs if s.rnd in base]
            figures["vs_baseline"] = None if not paired or name == base_name else {
                "p50": _median([_ratio(s.p50_ms, b.p50_ms) for s, b in paired]),
                "throughput": _median([_ratio(s.throughput, b.throughput) for s, b in paired]),
                "cpu": _median([_ratio(s.cpu_cost, b.cpu_cost) for s, b in paired]),
            }
            servers[name] = figures
        cells.append({"call": call, "clients": clients, "baseline": base_name if base else None,
                      "throughput_unit": "MB/s" if call in BULK else "calls/s",
                      "cpu_unit": "s/GiB" if call in BULK else "us/call", "servers": servers})
    return cells


def best(cell: dict[str, Any]) -> tuple[str, str]:
    """The candidate with the highest throughput, and the one with the least CPU, in a cell."""
    present = [n for n in CANDIDATES if n in cell["servers"]]
    fastest = max(present, key=lambda n: cell["servers"][n]["throughput"])
    leanest = min(present, key=lambda n: cell["servers"][n]["cpu"])
    return fastest, leanest


def render(cells: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'call':10} {'clients':>7} {'server':22} {'p50 ms':>8} {'p99 ms':>8} {'throughput':>16}"
             f" {'server CPU':>15} {'p50 / base':>10} {'thr / base':>10} {'CPU / base':>10}"]
    for cell in cells:
        for name, f in cell["servers"].items():
            ratio = f["vs_baseline"]
            thr = f"{f['throughput']:.0f} {cell['throughput_unit']}"
            cpu = f"{f['cpu']:.3f} {cell['cpu_unit']}" if cell["call"] in BULK else f"{f['cpu']:.1f} {cell['cpu_unit']}"
            rs = ("" if ratio is None else
                  f" {ratio['p50']:10.2f} {ratio['throughput']:10.2f} {ratio['cpu']:10.2f}")
            lines.append(f"{cell['call']:10} {cell['clients']:7d} {name:22} {f['p50_ms']:8.3f} {f['p99_ms']:8.2f} "
                         f"{thr:>16} {cpu:>15}{rs}")
        fastest, leanest = best(cell)
        lines.append(f"{'':10} {'':7} -> fastest: {fastest}; least CPU: {leanest}")
    return "\n".join(lines)


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench dataplane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--clients", type=parse_list, default=[1, 8], help="client counts (default 1,8)")
    parser.add_argument("--calls", type=lambda t: t.split(","), default=list(CALLS),
                        help=f"which calls, of {','.join(CALLS)} (default all)")
    parser.add_argument("--size-mib", type=int, default=8, help="GET and PUT body size")
    parser.add_argument("--objects", type=int, default=8, help="distinct chunks the GETs cycle over")
    parser.add_argument("--only", type=lambda t: t.split(","), default=list(KINDS.values()),
                        help="candidates to run, of uvicorn,protocol,granian (default all)")
    parser.add_argument("--quick", action="store_true",
                        help="a structure check: 1 round of 0.3 s, 1 MiB bodies, 1 and 2 clients")
    parser.add_argument("--json", type=Path, help="write the report (medians, ratios, every sample) here")
    parser.add_argument("--serve", choices=sorted(SERVE), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        SERVE[args.serve](args.port, args.data)
        return 0
    if args.quick:
        args.rounds, args.duration, args.size_mib, args.objects, args.clients = 1, 0.3, 1, 2, [1, 2]
    unknown = [c for c in args.calls if c not in CALLS]
    if unknown:
        parser.error(f"unknown calls {unknown}")
    size = args.size_mib * MiB
    skipped: list[str] = []
    version = granian_version()
    kinds = list(args.only)
    if "granian" in kinds and version is None:
        kinds.remove("granian")
        skipped.append(f"{GRANIAN}: granian is not installed (pip install -e \".[bench]\")")
    nginx_binary = find_nginx()
    if nginx_binary is None:
        skipped.append(f"{NGINX}: nginx is not installed (apt-get install nginx-light): GET has no baseline")
    for line in skipped:
        print(f"skipped {line}", flush=True)
    started = dt.datetime.now(dt.UTC)
    print(f"kvgw bench dataplane: {args.rounds} rounds of {args.duration:g} s per measurement, clients "
          f"{args.clients}, {args.size_mib} MiB bodies, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"granian {version}, {started:%Y-%m-%d %H:%M} UTC", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-dataplane-", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        data = work / "data"
        prepare(data, args.objects, size)
        procs: list[Any] = []
        try:
            servers: dict[str, Server] = {}

            def add(name: str, proc: Any) -> None:
                procs.append(proc)
                servers[name] = Server(name, proc.address, proc.pids)

            for name, kind in KINDS.items():
                if kind in kinds:
                    add(name, Candidate(work, data, kind).start())
            for variant in VARIANTS if PROTOCOL in servers else ():
                servers[variant] = Server(variant, servers[PROTOCOL].address, servers[PROTOCOL].pids)
            if nginx_binary is not None:
                add(NGINX, Nginx(nginx_binary, data / "files", work / "nginx").start(PROBE_PATH))
            add(FLOOR, RawResponder(work / "raw", lookup_answers(), index=(data / "index", BUCKET)).start())
            add(PUT_SINK, PutSink(work, work / "put-sink", fsync=False).start())
            add(RECEIVE_SINK, PutSink(work, None, fsync=False).start())
            bench = Bench(args, size, servers)
            bench.run()
        finally:
            for proc in procs:
                proc.stop()
    cells = summarise(bench.samples)
    print(render(cells))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "kvgw bench dataplane " + " ".join(argv), "started": started.isoformat(),
            "commit": _commit(), "machine": platform.platform(), "cpus": os.cpu_count(), "granian": version,
            "rounds": args.rounds, "duration_s": args.duration, "size_bytes": size, "skipped": skipped,
            "cells": cells,
            "samples": [{"server": s.server, "call": s.call, "clients": s.clients, "round": s.rnd,
                         "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "throughput": s.throughput, "cpu": s.cpu_cost,
                         "ops": s.stats.ops}
                        for s in bench.samples]}, indent=1))
    return 0


def _commit() -> str | None:
    import subprocess

    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    return None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
