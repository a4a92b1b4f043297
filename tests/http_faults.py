"""A real-network fault injector for HTTP/1.1: a proxy in front of a real ``kvgw serve``.

Client tests talk to ``HttpFaultProxy.url``; every request goes over real sockets to the real
server, and the proxy can spoil one chosen exchange the way networks and load balancers do:

* ``Fault(op, status=503)``      answer an error status itself (what a load balancer says when the
                                 gateway behind it is gone); the request never reaches the server
* ``Fault(op, drop=True)``       close the client connection without answering
* ``Fault(op, delay=s)``         hold the request ``s`` seconds before forwarding it
* ``Fault(op, cut_after=n)``     forward the response head and ``n`` body bytes, then hang up
* ``Fault(op, corrupt_at=n)``    flip body byte ``n`` of the server's response (bits damaged in flight)
* ``Fault(op, body=b"...")``     answer 200 with this JSON body instead of the server's: a response
                                 that is valid HTTP but breaks the API contract
* ``Fault(op, garble=True)``     answer bytes that are not HTTP at all

``op`` names the native API call (``put get head delete exists prefix batch_get readyz``, ``*`` for
any). Body offsets count decoded payload bytes (a chunked response is de-chunked, altered and
re-chunked), so a fault lands where the test means it to. ``refuse()`` closes the listening
port (connections are refused, like a firewall or a dead host) and ``accept()`` opens the same
port again.

One upstream connection per request keeps the relay simple; the client side keeps its keep-alive
connections, as it would with a real proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

_MAX_HEAD = 64 << 10


@dataclass
class Fault:
    op: str
    status: int | None = None
    drop: bool = False
    delay: float = 0.0
    cut_after: int | None = None
    corrupt_at: int | None = None
    body: bytes | None = None
    garble: bool = False
    times: int = 1


def op_of(method: str, path: str) -> str:
    """The native API call a request is (the names Fault.op uses)."""
    path = path.split("?", 1)[0]
    if path in ("/healthz", "/readyz"):
        return path[1:]
    if "/chunks/" in path:
        return {"PUT": "put", "GET": "get", "HEAD": "head", "DELETE": "delete"}.get(method, "other")
    tail = path.rsplit("/", 1)[-1]
    if method == "POST" and tail in ("exists", "prefix", "batch-get", "locate", "touch", "prefetch"):
        return tail.replace("-", "_")
    return "other"


@dataclass
class _Head:
    first: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def encode(self, drop: tuple[str, ...] = ()) -> bytes:
        lines = [self.first] + [f"{k}: {v}" for k, v in self.headers if k.lower() not in drop]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return _Head(lines[0], headers)


class _Body:
    """Where a relayed response body stands, and the fault to apply at decoded-body offsets."""

    def __init__(self, fault: Fault | None) -> None:
        self.fault = fault
        self.sent = 0
        self.cut = False

    def alter(self, data: bytes) -> bytes:
        f = self.fault
        if f is not None and f.corrupt_at is not None and self.sent <= f.corrupt_at < self.sent + len(data):
            spoiled = bytearray(data)
            spoiled[f.corrupt_at - self.sent] ^= 0xFF
            data = bytes(spoiled)
        if f is not None and f.cut_after is not None and self.sent + len(data) >= f.cut_after:
            data = data[: max(f.cut_after - self.sent, 0)]
            self.cut = True
        self.sent += len(data)
        return data


class HttpFaultProxy:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        assert parts.hostname is not None and parts.port is not None
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.log: list[tuple[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.accepted = 0  # client connections accepted so far
        sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        sock.close()

    # ------------------------------------------------------------ control (any thread)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpFaultProxy:
        self._thread.start()
        self.accept()
        return self

    def accept(self) -> None:
        """Listen (again) on the proxy's port."""
        self._call(self._listen)

    def refuse(self) -> None:
        """Close the port and every open connection: new connections are refused."""
        self._call(self._shut)

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def ops(self, op: str) -> int:
        with self._lock:
            return sum(1 for o, _ in self.log if o == op)

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._shut)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def _call(self, fn: Callable[[], object]) -> None:
        async def run() -> None:
            result = fn()
            if asyncio.iscoroutine(result):
                await result

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # ------------------------------------------------------------ the proxy (its own loop)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True,
                                                      limit=_MAX_HEAD)

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def _take(self, op: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.op in (op, "*"):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.accepted += 1
        try:
            while await self._exchange(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its response; False when the client connection must end."""
        head = await _read_head(reader)
        if head is None:
            return False
        method, target = head.first.split(" ")[:2]
        body = await reader.readexactly(int(head.get("content-length") or 0))
        op = op_of(method, target)
        with self._lock:
            self.log.append((op, target))
        fault = self._take(op)
        if fault is not None and fault.delay:
            await asyncio.sleep(fault.delay)
        if fault is not None and (fault.drop or fault.garble):
            if fault.garble:
                writer.write(b"SPDY/9 ???\r\n\x00\x01garbage\r\n\r\n")
                await writer.drain()
            return False
        if fault is not None and (fault.status is not None or fault.body is not None):
            status = fault.status or 200
            payload = fault.body if fault.body is not None else json.dumps(
                {"error": {"code": "ServiceUnavailable" if status >= 500 else "InvalidRequest",
                           "message": "injected by the fault proxy", "request_id": "proxy-1"}}).encode()
            writer.write(
                f"HTTP/1.1 {status} Injected\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\nx-kvgw-request-id: proxy-1\r\n\r\n".encode() + payload
            )
            await writer.drain()
            return True
        keep_alive = (head.get("connection") or "").lower() != "close"
        up_reader, up_writer = await asyncio.open_connection(*self._upstream, limit=_MAX_HEAD)
        try:
            up_writer.write(head.encode(drop=("connection",))[:-2] + b"connection: close\r\n\r\n" + body)
            await up_writer.drain()
            return await self._relay(method, up_reader, writer, fault) and keep_alive
        finally:
            up_writer.transport.abort()

    async def _relay(
        self, method: str, src: asyncio.StreamReader, dst: asyncio.StreamWriter, fault: Fault | None
    ) -> bool:
        head = await _read_head(src)
        if head is None:
            return False
        status = int(head.first.split(" ")[1])
        dst.write(head.encode(drop=("connection",)))
        out = _Body(fault)
        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        length = head.get("content-length")
        if no_body:
            pass
        elif (head.get("transfer-encoding") or "").lower() == "chunked":
            while True:
                size = int((await src.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await src.readexactly(size + 2)
                if size == 0:
                    dst.write(b"0\r\n\r\n")
                    break
                piece = out.alter(data[:-2])
                if piece:
                    dst.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                if out.cut:
                    break
                await dst.drain()
        elif length is not None:
            remaining = int(length)
            while remaining and not out.cut:
                data = await src.read(min(remaining, 1 << 20))
                if not data:
                    break
                remaining -= len(data)
                dst.write(out.alter(data))
                await dst.drain()
        else:
            while (data := await src.read(1 << 20)) and not out.cut:
                dst.write(out.alter(data))
            return False
        with contextlib.suppress(ConnectionError):
            await dst.drain()
        return not out.cut
