"""Batch-get streams read from the socket straight into their destinations: one copy per byte; and
the client's small JSON calls (lookups, hints) on the same connections, without aiohttp's request cycle.

Through aiohttp a batch-get's body reached the caller's buffer by three copies: out of the socket into
a new ``bytes`` per read, again where its parser slices chunked data, and into the destination
(``framing.PayloadWriter``). That cost kvgw's client ~0.5 s of CPU per GiB loaded, two to three times
what reading the same bytes from a raw socket costs (BENCHMARKS.md, "kvgw bench io"). Here a connection
is an ``asyncio.BufferedProtocol``: whenever a frame's payload is next in the stream, the buffer the
event loop reads the socket into *is* the caller's destination (``BatchReader.payload_target``), and the
payload is hashed there as it lands. Everything else (the response head, chunk-size lines, frame
headers, an error's body) is read into a small buffer and parsed.

What a caller must know:
- HTTP/1.1 only as kvgw's gateway speaks it to this client: a response body with ``Content-Length``,
  ``Transfer-Encoding: chunked``, or delimited by the connection closing. TLS works the same way
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
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvgw_client.framing import BatchItem, BatchReader

MAX_HEAD_BYTES = 64 * 1024  # a response head (or a chunk-size line, or trailers) longer than this is refused
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error response's body kept for its message
_READ_BYTES = 64 * 1024
"""The small buffer everything but payloads is read into. A read there may take the start of the next
payload too (copied on, ``BatchSink.feed``): at most this much per frame, under 1% of an 8 MiB chunk."""

# where the body is
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_CLOSE, _DONE = range(8)


class StreamError(Exception):
    """The server's answer is not HTTP/1.1 as this reader understands it, or it ended early."""


class BodySink:
    """Where a response body's bytes go. ``feed`` copies; ``target`` (optional) is a writable view the
    next bytes may be read into directly, which ``written`` then accounts for."""

    def feed(self, data: memoryview) -> None:
        raise NotImplementedError

    def target(self) -> memoryview | None:
        return None

    def written(self, n: int) -> None:
        raise NotImplementedError


class Collect(BodySink):
    """A (small) body kept whole, up to ``limit`` bytes (the rest dropped, ``truncated`` set): an
    error's JSON, or a JSON answer."""

    def __init__(self, limit: int = ERROR_BODY_LIMIT) -> None:
        self.data = bytearray()
        self.limit = limit
        self.truncated = False

    def feed(self, data: memoryview) -> None:
        room = max(0, self.limit - len(self.data))
        self.truncated |= len(data) > room
        self.data += data[:room]


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


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    reason: str
    headers: Mapping[str, str]  # names lower-cased; a repeated name keeps its last value


class StreamConnection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection reading response bodies into a ``BodySink``."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._read = bytearray(_READ_BYTES)
        self._read_view = memoryview(self._read)
        self._line = bytearray()  # a head or line read so far
        self._direct = False  # the last get_buffer handed out the sink's target
        self._state = _DONE
        self._remaining = 0  # body bytes (length mode) or chunk bytes (chunked) still to come
        self._close_after = False
        self._sink: BodySink | None = None
        self._sink_for: Callable[[Head], BodySink] | None = None
        self._head: asyncio.Future[Head] | None = None
        self._done: asyncio.Future[None] | None = None
        self.last_read = self._loop.time()  # when bytes last arrived (the caller's idle-read timeout)
        self.answered = False  # a byte of the answer to the request in flight arrived

    # -- the request ------------------------------------------------------------------------------

    def send(self, request: bytes, sink_for: Callable[[Head], BodySink]) -> None:
        """Send ``request`` (a whole HTTP/1.1 request); the body of its response goes to the sink
        ``sink_for`` picks by the response's head (a batch reader for a 200, a collector for an error)."""
        assert self.transport is not None and self._state == _DONE
        self._sink_for = sink_for
        self._sink = None
        self._state = _HEAD
        self._line.clear()
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
        return (self._state == _DONE and self._done is not None and self._done.done()
                and not self._done.cancelled() and self._done.exception() is None
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
        if self._state == _TO_CLOSE:
            self._finish()
            return
        self._fail(exc or ConnectionResetError("the gateway closed the connection mid-response"))

    def eof_received(self) -> bool | None:
        return False  # close: the answer (if delimited by the close) ends with connection_lost

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state in (_LENGTH, _CHUNK_DATA, _TO_CLOSE) and self._sink is not None:
            target = self._sink.target()
            if target is not None and len(target):
                self._direct = True
                return target if self._state == _TO_CLOSE else target[: self._remaining]
        self._direct = False
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        self.last_read = self._loop.time()
        self.answered = True
        try:
            if self._direct:
                assert self._sink is not None
                self._sink.written(nbytes)
                if self._state != _TO_CLOSE:
                    self._remaining -= nbytes
                    if not self._remaining:
                        self._state = _DONE if self._state == _LENGTH else _CHUNK_END
                        if self._state == _DONE:
                            self._finish()
                return
            self._parse(self._read_view[:nbytes])
        except Exception as exc:  # a malformed answer or a sink that refuses it: the connection is done
            self._fail(exc)

    # -- parsing ---------------------------------------------------------------------------------

    def _parse(self, data: memoryview) -> None:
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA, _TO_CLOSE):
                n = end - pos if state == _TO_CLOSE else min(self._remaining, end - pos)
                assert self._sink is not None
                self._sink.feed(data[pos : pos + n])
                pos += n
                if state != _TO_CLOSE:
                    self._remaining -= n
                    if not self._remaining:
                        self._state = _CHUNK_END if state == _CHUNK_DATA else _DONE
                        if self._state == _DONE:
                            self._finish()
                continue
            if state == _DONE:
                raise StreamError("bytes after the end of the response")
            line, pos = self._take_line(data, pos, b"\r\n\r\n" if state == _HEAD else b"\r\n")
            if line is None:
                return
            if state == _HEAD:
                self._on_head(line)
            elif state == _CHUNK_SIZE:
                size_text = line.split(b";", 1)[0].strip()
                try:
                    self._remaining = int(size_text, 16)
                except ValueError:
                    raise StreamError(f"bad chunk size {size_text[:20]!r}") from None
                self._state = _CHUNK_DATA if self._remaining else _TRAILERS
            elif state == _CHUNK_END:
                if line:
                    raise StreamError("chunk data not followed by CRLF")
                self._state = _CHUNK_SIZE
            elif not line:  # _TRAILERS: the empty line ends them
                self._state = _DONE
                self._finish()

    def _take_line(self, data: memoryview, pos: int, end_mark: bytes) -> tuple[bytes | None, int]:
        """The next line (or head) without its end mark, and the position after it; (None, end) when it
        has not all arrived (kept for the next read). ``data`` is the start of the read buffer."""
        kept = len(self._line)
        if kept:  # a line begun in an earlier read: its end mark may straddle the two
            self._line += data[pos : pos + MAX_HEAD_BYTES]
            at = self._line.find(end_mark, max(0, kept - len(end_mark) + 1))
            if at < 0:
                if len(self._line) > MAX_HEAD_BYTES:
                    raise StreamError("response head or line too long")
                return None, len(data)
            line = bytes(self._line[:at])
            self._line.clear()
            return line, pos + at + len(end_mark) - kept
        at = self._read.find(end_mark, pos, len(data))
        if at < 0:
            if len(data) - pos > MAX_HEAD_BYTES:
                raise StreamError("response head or line too long")
            self._line += data[pos:]
            return None, len(data)
        return bytes(self._read[pos:at]), at + len(end_mark)

    def _on_head(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise StreamError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise StreamError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if 100 <= status < 200:
            return  # an interim answer: the real head follows
        self._close_after = (headers.get("connection", "").lower() == "close" or parts[0] == b"HTTP/1.0")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise StreamError(f"bad content-length {headers['content-length'][:20]!r}") from None
            self._state = _LENGTH if self._remaining else _DONE
        else:
            self._state = _TO_CLOSE
            self._close_after = True
        head = Head(status, parts[2].decode("latin-1") if len(parts) > 2 else "", headers)
        assert self._head is not None and self._sink_for is not None
        self._sink = self._sink_for(head)
        if not self._head.done():
            self._head.set_result(head)
        if self._state == _DONE:
            self._finish()

    # -- the end of a response -------------------------------------------------------------------

    def _finish(self) -> None:
        self._state = _DONE
        self._sink = None
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        if self._close_after:
            self.close()

    def _fail(self, exc: BaseException) -> None:
        self._state = _DONE
        self._sink = None
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

    def __init__(self, url: str, ssl_context: ssl.SSLContext | bool, *, connections: int,
                 connect_timeout: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "localhost"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        default_port = 443 if self.tls else 80
        self.authority = self.host if self.port == default_port else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            self.authority = f"[{self.host}]" + ("" if self.port == default_port else f":{self.port}")
        self._ssl: ssl.SSLContext | None = None
        if self.tls:
            if isinstance(ssl_context, ssl.SSLContext):
                self._ssl = ssl_context
            elif ssl_context:
                self._ssl = ssl.create_default_context()
            else:
                self._ssl = ssl.create_default_context()
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
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
                StreamConnection, self.host, self.port, ssl=self._ssl,
                server_hostname=self.host if self._ssl is not None else None)
        return protocol

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


def post_request(pool: StreamPool, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """An HTTP/1.1 POST of a JSON ``body`` to ``path`` on ``pool``'s gateway, whole."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {pool.authority}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1") + body
