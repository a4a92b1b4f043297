"""Minimal raw-ASGI request/response helpers for the data-plane APIs.

The native and S3 APIs are plain ASGI callables rather than FastAPI routes: their hottest calls (HEAD,
exists, prefix) are small, and routing plus dependency injection per request costs several times the
work itself (measured: a bare ASGI route answers small requests ~3.7x faster). FastAPI serves the
control plane and the OpenAPI description (``gateway.app``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from email.utils import formatdate
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote, unquote_to_bytes

import orjson

from gateway.chunks import MAX_TTL_SECONDS, ByteRange, ThreadedBody, ThreadedOutcome
from gateway.errors import IncompleteBody, InvalidRequest, MissingContentLength
from gateway.logs import current_request_id

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
RawHeaders = list[tuple[bytes, bytes]]  # a request's, as the ASGI scope holds them (names lowercased)


def plain_body_length(headers: RawHeaders) -> int | None:
    """The body length a request head announces when it is plain: its one ``Content-Length`` (0 without
    one). None when it is not: a ``Transfer-Encoding``, a repeated or non-numeric ``Content-Length``
    (the protocol-level fast paths leave such requests to the request cycle, which answers or refuses them)."""
    length = None
    for name, value in headers:
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            return None
    return 0 if length is None else length


_request_ids = itertools.count(1)
_REQUEST_ID_PREFIX = os.urandom(4).hex()


def new_request_id() -> str:
    return f"{_REQUEST_ID_PREFIX}{next(_request_ids):010x}"


def http_date(ts: float) -> str:
    """An IMF-fixdate (``Last-Modified``): HTTP dates have whole seconds, so one per second is formatted."""
    return _http_date_of_second(int(ts))


@functools.lru_cache(maxsize=4096)
def _http_date_of_second(second: int) -> str:
    return formatdate(second, usegmt=True)


THREADED_BODY = "kvgw.threaded_body"
"""The scope extension under which the body intake offers itself as a ``ThreadedBody`` (``threaded_body``)."""

ZEROCOPY = "http.response.zerocopysend"
"""The ASGI extension (``scope["extensions"]``, and the message type) for sending bytes of an open file
without reading them into Python: kvgw's HTTP server offers it on connections that can (not over TLS)."""


BODY_PARTS = "kvgw.response.parts"
"""kvgw's extension (``scope["extensions"]``, and the message type): a body message whose ``parts`` (a
list of bytes-like objects) leave in one write, as the body ``b"".join(parts)`` would but without the
copy: batch-get sends many small frames (header and payload) per write. The parts must stay valid until
the ``send`` returns."""


def takes_parts(scope: Scope) -> bool:
    """Whether the server answering ``scope`` takes ``BODY_PARTS`` messages."""
    extensions = scope.get("extensions")
    return extensions is not None and BODY_PARTS in extensions


def sends_files(scope: Scope) -> bool:
    """Whether the server answering ``scope`` takes ``ZEROCOPY`` messages."""
    extensions = scope.get("extensions")
    return extensions is not None and ZEROCOPY in extensions


RETRIED = "kvgw.retried"
"""Scope key an API sets to True when the client marked the request as a retry of an earlier attempt
(``gateway.metrics`` counts it in ``kvgw_retried_requests``)."""


class IndexedAnswer(NamedTuple):
    """A complete answer an API found without awaiting anything (``answer_indexed``: the lookup lane,
    ``gateway.dataplane.lane``)."""

    op: str  # the operation's metrics name (``gateway.metrics``)
    headers: Headers  # content-length included (a HEAD's names the object's size)
    body: bytes
    status: int = 200
    retried: bool = False  # the client marked the request as a retry (``RETRIED``)


class Request:
    """A view of an ASGI HTTP request with lazily decoded headers and a streaming body."""

    __slots__ = ("_headers", "body_broken", "body_consumed", "body_ended", "body_received", "method",
                 "query_string", "raw_path", "receive", "request_id", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        raw = scope.get("raw_path")
        self.raw_path: str = raw.decode("latin-1") if raw else scope["path"]
        self.query_string: str = scope.get("query_string", b"").decode("latin-1")
        self._headers: dict[str, str] | None = None
        self.request_id = new_request_id()
        current_request_id.set(self.request_id)  # log records of this request carry it (gateway.logs)
        self.body_consumed = False  # the app started reading the body
        self.body_ended = False  # its last message arrived
        self.body_received = 0  # bytes of it so far
        self.body_broken = False  # it stalled or the client went away (IncompleteBody was raised)

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            # repeated headers are joined as RFC 9110 allows
            merged: dict[str, str] = {}
            for name, value in self.scope["headers"]:
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                merged[key] = f"{merged[key]},{text}" if key in merged else text
            self._headers = merged
        return self._headers

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def content_length(self) -> int:
        raw = self.header("content-length")
        if raw is None:
            raise MissingContentLength()
        if not raw.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        return int(raw)

    @property
    def expects_continue(self) -> bool:
        return (self.header("expect") or "").lower() == "100-continue"

    async def body(self, idle_timeout: float) -> AsyncIterator[bytes]:
        """The body as it arrives. IncompleteBody if the client disconnects or stalls mid-body."""
        self.body_consumed = True
        more = True
        while more:
            piece, more = await self._receive_body(idle_timeout)
            if piece:
                yield piece

    def threaded_body(self) -> ThreadedBody | None:
        """The body as a ``ThreadedBody`` (``gateway.dataplane.intake``'s threaded receives) when the body
        intake takes it, else None; what it receives counts as received, as ``body`` counts."""
        extensions = self.scope.get("extensions") or {}
        intake: ThreadedBody | None = extensions.get(THREADED_BODY)
        return None if intake is None else _CountedThreadedBody(self, intake)

    async def read_body(self, limit: int, idle_timeout: float = 30.0) -> bytes:
        """The whole body, at most ``limit`` bytes. No async generator: exists / prefix read a small
        body per call (almost always one message, returned without a copy)."""
        self.body_consumed = True
        pieces: list[bytes] = []
        size = 0
        more = True
        while more:
            piece, more = await self._receive_body(idle_timeout)
            size += len(piece)
            if size > limit:
                raise InvalidRequest(f"request body larger than {limit} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def _receive_body(self, idle_timeout: float) -> tuple[bytes, bool]:
        """The next piece of the body and whether more follows."""
        try:
            async with asyncio.timeout(idle_timeout):  # unlike wait_for, no task per message
                message = await self.receive()
        except TimeoutError:
            self.body_broken = True
            raise IncompleteBody(f"no body bytes for {idle_timeout:g} s") from None
        if message["type"] == "http.disconnect":
            self.body_broken = True
            raise IncompleteBody("the client disconnected before the body was complete")
        piece: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        self.body_received += len(piece)
        self.body_ended = not more
        return piece, more

    async def read_json(self, limit: int) -> Any:
        raw = await self.read_body(limit)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest("request body is not valid JSON") from exc

    async def drain(self, limit: int) -> bool:
        """Read and drop an unread body of at most ``limit`` bytes, so the connection can be reused.

        False when the rest of the body is larger than ``limit`` or was never going to come (the client
        waits for ``100 Continue``): the response must then close the connection. A body the app
        stopped reading part-way (a write that failed mid-body) is drained from where it stopped; one
        that stalled or whose client went away is not waited for again.
        """
        if self.body_ended:
            return True
        if self.body_broken or (self.expects_continue and not self.body_consumed):
            return False
        raw = self.header("content-length")
        if raw is None and self.header("transfer-encoding") is None:
            return True  # the request has no body
        if raw is None or not raw.isdigit() or int(raw) - self.body_received > limit:
            return False
        try:
            while not self.body_ended:
                await self._receive_body(10.0)
        except IncompleteBody:
            return False
        return True


class _CountedThreadedBody:
    """A ``ThreadedBody`` whose pieces count towards the request's ``body_received`` (``drain``)."""

    def __init__(self, req: Request, body: ThreadedBody) -> None:
        self._req = req
        self._body = body

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        req = self._req
        req.body_consumed = True

        def counted(piece: memoryview) -> None:
            consume(piece)
            req.body_received += len(piece)

        return await self._body.consume_in_thread(counted)


def path_segment(raw: str, errors: str = "strict") -> str:
    """Percent-decode a raw path (or part of one) as UTF-8; ValueError if it is not valid UTF-8 and
    ``errors`` is "strict" (another ``errors`` decodes the ASCII characters as ``unquote`` does).

    ``urllib.parse.unquote``'s result at half its cost for what the wire holds (ASCII): the lookup lane
    decodes a percent-encoded path up to three times per S3 HEAD (routing, then bucket and key), ~2.2
    µs each with ``unquote`` (``kvgw bench head``)."""
    if "%" not in raw:
        return raw
    if raw.isascii():
        return unquote_to_bytes(raw.encode("ascii")).decode("utf-8", errors)
    return unquote(raw, encoding="utf-8", errors=errors)


async def send_response(send: Send, status: int, headers: Headers, body: bytes = b"") -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def json_body(doc: Any) -> bytes:
    return orjson.dumps(doc)


class ResponseState:
    """Tracks whether a response has started, so an error after that point is not sent twice."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class Body(Protocol):
    """Response bytes ``[offset, offset+length)`` of something, held whole (``data``), streamed in
    pieces (iteration) or in an open file (``fd``, sent with ``sendfile``); the service's ChunkBody."""

    data: bytes | memoryview | None
    fd: int | None
    offset: int
    length: int

    def fileno(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[bytes | memoryview]: ...


async def send_body(send: Send, headers: Headers, body: Body, *, range_of: int | None = None) -> None:
    """200 with the body; ``range_of``: the body is a range of that many bytes (206, Content-Range)."""
    headers.append((b"content-length", str(body.length).encode()))
    status = 200
    if range_of is not None:
        status = 206
        last = body.offset + body.length - 1
        headers.append((b"content-range", f"bytes {body.offset}-{last}/{range_of}".encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if body.data is not None:
        await send({"type": "http.response.body", "body": body.data})
        return
    if body.fd is not None:
        await send({"type": ZEROCOPY, "file": body, "offset": body.offset, "count": body.length})
        return
    async for piece in body:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def parse_range(raw: str | None) -> ByteRange | None:
    """One ``bytes=`` range as (first, last), either may be None (suffix / open end); None to serve
    the whole body, also for forms we do not serve (RFC 9110 lets a server ignore such a Range)."""
    if raw is None:
        return None
    unit, _, spec = raw.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    first, last = first.strip(), last.strip()
    if not dash or not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if first == "" and last == "":
        return None
    start = int(first) if first else None
    end = int(last) if last else None
    if start is not None and end is not None and end < start:
        return None
    return start, end


def parse_ttl(raw: str | None) -> int | None:
    """A TTL header (``X-Kvgw-TTL``): whole seconds, 1 to ``MAX_TTL_SECONDS``; None when absent."""
    if raw is None:
        return None
    if not raw.isdigit() or not 0 < int(raw) <= MAX_TTL_SECONDS:
        raise InvalidRequest(f"TTL must be a whole number of seconds between 1 and {MAX_TTL_SECONDS}")
    return int(raw)
