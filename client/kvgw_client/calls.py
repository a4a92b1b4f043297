"""Small calls made on the calling thread, over blocking keep-alive connections: how a plain thread's
lookup (``KvgwClient.blocking.exists`` / ``prefix``: LMCache's connector, SGLang's backend) reaches
the gateway without handing the call to the client's I/O loop and back.

Why: through the I/O loop a blocking lookup crosses threads twice (the loop's self-pipe to wake it, a
futex to wake the caller), and on these VMs those wake-ups cost more than the lookup itself: the
client's ``exists`` of 64 keys waited 3.2-3.5x what the same call costs on a socket (BENCHMARKS.md,
"kvgw bench floor"). Here the caller writes the request and reads the answer itself (``send`` and
``recv_into`` into the same ``response.ResponseReader`` batch-get streams use).

What a caller must know:
- Any thread may call ``exchange``; each takes an idle connection (or opens one) and gives it back when
  its answer ended cleanly, so threads never share a connection. A thread has at most one call in
  flight, so there are at most as many connections as threads looking up at once, and all are kept
  (up to ``MAX_IDLE``): keeping fewer would open and close one per call whenever more threads look up
  together, each leaving a socket in TIME_WAIT. The gateway closes those idle too long.
- ``timeout`` bounds the whole exchange (connecting, sending, reading); errors surface as ``OSError`` /
  ``TimeoutError`` / ``StreamError`` (``policy.translated`` turns them into client errors).
- A kept connection the gateway closed while it sat idle (its keep-alive timeout) fails before any
  byte of the answer: the request is sent again once, on a new connection (these calls change nothing
  the second sending could double).
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable

from kvgw_client.endpoint import Endpoint
from kvgw_client.response import BodySink, Head, ResponseReader


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = ResponseReader()

    def exchange(self, request: bytes, sink_for: Callable[[Head], BodySink], deadline: float) -> Head:
        """Send ``request`` and read its whole answer by ``deadline`` (``time.monotonic``). Raises
        ``_NothingAnswered`` when the connection turned out closed before any byte of the answer arrived."""
        reader = self.reader
        reader.start(sink_for)
        self._wait_until(deadline)
        try:
            self.sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _NothingAnswered() from exc
        answered = False
        while not reader.complete:
            self._wait_until(deadline)
            try:
                n = self.sock.recv_into(reader.buffer())
            except ConnectionResetError as exc:
                if answered:
                    raise
                raise _NothingAnswered() from exc
            if not n:
                if reader.closed():
                    break
                if answered:
                    raise ConnectionResetError("the gateway closed the connection mid-response")
                raise _NothingAnswered()
            answered = True
            reader.updated(n)
        assert reader.head is not None
        return reader.head

    def _wait_until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        self.sock.settimeout(left)

    @property
    def reusable(self) -> bool:
        return self.reader.complete and not self.reader.close_after

    def close(self) -> None:
        self.sock.close()


class _NothingAnswered(ConnectionResetError):
    """The connection was closed (or reset) before any byte of the answer."""


MAX_IDLE = 256
"""Connections kept for the next call: a guard only (one per thread that looks up at once)."""


class BlockingCalls:
    """Keep-alive connections to one gateway for calls made on callers' threads."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._idle: collections.deque[_Connection] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def exchange(self, request: bytes, sink_for: Callable[[Head], BodySink], timeout: float) -> Head:
        """Send ``request`` (a whole HTTP/1.1 request) and read its whole answer, whose body goes to
        the sink ``sink_for`` picks by the head. Blocks the calling thread for up to ``timeout`` s in
        all (TimeoutError after that)."""
        deadline = time.monotonic() + timeout
        conn = self._take()
        if conn is not None:
            try:
                head = conn.exchange(request, sink_for, deadline)
            except _NothingAnswered:
                conn.close()  # closed by the gateway while idle: once more on a new connection
            except BaseException:
                conn.close()
                raise
            else:
                self._give_back(conn)
                return head
        conn = self._connect(max(1e-3, deadline - time.monotonic()))
        try:
            head = conn.exchange(request, sink_for, deadline)
        except BaseException:
            conn.close()
            raise
        self._give_back(conn)
        return head

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
        for conn in idle:
            conn.close()

    def _take(self) -> _Connection | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _give_back(self, conn: _Connection) -> None:
        if conn.reusable:
            with self._lock:
                if not self._closed and len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def _connect(self, timeout: float) -> _Connection:
        endpoint = self.endpoint
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.server_hostname)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

