"""One request's ASGI cycle: ``receive`` and ``send`` between a connection (``protocol.Connection``) and
the app, for every request the lookup lane does not answer itself.

What a caller must know:
- The response head is held until the first body message, so a response with one body message leaves
  in one write with a ``content-length`` the app need not set; a response whose length is not known
  up front (more body messages, no ``content-length``) is sent chunked (HTTP/1.1) or close-delimited.
- ``http.response.zerocopysend`` (the ASGI extension, advertised in ``scope["extensions"]`` when the
  connection can send files: not over TLS) sends ``count`` bytes of an open file from ``offset`` with
  ``sendfile(2)`` in a worker thread: the bytes go from the page cache to the socket without entering
  Python (``Connection.send_file``).
- ``kvgw.response.parts`` (``gateway.api.http.BODY_PARTS``, always advertised): a body message of many
  buffers written in one ``writelines``, as one chunk of a chunked answer.
- Every response carries a request id: ``x-kvgw-request-id`` unless the app set it or S3's
  ``x-amz-request-id``.
- A client gone away: ``receive`` answers ``http.disconnect`` and ``send`` drops what it is given.
- Body bytes beyond ``HIGH_WATER`` not yet received by the app pause reading the socket.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.api.http import BODY_PARTS, ZEROCOPY, Message, Scope, new_request_id
from gateway.dataplane.heads import status_line
from gateway.dataplane.limits import refusal
from gateway.logs import current_request_id

if TYPE_CHECKING:
    from gateway.dataplane.intake import BodyIntake
    from gateway.dataplane.protocol import Connection

log = logging.getLogger("kvgw.http")
access = logging.getLogger("kvgw.access")

HIGH_WATER = 64 * 1024  # body bytes held for the app before reading pauses
NO_BODY_STATUS = frozenset({204, 304})
LARGE_BODY = 64 * 1024  # from this size a body is written beside its head (writev), not joined to it

ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class RequestCycle:
    """One request: its scope, the body as it arrives, and the response as the app sends it."""

    __slots__ = ("_body", "_body_event", "_chunked", "_end_delivered", "_head_pending", "_headers", "_status",
                 "body_complete",
                 "conn", "disconnected", "head_request", "intake", "keep_alive", "response_complete",
                 "response_started", "scope", "started", "waiting_for_100_continue")

    def __init__(self, conn: Connection, scope: Scope, *, keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_continue
        self.head_request = scope["method"] == "HEAD"
        self.intake: BodyIntake | None = None  # the body intake reads this request's body
        self.started = conn.state.clock()
        self.disconnected = False
        self.body_complete = False
        self.response_started = False
        self.response_complete = False
        self._body: list[bytes] = []
        self._end_delivered = False  # the app was told the body ended
        self._body_event: asyncio.Event | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_pending = False
        self._chunked = False

    # -- the request body, from the connection ---------------------------------------------------

    def on_body(self, data: bytes) -> None:
        self._body.append(data)
        if sum(map(len, self._body)) > HIGH_WATER:
            self.conn.pause_reading()
        self._wake()

    def on_body_complete(self) -> None:
        self.body_complete = True
        self._wake()

    def lose(self) -> None:
        """The connection is gone."""
        self.disconnected = True
        if self.intake is not None:
            self.intake.lose()
        self._wake()

    def _wake(self) -> None:
        if self._body_event is not None:
            self._body_event.set()

    # -- the app's side ----------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.intake is not None:
            return await self.intake.receive()
        return await self.receive_after_intake()

    async def receive_after_intake(self) -> Message:
        """``receive`` once no intake stands between the app and the body (or the intake handed all of
        it over): the body as it arrived, then, once its end was delivered, ``http.disconnect`` when the
        client goes away or the response is complete (what an app waiting for a disconnect needs)."""
        self.send_continue()
        while not (self._body or self.body_complete or self.disconnected or self.response_complete):
            await self._wait()
        if self._body:
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._body.clear()
            self.conn.resume_reading()
            self._end_delivered = self.body_complete
            return {"type": "http.request", "body": body, "more_body": not self.body_complete}
        if self.body_complete and not self._end_delivered and not self.disconnected:
            self._end_delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        while not self.disconnected and not self.response_complete:
            await self._wait()
        return {"type": "http.disconnect"}

    async def _wait(self) -> None:
        if self._body_event is None:
            self._body_event = asyncio.Event()
        self._body_event.clear()
        await self._body_event.wait()

    def send_continue(self) -> None:
        """``100 Continue`` on the app's first ``receive``, if the client waits for it."""
        if self.waiting_for_100_continue and not self.response_started and not self.conn.closing:
            self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.waiting_for_100_continue = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if self.disconnected or self.response_complete:
            if self.response_complete and not self.disconnected:
                raise RuntimeError(f"{kind} after the response was complete")
            return
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self.response_started = True
            self.waiting_for_100_continue = False
            self._status = message["status"]
            self._headers = list(message.get("headers", ()))
            self._head_pending = True
            return
        if not self.response_started:
            raise RuntimeError(f"{kind} before http.response.start")
        more = bool(message.get("more_body", False))
        if kind == "http.response.body":
            body = message.get("body", b"")
            await self._send_parts((body,) if body else (), more)
        elif kind == BODY_PARTS:
            await self._send_parts(message["parts"], more)
        elif kind == ZEROCOPY:
            await self._send_file(message["file"], message.get("offset"), message.get("count"), more)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not more:
            self._complete()

    async def _send_parts(self, parts: Sequence[bytes | bytearray | memoryview], more: bool) -> None:
        """One body message of ``parts`` (none: an empty body), in one write: one chunk when chunked."""
        conn = self.conn
        size = sum(memoryview(part).nbytes for part in parts)
        if self._head_pending:
            head = self._head(None if more else size)
            if self.head_request or not size:
                conn.write(head if more or not self._chunked else head + b"0\r\n\r\n")
                self._chunked = self._chunked and more  # the terminator went with the head
                return
            framed = (b"%x\r\n" % size, *parts, b"\r\n0\r\n\r\n" if not more else b"\r\n") if self._chunked else (
                *parts,)
            if size < LARGE_BODY:
                conn.write(b"".join((head, *framed)))
            else:
                conn.writelines([head, *framed])
        elif self.head_request:
            pass
        elif self._chunked:
            if size:
                conn.writelines([b"%x\r\n" % size, *parts, b"\r\n0\r\n\r\n" if not more else b"\r\n"])
            elif not more:
                conn.write(b"0\r\n\r\n")
            self._chunked = more
        elif size:
            if len(parts) == 1:
                conn.write(parts[0])
            else:
                conn.writelines(list(parts))
        if conn.write_paused:
            await conn.drain()

    async def _send_file(self, file: Any, offset: int | None, count: int | None, more: bool) -> None:
        if count is None:
            raise RuntimeError("zerocopysend without a count")
        offset = offset or 0
        head = self._head(None if more else count) if self._head_pending else b""
        if self.head_request:
            if head:
                self.conn.write(head)
            return
        prefix = head + (b"%x\r\n" % count if self._chunked and count else b"")
        suffix = (b"\r\n" if count else b"") + (b"0\r\n\r\n" if not more else b"") if self._chunked else b""
        if not more:
            self._chunked = False
        await self.conn.send_file(prefix, file.fileno(), offset, count, suffix)

    def _head(self, complete_length: int | None) -> bytes:
        """The response head; ``complete_length``: the body's length when the first body message is the
        last one (a content-length is added if the app gave none)."""
        self._head_pending = False
        status = self._status
        has_length = has_id = False
        parts = [status_line(status), self.conn.state.common.lines()]
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"content-length":
                has_length = True
            elif lowered == b"transfer-encoding":
                has_length = True  # the app frames the body itself
            elif lowered == b"connection":
                if value.lower() == b"close":
                    self.keep_alive = False
                continue
            elif lowered in (b"x-kvgw-request-id", b"x-amz-request-id"):
                has_id = True
            parts += (name, b": ", value, b"\r\n")
        if not has_id:
            parts += (b"x-kvgw-request-id: ", new_request_id().encode(), b"\r\n")
        if not has_length and status not in NO_BODY_STATUS and status >= 200:
            if complete_length is not None:
                if not self.head_request:
                    parts += (b"content-length: ", str(complete_length).encode(), b"\r\n")
            elif self.head_request:
                pass
            elif self.scope["http_version"] == "1.1":
                parts.append(b"transfer-encoding: chunked\r\n")
                self._chunked = True
            else:
                self.keep_alive = False  # HTTP/1.0: the body ends where the connection does
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _complete(self) -> None:
        self.response_complete = True
        self._wake()
        if self.conn.state.access_log:
            self._log_access()
        self.conn.on_response_complete(self)

    def _log_access(self) -> None:
        request_id = next((value.decode("latin-1") for name, value in self._headers
                           if name.lower() in (b"x-kvgw-request-id", b"x-amz-request-id")), None)
        log_access(self.conn, self.scope, self._status, request_id)

    # -- running the app ---------------------------------------------------------------------------

    async def run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("unhandled error in %s %s", self.scope["method"], self.scope["path"])
            self._failed()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not self.response_complete:
            if self.response_started or not self.disconnected:
                log.error("%s %s returned without completing its response", self.scope["method"], self.scope["path"])
            self._failed()

    def _failed(self) -> None:
        """The app raised or returned without finishing its answer: a 500 if nothing was sent yet, else
        the connection closes (the client sees a cut-short body, never a wrong one)."""
        conn = self.conn
        if self.disconnected or conn.closing:
            return
        if not self.response_started:
            self.response_started = self.response_complete = True
            conn.write(refusal_500())
            conn.close()
            return
        self.response_complete = True
        conn.close()


def refusal_500() -> bytes:
    """kvgw's InternalError for a request whose app failed before answering (never a traceback)."""
    return refusal(500, "InternalError", "internal error")


def log_access(conn: Connection, scope: Scope, status: int, request_id: str | None) -> None:
    """One access-log line (``KVGW_ACCESS_LOG``), carrying the request's id like its other records."""
    token = current_request_id.set(request_id)
    try:
        client = conn.client
        target = scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        access.info('%s - "%s %s HTTP/%s" %d', f"{client[0]}:{client[1]}" if client else "-", scope["method"], target,
                    scope["http_version"], status)
    finally:
        current_request_id.reset(token)
