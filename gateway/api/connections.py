"""Connection-level defences, below the ASGI apps: slow or idle clients, too many connections, bytes
the HTTP parser rejects.

uvicorn's httptools protocol arms a timer only between requests (keep-alive), so a client that opens a
connection and sends nothing, or half a request line, holds its socket and memory for ever; it
answers unparseable requests with a plain-text 400 that carries no request id. This protocol (a
subclass of the one-write protocol in ``holding.py``) adds, per connection:

- a header deadline: from the connection's start, and from the first byte of each later request, the
  request head must be complete within ``header_timeout`` seconds or the connection is closed (the
  body has its own idle deadline in the apps, ``body_idle_timeout``); idle keep-alive connections close
  after ``idle_timeout`` (uvicorn's keep-alive timer);
- caps: at most ``max_connections`` in the process and ``max_connections_per_client`` from one client
  address; past either, the connection gets ``503 ServiceUnavailable`` and is closed at once;
- every answer given here is kvgw's documented JSON error (``{"error": {"code", "message",
  "request_id"}}``, ``x-kvgw-request-id``, ``connection: close``), like every other error.

Runs on the event loop only (uvicorn calls every method there); the counters are per process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson

from gateway.api.holding import HoldingHttpToolsProtocol
from gateway.api.http import new_request_id

log = logging.getLogger("kvgw.connections")

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 414: b"URI Too Long", 503: b"Service Unavailable"}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds for a request head, from the connection's or request's first byte
    idle_timeout: float = 30.0  # seconds a keep-alive connection may wait for its next request
    max_connections: int = 10_000  # open connections per process
    max_connections_per_client: int = 1_000  # open connections per client address, per process
    max_url_bytes: int = 16 * 1024  # request target (path and query); S3 keys are at most 1 KiB (3 KiB encoded)


def error_response(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying kvgw's JSON error, for a connection about to close."""
    request_id = new_request_id()
    body = orjson.dumps({"error": {"code": code, "message": message, "request_id": request_id}})
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-kvgw-request-id: %s\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], len(body), request_id.encode()))
    return head + body


class UrlTooLong(Exception):
    """Raised inside the parser's URL callback; answered 414."""


class GuardedHttpProtocol(HoldingHttpToolsProtocol):
    """The one-write protocol plus the defences above (served as ``gateway.api.lane.protocol_class``)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    open_by_client: ClassVar[collections.Counter[str]] = collections.Counter()
    open_total: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._address: str | None = None  # counted under this address while set
        self._awaiting_head = False  # a header deadline is armed
        self._got_bytes = False  # some byte arrived since it was armed

    # -- connection caps -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else "?"
        cls = type(self)
        if cls.open_total >= self.limits.max_connections:
            self._refuse(503, "ServiceUnavailable", "too many open connections to this gateway")
            return
        if cls.open_by_client[address] >= self.limits.max_connections_per_client:
            self._refuse(503, "ServiceUnavailable", f"too many open connections from {address}")
            return
        cls.open_total += 1
        cls.open_by_client[address] += 1
        self._address = address
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._address is not None:
            cls = type(self)
            cls.open_total -= 1
            cls.open_by_client[self._address] -= 1
            if cls.open_by_client[self._address] <= 0:
                del cls.open_by_client[self._address]
            self._address = None
        super().connection_lost(exc)

    def _refuse(self, status: int, code: str, message: str) -> None:
        log.warning("%s: %s", code, message)
        self.transport.write(error_response(status, code, message))
        self.transport.close()

    # -- header deadline -------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._awaiting_head = True
        self._got_bytes = False
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        self._awaiting_head = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._got_bytes:
            self.transport.close()  # a connection that never sent a byte: nothing to answer
            return
        self._refuse(408, "RequestTimeout",
                     f"the request head was not complete within {self.limits.header_timeout:g} s")

    def on_message_begin(self) -> None:
        """The parser saw the first byte of a request: its head is due within the header timeout (the
        first request's deadline runs from the connection's start)."""
        super().on_message_begin()
        if not self._awaiting_head:
            self._arm_header_timer()
        self._got_bytes = True

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        cycle = self.cycle  # the answered request's, unless another one is pipelined behind it
        super().on_response_complete()
        if cycle is not None and cycle.response_complete and cycle.more_body and not self.transport.is_closing():
            # answered before its body ended (an error, a stall): the rest of that body would be
            # parsed as the next request, and a stalled client would hold the connection for ever.
            # (A request pipelined behind the answered one has not been answered: its body, still
            # arriving, is no reason to close; the answered one's body ended before its head came.)
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.max_url_bytes:
            raise UrlTooLong()
        super().on_url(url)

    # -- bytes the parser rejects ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            self._got_bytes = True
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, UrlTooLong):
                self._refuse(414, "URITooLong", f"the request target is longer than {self.limits.max_url_bytes} bytes")
            else:
                self._bad_request(str(exc.__context__ or exc))
        except httptools.HttpParserError as exc:
            self._bad_request(str(exc) or "malformed HTTP request")
        except httptools.HttpParserUpgrade:
            self._bad_request("protocol upgrades are not supported")

    def _bad_request(self, reason: str) -> None:
        self._disarm_header_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            # garbage behind a complete request still being answered: finish that answer, then close
            cycle.keep_alive = False
            self.transport.pause_reading()
            return
        if cycle is not None and not cycle.response_complete:
            # a body that broke mid-way: the app sees a disconnect (so it stores nothing and its own
            # answer is dropped), and the client gets this one
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(400, "InvalidRequest", f"the HTTP request could not be parsed: {reason}")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's own plain-text 400 (non-ASCII header bytes and the like), as kvgw's JSON error."""
        self._refuse(400, "InvalidRequest", msg)

