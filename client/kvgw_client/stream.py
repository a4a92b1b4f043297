"""Batch-get streams read from the socket straight into their destinations: one copy per byte; and
the client's small JSON calls (lookups, hints) on the same kind of connections, without aiohttp's request
cycle (a blocking lookup from a plain thread goes on ``kvgw_client.calls`` instead).

Through aiohttp a batch-get's body reached the caller's buffer by three copies: out of the socket into
a new ``bytes`` per read, again where its parser slices chunked data, and into the destination
(``framing.PayloadWriter``). That cost kvgw's client ~0.5 s of CPU per GiB loaded, two to three times
what reading the same bytes from a raw socket costs (BENCHMARKS.md, "kvgw bench io"). Here a connection
is an ``asyncio.BufferedProtocol`` around a ``response.ResponseReader``: whenever a frame's payload is
next in the stream, the buffer the event loop reads the socket into *is* the caller's destination
(``BatchReader.payload_target``), and the payload is hashed there as it lands. Everything else (the
response head, chunk-size lines, frame headers, an error's body) is read into a small buffer and parsed.

What a caller must know:
- HTTP/1.1 only as kvgw's gateway speaks it to this client (``response``). TLS works the same way
  (asyncio's TLS transport reads decrypted bytes into the protocol's buffer).
- One request at a time per connection. Whoever ``StreamPool.request`` gave a connection gives it back
  with ``StreamPool.release`` once done with it (after ``abort`` if the answer was not read to its end):
  only a connection whose answer ended cleanly and did not ask to close is kept for the next request.
- Everything runs on the client's I/O loop. Errors surface as ``OSError`` / ``TimeoutError`` /
  ``wire.FramingError`` / ``StreamError``; ``policy.translate`` turns them into client errors.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping

from kvgw_client.endpoint import Endpoint
from kvgw_client.framing import BatchItem, BatchReader
from kvgw_client.response import BodySink, Head, ResponseReader, StreamError


class BatchSink(BodySink):
    """A batch-get body into a ``BatchReader``: payload bytes received straight into their destinations,
    the rest fed. The items completed so far wait in ``take``; ``event`` is set when there are some."""

    def __init__(self, reader: BatchReader) -> None:
        self.reader = reader
        self.event = asyncio.Event()
        self.fed = 0  # bytes that went through the small buffer (and were copied once more)
        self._items: list[BatchItem] = []

    def feed(self, data: memoryview) -> None:
        self.fed += len(data)
        self._add(self.reader.feed(data))

    def target(self) -> memoryview | None:
        return self.reader.payload_target()

    def written(self, n: int) -> None:
        self._add(self.reader.payload_written(n))

    def take(self) -> list[BatchItem]:
        items, self._items = self._items, []
        self.event.clear()
        return items

    def _add(self, items: list[BatchItem]) -> None:
        if items or self.reader.error is not None:
            self._items += items
            self.event.set()


class StreamConnection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection reading response bodies into a ``BodySink``
    (``response.ResponseReader`` parses; this protocol adds the futures its caller awaits)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._reader = ResponseReader()
        self._head: asyncio.Future[Head] | None = None
        self._done: asyncio.Future[None] | None = None
        self.last_read = self._loop.time()  # when bytes last arrived (the caller's idle-read timeout)
        self.answered = False  # a byte of the answer to the request in flight arrived

    # -- the request ------------------------------------------------------------------------------

    def send(self, request: bytes, sink_for: Callable[[Head], BodySink]) -> None:
        """Send ``request`` (a whole HTTP/1.1 request); the body of its response goes to the sink
        ``sink_for`` picks by the response's head (a batch reader for a 200, a collector for an error)."""
        assert self.transport is not None and self._reader.idle
        self._reader.start(sink_for)
        self._head = self._loop.create_future()
        self._done = self._loop.create_future()
        self.last_read = self._loop.time()
        self.answered = False
        self.transport.write(request)

    async def head(self) -> Head:
        assert self._head is not None
        return await asyncio.shield(self._head)

    @property
    def reusable(self) -> bool:
        """The last answer ended cleanly and the connection stays open for another request."""
        return (self._reader.idle and self._done is not None and self._done.done()
                and not self._done.cancelled() and self._done.exception() is None
                and not self._reader.close_after
                and self.transport is not None and not self.transport.is_closing())

    @property
    def done(self) -> asyncio.Future[None]:
        """Resolved when the response body ended (an exception if it broke)."""
        assert self._done is not None
        return self._done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._reader.closed():
            self._settle()
            return
        self._fail(exc or ConnectionResetError("the gateway closed the connection mid-response"))

    def eof_received(self) -> bool | None:
        return False  # close: the answer (if delimited by the close) ends with connection_lost

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_read = self._loop.time()
        self.answered = True
        try:
            self._reader.updated(nbytes)
        except Exception as exc:  # a malformed answer or a sink that refuses it: the connection is done
            self._settle()  # an answer that ended before what broke stands
            self._fail(exc)
            return
        self._settle()

    # -- the end of a response -------------------------------------------------------------------

    def _settle(self) -> None:
        """Resolve the futures for what the reader has: the head once it arrived, the end once it came
        (then close the connection if the answer asked for it)."""
        reader = self._reader
        if reader.head is not None and self._head is not None and not self._head.done():
            self._head.set_result(reader.head)
        if reader.complete and self._done is not None and not self._done.done():
            self._done.set_result(None)
            if reader.close_after:
                self.close()

    def _fail(self, exc: BaseException) -> None:
        self._reader.fail()
        for fut in (self._head, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: a failure before the head is reported through head()
        self.abort()


class StreamPool:
    """Idle keep-alive connections to one gateway, most recently used first.

    ``request`` sends one request and returns the connection once the response head arrived. A
    connection reused from the pool that the gateway closed while it sat idle (its keep-alive timeout)
    fails before any byte of the answer: the request is sent again, on the next idle connection or a
    new one (a batch-get changes nothing on the gateway, so sending it twice is harmless)."""

    def __init__(self, endpoint: Endpoint, *, connections: int, connect_timeout: float) -> None:
        self.endpoint = endpoint
        self._max_idle = connections
        self._slots = asyncio.Semaphore(connections)
        self._connect_timeout = connect_timeout
        self._idle: collections.deque[StreamConnection] = collections.deque()
        self._closed = False

    async def request(self, request: bytes, sink_for: Callable[[Head], BodySink]) -> tuple[StreamConnection, Head]:
        """Send ``request``; the connection it went out on and the answer's head (``send``). The caller
        owns the connection until it calls ``release``. At most ``connections`` are owned at once: a
        further request waits for one to be released."""
        await self._slots.acquire()
        try:
            return await self._send(request, sink_for)
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: StreamConnection) -> None:
        """Give back a connection ``request`` handed out: kept for the next request if its answer
        ended cleanly and the connection stays open, closed otherwise."""
        self._slots.release()
        if conn.reusable and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def _send(self, request: bytes, sink_for: Callable[[Head], BodySink]) -> tuple[StreamConnection, Head]:
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            conn.send(request, sink_for)
            try:
                return conn, await conn.head()
            except (ConnectionError, StreamError):
                if conn.answered:
                    raise  # the answer had begun: not a connection the gateway closed while idle
            except BaseException:
                conn.abort()
                raise
        conn = await self._connect()
        conn.send(request, sink_for)
        try:
            return conn, await conn.head()
        except BaseException:
            conn.abort()
            raise

    async def _connect(self) -> StreamConnection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            _, protocol = await loop.create_connection(
                StreamConnection, self.endpoint.host, self.endpoint.port, ssl=self.endpoint.tls,
                server_hostname=self.endpoint.server_hostname)
        return protocol

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


def post_request(authority: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """An HTTP/1.1 POST of a JSON ``body`` to ``path`` at ``authority`` (the Host header), whole."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {authority}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1") + body
