"""kvgw's HTTP/1.1 connection: an asyncio protocol on httptools' public parser callbacks.

Per request, once its head is complete, the connection picks one of three paths:
- the **lookup lane** (``lane.py``): an index-only lookup answered inside the protocol, no task;
- the **body intake** (``intake.py``): a large PUT's body read straight into the buffers the app keeps
  (and, through its threaded receive, into a worker thread that hashes and writes it);
- the **request cycle** (``cycle.py``): the ASGI app, for everything else (the control plane included).

Around them, per connection (defences and the answers kvgw gives below its APIs, ``limits.py``):
- a header deadline: from the connection's start, and from the first byte of each later request, the
  request head must be complete within ``header_timeout`` or the connection is closed (408 if some
  bytes came); idle keep-alive connections close after ``idle_timeout``;
- caps: at most ``max_connections`` in the process and ``max_connections_per_client`` from one client
  address; past either, 503 and close;
- bytes the parser rejects: 400 (414 for a target over ``max_url_bytes``), JSON or S3 XML as the
  request looks, then close;
- pipelining: a request that arrives while another is being answered waits (reading pauses) and is
  answered in order;
- flow control both ways: reading pauses while the app has ``HIGH_WATER`` body bytes unread, and a
  response waits while the transport's write buffer is over its limit;
- responses written once where small (``cycle.py``), files sent with ``sendfile(2)`` (``send_file``).

Everything runs on the event loop, except ``send_file``'s worker thread, which writes to a duplicate of
the socket's descriptor while the response it sends is the only writer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import ipaddress
import logging
import os
import select
from typing import TYPE_CHECKING, Any, cast

import httptools

from gateway.api.http import BODY_PARTS, THREADED_BODY, ZEROCOPY, plain_body_length
from gateway.dataplane.cycle import RequestCycle, log_access
from gateway.dataplane.intake import INTAKE_MIN_BYTES, BodyIntake
from gateway.dataplane.lane import LANE_BODY_LIMIT
from gateway.dataplane.limits import refusal

if TYPE_CHECKING:
    from gateway.dataplane.server import ServerState

log = logging.getLogger("kvgw.http")

SENDERS = 16  # threads sending files at once (each holds one response until its file is out)
_SENDERS = concurrent.futures.ThreadPoolExecutor(SENDERS, thread_name_prefix="kvgw-send")
INLINE_SEND_BYTES = 64 * 1024  # files up to this size are read and written on the event loop
ASGI_VERSION = {"version": "3.0", "spec_version": "2.4"}


def sends_files(mode: str, client: tuple[str, int] | None) -> bool:
    """Whether a connection offers ``sendfile`` answers (``Settings.send_files``). "auto": to peers on
    other hosts only. Over loopback the kernel copies the bytes anyway, and writing a populated mapping
    of the chunk cost ~0.67x the server CPU of sendfile per 8 MiB GET on these VMs (BENCHMARKS.md, "kvgw
    bench io"); to a network card sendfile saves that copy."""
    if mode != "auto":
        return mode == "always"
    if client is None:
        return False
    try:
        return not ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return True


class UrlTooLong(Exception):
    """Raised inside the parser's URL callback; answered 414."""


class SendFailed(Exception):
    """A file could not be sent whole (the client went away or stalled, the file was shorter)."""


class Connection(asyncio.Protocol):
    """One client connection (the server makes one per accepted socket)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self.client: tuple[str, int] | None = None
        self._server_address: tuple[str, int] | None = None
        self._scheme = "http"
        self._zerocopy = False  # files go out with sendfile (not over TLS)
        self.closing = False
        self.cycle: RequestCycle | None = None  # the request being answered
        self._queued: collections.deque[RequestCycle] = collections.deque()  # pipelined behind it
        self._receiving: RequestCycle | None = None  # the request whose body the parser is reading
        self._intake: BodyIntake | None = None  # ... through the body intake
        self._intake_reading = False  # ... which is the transport's protocol
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._lane_body: list[bytes] | None = None  # a lane request is being received
        self._lane_started = 0.0
        self._address: str | None = None  # counted under this client address while set
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = False  # a header deadline is armed
        self._got_bytes = False  # some byte arrived since it was armed
        self._read_paused = False
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- the connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        state = self.state
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        sockname = transport.get_extra_info("sockname")
        self._server_address = (str(sockname[0]), int(sockname[1])) if isinstance(sockname, tuple) else None
        tls = transport.get_extra_info("sslcontext") is not None
        self._scheme = "https" if tls else "http"
        self._zerocopy = (not tls and transport.get_extra_info("socket") is not None
                          and sends_files(state.send_files, self.client))
        address = self.client[0] if self.client else "?"
        limits = state.limits
        if len(state.connections) >= limits.max_connections:
            self._refuse(503, "ServiceUnavailable", "too many open connections to this gateway")
            return
        if state.open_by_client[address] >= limits.max_connections_per_client:
            self._refuse(503, "ServiceUnavailable", f"too many open connections from {address}")
            return
        state.connections.add(self)
        state.open_by_client[address] += 1
        self._address = address
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._disarm_header_timer()
        self._cancel_idle_timer()
        state = self.state
        state.connections.discard(self)
        if self._address is not None:
            state.open_by_client[self._address] -= 1
            if state.open_by_client[self._address] <= 0:
                del state.open_by_client[self._address]
            self._address = None
        if self._intake is not None:
            self._intake.lose()
        for cycle in (self.cycle, *self._queued):
            if cycle is not None:
                cycle.lose()
        self._queued.clear()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        state.connection_closed()

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: close ours (a request in flight sees a disconnect)

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        log.warning("%s: %s", code, message)
        if not self.closing:
            self.transport.write(refusal(status, code, message, s3=self._looks_s3()))
        self.close()

    def _looks_s3(self) -> bool:
        """Whether the request being received is an S3 SDK's (its errors then answer in S3's XML): it
        carries SigV4's marks (an ``AWS4-`` authorization, an ``x-amz-`` header, ``X-Amz-`` query
        parameters of a presigned URL) so far as it was parsed."""
        for name, value in self._headers:
            if name.startswith(b"x-amz-") or (name == b"authorization" and value.startswith((b"AWS4-", b"AWS "))):
                return True
        return b"X-Amz-" in self._url or b"x-amz-" in self._url

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else once the current answer is complete."""
        if self.cycle is None and self._lane_body is None and self._receiving is None:
            self.close()
            return
        for cycle in (self.cycle, *self._queued):
            if cycle is not None:
                cycle.keep_alive = False

    # -- reading ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            self._got_bytes = True
        self._cancel_idle_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, UrlTooLong):
                self._refuse(414, "URITooLong",
                             f"the request target is longer than {self.state.limits.max_url_bytes} bytes")
            else:
                log.error("HTTP parser callback failed", exc_info=exc.__context__ or exc)
                self._bad_request("the request could not be handled")
            return
        except httptools.HttpParserError as exc:
            self._bad_request(str(exc) or "malformed HTTP request")
            return
        except httptools.HttpParserUpgrade:
            self._bad_request("protocol upgrades are not supported")
            return
        intake = self._intake
        if intake is not None and not self._intake_reading and not self.closing:
            self._intake_reading = True
            self.transport.set_protocol(intake)

    def _bad_request(self, reason: str) -> None:
        self._disarm_header_timer()
        receiving = self._receiving
        if receiving is None and self.cycle is not None and not self.cycle.response_complete:
            # garbage behind a complete request still being answered: finish that answer, then close
            self.cycle.keep_alive = False
            for queued in self._queued:
                queued.keep_alive = False
            self.pause_reading()
            return
        if receiving is not None:
            receiving.lose()  # a body that broke mid-way: the app stores nothing, its answer is dropped
        self._refuse(400, "InvalidRequest", f"the HTTP request could not be parsed: {reason}")

    def pause_reading(self) -> None:
        if not self._read_paused and not self.closing:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and not self.closing and not self._queued:
            self._read_paused = False
            self.transport.resume_reading()

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._cancel_idle_timer()
        self._url.clear()
        self._headers = []
        if not self._awaiting_head:
            self._arm_header_timer()
        self._got_bytes = True

    def on_url(self, url: bytes) -> None:
        if len(self._url) + len(url) > self.state.limits.max_url_bytes:
            raise UrlTooLong()
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        method = self.parser.get_method().decode("ascii")
        raw_url = bytes(self._url)
        if self._lane_takes(method, raw_url):
            self._lane_body = []  # the header deadline stays armed until its (small) body is complete
            self._lane_started = self.state.lane.clock()  # type: ignore[union-attr]
            return
        self._disarm_header_timer()
        self._begin_cycle(method, raw_url, {})

    def _lane_takes(self, method: str, url: bytes) -> bool:
        lane = self.state.lane
        if lane is None or self.cycle is not None or self.write_paused or self.closing:
            return False
        parser = self.parser
        if parser.get_http_version() != "1.1" or not parser.should_keep_alive():
            return False
        if not url.startswith(b"/") or b"?" in url or b"#" in url:
            return False
        headers = self._headers
        for name, _ in headers:
            if name == b"expect":
                return False
        if not lane.takes(method, url.decode("latin-1")):
            return False
        length = plain_body_length(headers)
        return length is not None and length <= (LANE_BODY_LIMIT if method == "POST" else 0)

    def _begin_cycle(self, method: str, raw_url: bytes, notes: dict[str, Any]) -> RequestCycle:
        """The request whose head was just parsed, as a request cycle: started now, or queued behind
        the one being answered."""
        try:
            parsed: Any = httptools.parse_url(raw_url)  # also the absolute form (``http://host/path``)
        except httptools.HttpParserInvalidURLError:
            parsed = None
        raw_path = (parsed.path or b"/") if parsed is not None else raw_url
        try:
            path = raw_path.decode("ascii")
        except UnicodeDecodeError:
            path = raw_path.decode("latin-1")
        if "%" in path:
            from urllib.parse import unquote

            path = unquote(path)
        parser = self.parser
        expect_continue = any(name == b"expect" and value.lower() == b"100-continue" for name, value in self._headers)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": ASGI_VERSION,
            "http_version": parser.get_http_version(),
            "server": self._server_address,
            "client": self.client,
            "scheme": self._scheme,
            "method": method,
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": (parsed.query or b"") if parsed is not None else b"",
            "headers": self._headers,
            "state": {},
            "extensions": {ZEROCOPY: {}, BODY_PARTS: {}} if self._zerocopy else {BODY_PARTS: {}},
        }
        scope.update(notes)
        cycle = RequestCycle(self, scope, keep_alive=parser.should_keep_alive(), expect_continue=expect_continue)
        self._receiving = cycle
        if self.cycle is None:
            self._start(cycle)
            self._maybe_take_body(cycle)
        else:
            self._queued.append(cycle)  # pipelined: answered after the one in flight
            self.pause_reading()
        return cycle

    def _maybe_take_body(self, cycle: RequestCycle) -> None:
        """A large PUT's body goes through the body intake (``intake.py``)."""
        if cycle.scope["method"] != "PUT" or cycle.response_complete:
            return
        length = plain_body_length(self._headers)
        if length is None or length < INTAKE_MIN_BYTES:
            return
        intake = BodyIntake(self, cycle, length)
        cycle.intake = intake
        cycle.scope["extensions"][THREADED_BODY] = intake  # ``Request.threaded_body``
        self._intake = intake

    def _start(self, cycle: RequestCycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(cycle.run(self.state.app))
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    def on_body(self, body: bytes) -> None:
        if self._lane_body is not None:
            self._lane_body.append(body)
        elif self._intake is not None:
            self._intake.feed(body)
        elif self._receiving is not None:
            self._receiving.on_body(body)

    def on_message_complete(self) -> None:
        if self._lane_body is not None:
            self._answer_on_lane()
            return
        self._intake = None  # a body that ended within the bytes the parser had
        receiving, self._receiving = self._receiving, None
        if receiving is not None:
            receiving.on_body_complete()

    def intake_done(self) -> None:
        """The intake read the body's last byte: the transport and a fresh parser for the next
        request, and the end of the body for the request cycle, as the parser would have told it."""
        self._intake_reading = False
        self._intake = None
        if self.closing:
            return
        self.transport.set_protocol(self)
        self.parser = httptools.HttpRequestParser(self)
        receiving, self._receiving = self._receiving, None
        if receiving is not None:
            receiving.on_body_complete()

    # -- the lookup lane -------------------------------------------------------------------------

    def _answer_on_lane(self) -> None:
        assert self._lane_body is not None and self.state.lane is not None
        self._disarm_header_timer()
        body = b"".join(self._lane_body)
        self._lane_body = None
        method = self.parser.get_method().decode("ascii")
        raw_url = bytes(self._url)
        notes: dict[str, Any] = {}
        try:
            answered = self.state.lane.answer(method, raw_url.decode("latin-1"), self._headers, body,
                                              self.state.common.lines(), self._lane_started, notes)
        except Exception:
            log.exception("the lookup lane failed; the request goes to the ASGI app")
            answered, notes = None, {}
        if answered is None:
            cycle = self._begin_cycle(method, raw_url, notes)  # as if the lane were not here
            if body:
                cycle.on_body(body)
            self._receiving = None
            cycle.on_body_complete()
            return
        status, response = answered
        self.transport.write(response)
        if self.state.access_log:
            self._log_lane(method, raw_url, status, response)
        self._arm_idle_timer()

    def _log_lane(self, method: str, raw_url: bytes, status: int, response: bytes) -> None:
        head = response.partition(b"\r\n\r\n")[0].lower()
        marker = head.find(b"request-id: ")
        request_id = head[marker + 12:].partition(b"\r\n")[0].decode("latin-1") if marker >= 0 else None
        log_access(self, {"method": method, "raw_path": raw_url, "query_string": b"", "http_version": "1.1"},
                   status, request_id)

    # -- answering -------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:
            self.transport.write(data)

    def writelines(self, parts: list[Any]) -> None:
        if not self.closing:
            self.transport.writelines(parts)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait while the transport holds more than its write limit (the client reads slowly)."""
        while self.write_paused and not self.closing:
            if self._drained is None or self._drained.done():
                self._drained = self.loop.create_future()
            await self._drained

    async def send_file(self, prefix: bytes, fd: int, offset: int, count: int, suffix: bytes) -> None:
        """``prefix``, ``count`` bytes of file ``fd`` from ``offset``, then ``suffix``, in this order on
        the connection. Large files go from the page cache to the socket by ``sendfile(2)`` in a worker
        thread (the event loop does nothing per byte and never waits for the disk); the transport's
        buffer is empty first, so nothing overtakes. A client that goes away or stops reading for
        ``send_stall_timeout`` ends the connection (its response cannot be finished)."""
        if self.closing:
            return
        if count <= INLINE_SEND_BYTES:
            data = os.pread(fd, count, offset)
            if len(data) != count:
                self._abort("the file to send is shorter than expected")
                return
            self.write(b"".join((prefix, data, suffix)))
            if self.write_paused:
                await self.drain()
            return
        await self._flushed()
        if self.closing:
            return
        sock = self.transport.get_extra_info("socket")
        out = os.dup(sock.fileno())  # ours until the thread ends, whatever the transport does meanwhile
        try:
            await self.loop.run_in_executor(_SENDERS, _send_in_thread, out, prefix, fd, offset, count, suffix,
                                            self.state.limits.send_stall_timeout)
        except SendFailed as exc:
            self._abort(str(exc))
        finally:
            os.close(out)

    async def _flushed(self) -> None:
        """Wait until the transport has written everything it holds."""
        transport = self.transport
        if not transport.get_write_buffer_size():
            return
        limits = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0)
        try:
            while transport.get_write_buffer_size() and not self.closing:
                self.write_paused = True
                await self.drain()
        finally:
            transport.set_write_buffer_limits(high=limits[1], low=limits[0])

    def _abort(self, why: str) -> None:
        log.warning("connection from %s ended mid-response: %s", self.client, why)
        self.closing = True
        self.transport.abort()

    def on_response_complete(self, cycle: RequestCycle) -> None:
        """``cycle`` answered: close, or go on with the next request."""
        if cycle is not self.cycle:
            return
        self.cycle = None
        if self.closing:
            return
        if not cycle.keep_alive:
            self.close()
            return
        if not cycle.body_complete and cycle is self._receiving:
            # answered before its body ended (an error, a stall): the rest of that body would be parsed
            # as the next request, and a stalled client would hold the connection for ever
            self.close()
            return
        if self._queued:
            nxt = self._queued.popleft()
            self.resume_reading()  # once none is left waiting
            self._start(nxt)
            return
        self.resume_reading()
        self._arm_idle_timer()

    # -- deadlines -------------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._awaiting_head = True
        self._got_bytes = False
        self._header_timer = self.loop.call_later(self.state.limits.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        self._awaiting_head = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.closing:
            return
        if not self._got_bytes:
            self.close()  # a connection that never sent a byte: nothing to answer
            return
        self._refuse(408, "RequestTimeout",
                     f"the request head was not complete within {self.state.limits.header_timeout:g} s")

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        if self.state.stopping:
            self.close()
            return
        self._idle_timer = self.loop.call_later(self.state.limits.idle_timeout, self.close)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


def _send_in_thread(out: int, prefix: bytes, fd: int, offset: int, count: int, suffix: bytes,
                    stall_timeout: float) -> None:
    """``Connection.send_file``'s thread: write to ``out`` (a non-blocking socket), waiting with poll(2)
    whenever it is full; SendFailed if the peer went away, stalled, or the file ended early."""
    poller = select.poll()
    poller.register(out, select.POLLOUT)

    def wait() -> None:
        if not poller.poll(stall_timeout * 1000):
            raise SendFailed(f"the client read nothing for {stall_timeout:g} s")

    def send_bytes(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(out, view):]
            except BlockingIOError:
                wait()

    try:
        send_bytes(prefix)
        end = offset + count
        while offset < end:
            try:
                sent = os.sendfile(out, fd, offset, end - offset)
            except BlockingIOError:
                wait()
                continue
            if sent == 0:
                raise SendFailed("the file to send is shorter than expected")
            offset += sent
        send_bytes(suffix)
    except OSError as exc:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            raise SendFailed(f"the client went away ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None
        raise
