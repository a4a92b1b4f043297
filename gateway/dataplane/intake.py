"""Large request bodies received straight into the buffers the app keeps: the body intake.

Why: an ASGI server hands a request body to the app through several user-space copies: uvloop reads
into its own buffer and makes a ``bytes`` of each read, httptools makes another of the body part, and
the server joins them for each ``receive`` (uvicorn: four copies). Most of them also take
fresh memory, which the guest faults in. For a KV chunk (1-64 MB, written once) that is four passes over
every byte before the one that matters, the copy into the page cache. ``kvgw bench io --ops put`` has
the measurements (BENCHMARKS.md, "kvgw bench io").

How: when the head of a ``PUT`` whose ``Content-Length`` is at least ``INTAKE_MIN_BYTES`` is complete
and its request cycle (``gateway.dataplane.cycle``) is the connection's current one, the connection
(``gateway.dataplane.protocol``) gives the cycle a ``BodyIntake`` and, once the parser has taken the
bytes that came with the head, makes the intake (an ``asyncio.BufferedProtocol``) the transport's
protocol for the rest of that body. The event loop then reads the socket straight into
``INTAKE_PIECE_BYTES`` pieces, and each full piece is one ASGI message, handed over without a copy: a
``bytearray`` the intake never touches again. Pieces are the filesystem tier's write unit
(``backends.posix.FOLIO_BYTES``), so a staged chunk writes each one as it is. The intake never reads
past the body (its buffers end where the body ends), so a request pipelined behind it reaches the HTTP
protocol, which gets the transport back with a fresh parser when the body's last byte arrives.

What stays as the request cycle does it: ``100 Continue`` is sent on the app's first ``receive``; a
client that goes away gives the app ``http.disconnect`` (and the connection its ``connection_lost``);
reading pauses while ``QUEUED_PIECES`` full pieces wait for the app (so a PUT in flight holds a
waiting piece, the one filling and the one its staged chunk is writing: about 6 MiB). A
body that trickles in is handed over as it arrives once the app has waited ``PARTIAL_AFTER`` seconds for
a full piece (a copy, on that slow path only), so the apps' body idle deadline keeps meaning "no byte
for that long".

**Threaded receives** (``consume_in_thread``: the ``ThreadedBody`` a native PUT, or an S3 PUT whose body is
not aws-chunked, ``Payload.threaded``, hands the service):
the service can take the body in a worker thread instead, where one thread receives each piece from the
socket into its own page-aligned buffer (which a direct write, ``O_DIRECT``, then takes as it is), and
the service hashes it and the filesystem tier writes it before the next is received. The event loop then
does nothing per piece (no callback per socket read, no hand-off to a write thread, no fresh piece), and
the bytes are still in that core's cache when they are copied into the page cache (BENCHMARKS.md, "kvgw
bench io", has the measurements). Meanwhile the transport does not read: the thread reads the socket's
descriptor itself, sleeping until ``THREADED_WAKE_BYTES`` have arrived (``SO_RCVLOWAT``) rather than
waking per segment. It gives up, and the intake reads the rest as above, as soon as a piece takes longer
than ``THREADED_PIECE_SECONDS`` to arrive (a slow or stalled client holds no thread) or the client goes
away. At most ``THREADED_RECEIVERS`` at once; a PUT that finds none free is read as above. Not over TLS
(the socket holds ciphertext).

Left to the request cycle: other methods, bodies below the threshold or without a ``Content-Length``
(``Transfer-Encoding``), and pipelined requests (their cycle waits behind another one).

Everything here runs on the event loop, but ``_receive_in_thread`` and what it calls.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from backends.fileio import aligned_buffer
from backends.posix import FOLIO_BYTES
from gateway.api.http import Message
from gateway.chunks import ThreadedOutcome

if TYPE_CHECKING:
    from gateway.dataplane.cycle import RequestCycle
    from gateway.dataplane.protocol import Connection

INTAKE_MIN_BYTES = 1 << 20  # bodies from this size on are read into pieces, not through the cycle
INTAKE_PIECE_BYTES = FOLIO_BYTES  # one ASGI message per piece: the filesystem tier's write unit
QUEUED_PIECES = 1  # full pieces waiting for the app before reading pauses: one (2 and 1 measured alike)
PARTIAL_AFTER = 1.0  # seconds the app waits for a full piece before it gets what has arrived
THREADED_RECEIVERS = 8  # threads receiving bodies (8 clients: 0.95x the CPU per PUT of 4); more at once: the loop reads
THREADED_WAKE_BYTES = 512 << 10  # a threaded receive sleeps until this much of its piece has arrived
THREADED_PIECE_SECONDS = 0.25  # a threaded receive gives up when a piece takes longer (slower than 8 MB/s)

_RECEIVERS = concurrent.futures.ThreadPoolExecutor(THREADED_RECEIVERS, thread_name_prefix="kvgw-body")
_RECEIVER_SLOTS = threading.BoundedSemaphore(THREADED_RECEIVERS)  # taken without waiting: none free, the loop reads
_SPARE_PIECES: list[bytearray] = []
"""Full-size pieces a completed threaded receive is done with (its consumer keeps none): the next
intakes take them instead of new ones, each a fresh 2 MiB the event loop would zero-fill and fault in
(``kvgw bench io`` PUT with pages recycled: 0.88-0.90 -> 0.79-0.80 s/GiB of server CPU at 1 client,
BENCHMARKS.md). A piece handed to the app never comes back here, so nothing else can still hold one.
``list.pop`` and ``append`` are atomic, so worker threads and the event loop share it without a lock."""
_SPARE_LIMIT = THREADED_RECEIVERS  # one per receiving thread: at most 16 MiB kept


_THREAD_BUFFERS = threading.local()


def _thread_buffer() -> memoryview:
    """This receiving thread's page-aligned piece buffer (one per thread, kept: ``THREADED_RECEIVERS`` x
    ``INTAKE_PIECE_BYTES`` at most)."""
    buffer: memoryview | None = getattr(_THREAD_BUFFERS, "buffer", None)
    if buffer is None:
        buffer = _THREAD_BUFFERS.buffer = aligned_buffer(INTAKE_PIECE_BYTES)
    return buffer


def _new_piece(size: int) -> bytearray:
    """A buffer for a piece of ``size`` bytes; a spare one (holding an earlier body's bytes, which
    are overwritten before any of it is handed on) where the size allows."""
    if size == INTAKE_PIECE_BYTES:
        with contextlib.suppress(IndexError):
            return _SPARE_PIECES.pop()
    return bytearray(size)


def _spare(piece: bytes | bytearray) -> None:
    """Keep ``piece`` for a later intake; only once nothing can read it any more."""
    if isinstance(piece, bytearray) and len(piece) == INTAKE_PIECE_BYTES and len(_SPARE_PIECES) < _SPARE_LIMIT:
        _SPARE_PIECES.append(piece)


class BodyIntake(asyncio.BufferedProtocol):
    """The rest of one request body, read into pieces and handed to the app as ASGI messages."""

    def __init__(self, http: Connection, cycle: RequestCycle, length: int) -> None:
        self._http = http
        self._cycle = cycle
        self._unread = length  # body bytes not yet in a piece
        self._piece = _new_piece(min(INTAKE_PIECE_BYTES, length))
        self._filled = 0  # bytes of the piece received
        self._handed = 0  # bytes of the piece already handed over (the slow path)
        self._ready: collections.deque[bytes | bytearray] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._partial_timer: asyncio.TimerHandle | None = None
        self._lost = False

    @property
    def complete(self) -> bool:
        """Every byte of the body has been received."""
        return self._unread == 0

    # -- threaded receives -------------------------------------------------------------------------

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        """``gateway.chunks.ThreadedBody``: the body's pieces handed to ``consume`` in a worker thread
        (the module's docstring says when); whatever is left comes from ``receive`` afterwards."""
        http = self._http
        transport = http.transport
        if (self._lost or self.complete or self._handed or transport.is_closing()
                or transport.get_extra_info("sslcontext") is not None or not _RECEIVER_SLOTS.acquire(blocking=False)):
            return "skipped"
        self._cycle.send_continue()
        http.pause_reading()  # from here until the thread ends, only the thread reads the socket
        stop = threading.Event()
        sock = transport.get_extra_info("socket")
        read = http.loop.run_in_executor(_RECEIVERS, self._receive_in_thread, sock, consume, stop)
        try:
            try:
                outcome: ThreadedOutcome = await asyncio.shield(read)
            except asyncio.CancelledError:
                stop.set()  # the thread ends within a piece's deadline: wait for it, so that the caller
                await asyncio.wait([read])  # cleans up (the staged file) only once it is not written to
                raise
        finally:
            _RECEIVER_SLOTS.release()
            self._after_thread()
        if outcome == "gone":
            self.lose()
        return outcome

    def _receive_in_thread(self, sock: socket.socket, consume: Callable[[memoryview], None],
                           stop: threading.Event) -> ThreadedOutcome:
        """The threaded receive, in a worker thread (``_receive_pieces``), leaving the socket's
        low-water mark as the event loop expects it."""
        try:
            return self._receive_pieces(sock, consume, stop)
        finally:
            with contextlib.suppress(OSError):  # closed under us (a server shutting down): nothing to restore
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # as the event loop had it

    def _receive_pieces(self, sock: socket.socket, consume: Callable[[memoryview], None],
                        stop: threading.Event) -> ThreadedOutcome:
        """The pieces already received, then the rest of the body into the current piece's buffer,
        reused for every piece. Touches only this intake's piece, ``_filled``, ``_unread`` and
        ``_ready``, which nothing on the event loop uses while the transport is paused and the app
        awaits this."""
        while self._ready:
            piece = self._ready.popleft()
            consume(memoryview(piece))
            _spare(piece)
        # the rest goes into this thread's page-aligned buffer, so that a direct write (O_DIRECT) takes
        # each piece as it is, with no copy (backends.fileio.write_direct); what the event loop had
        # received of the current piece moves there first, and back if the thread stops part-way
        buffer = _thread_buffer()[: len(self._piece)]
        buffer[: self._filled] = memoryview(self._piece)[: self._filled]
        try:
            return self._receive_into(buffer, sock, consume, stop)
        finally:
            if self._unread and self._filled:
                self._piece[: self._filled] = buffer[: self._filled]

    def _receive_into(self, buffer: memoryview, sock: socket.socket, consume: Callable[[memoryview], None],
                      stop: threading.Event) -> ThreadedOutcome:
        fd = sock.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        lowat = 1
        while self._unread:
            if stop.is_set():
                return "slow"
            size = min(len(buffer), self._filled + self._unread)  # this piece: never past the body's end
            deadline = time.monotonic() + THREADED_PIECE_SECONDS
            while self._filled < size:
                try:
                    n = os.readv(fd, [buffer[self._filled : size]])
                except BlockingIOError:
                    wanted = min(size - self._filled, THREADED_WAKE_BYTES)
                    if wanted != lowat:  # wake when this much has arrived, not on every segment
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                        lowat = wanted
                    left = deadline - time.monotonic()
                    if left <= 0 or stop.is_set() or not poller.poll(left * 1000):
                        return "slow"
                    continue
                except OSError:  # reset
                    return "gone"
                if n == 0:
                    return "gone"
                self._filled += n
                self._unread -= n
            self._filled = 0  # handed over, whatever ``consume`` makes of it
            consume(buffer[:size])
        return "complete"

    def _after_thread(self) -> None:
        """Back on the event loop after a threaded receive: the body's end as ``buffer_updated`` would
        have seen it, or the intake reading the rest into a piece that ends where the body ends."""
        if self.complete:
            _spare(self._piece)  # the thread used its own buffer: this piece was never handed on
            self._piece = bytearray()  # ... and this intake, done, never reads it again
            self._http.intake_done()
        elif len(self._piece) - self._filled > self._unread:
            piece = bytearray(self._filled + self._unread)  # the reused buffer is longer than what is left
            piece[: self._filled] = self._piece[: self._filled]
            self._piece = piece
        self._http.resume_reading()

    # -- bytes in --------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Body bytes the parser found behind the head, in the same read."""
        view = memoryview(data)
        while view:
            n = min(len(view), len(self._piece) - self._filled)
            self._piece[self._filled : self._filled + n] = view[:n]
            view = view[n:]
            self._received(n)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._piece)[self._filled :]  # a piece never reaches past the body's end

    def buffer_updated(self, nbytes: int) -> None:
        self._received(nbytes)
        if self.complete:
            self._http.intake_done()

    def _received(self, n: int) -> None:
        self._filled += n
        self._unread -= n
        if self._filled < len(self._piece):
            return
        piece = self._piece
        self._ready.append(piece if self._handed == 0 else piece[self._handed :])
        if self._unread:
            self._piece = _new_piece(min(INTAKE_PIECE_BYTES, self._unread))
        self._filled = self._handed = 0
        if len(self._ready) >= QUEUED_PIECES:
            self._http.pause_reading()
        self._wake()

    # -- the connection --------------------------------------------------------------------------

    def lose(self) -> None:
        """The connection is gone: the app's ``receive`` answers ``http.disconnect`` from now on."""
        self._lost = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._http.connection_lost(exc)  # which calls ``lose``

    def eof_received(self) -> bool | None:
        return self._http.eof_received()

    def pause_writing(self) -> None:
        self._http.pause_writing()

    def resume_writing(self) -> None:
        self._http.resume_writing()

    # -- the app's side --------------------------------------------------------------------------

    async def receive(self) -> Message:
        """The cycle's ``receive`` while this body lasts: its pieces in order, then the cycle's own."""
        cycle = self._cycle
        cycle.send_continue()
        if not self._ready and not self._lost and not cycle.response_complete:
            if self.complete:
                return await cycle.receive_after_intake()  # the body was all handed over
            await self._wait()
        if self._lost or cycle.disconnected or cycle.response_complete:
            return {"type": "http.disconnect"}
        piece = self._ready.popleft()
        if len(self._ready) < QUEUED_PIECES:
            self._http.resume_reading()
        # a bytearray where ASGI says bytes: bytes-like for every reader here, and never changed again
        return {"type": "http.request", "body": piece, "more_body": bool(self._ready) or not self.complete}

    async def _wait(self) -> None:
        loop = self._http.loop
        self._waiter = loop.create_future()
        self._partial_timer = loop.call_later(PARTIAL_AFTER, self._hand_partial)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if self._partial_timer is not None:
                self._partial_timer.cancel()
                self._partial_timer = None

    def _hand_partial(self) -> None:
        """The app has waited ``PARTIAL_AFTER`` for a full piece: give it what has arrived (a copy)."""
        self._partial_timer = None
        if self._filled > self._handed:
            self._ready.append(bytes(self._piece[self._handed : self._filled]))
            self._handed = self._filled
            self._wake()
        elif self._waiter is not None:
            self._partial_timer = self._http.loop.call_later(PARTIAL_AFTER, self._hand_partial)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
