"""One write per small HTTP response: uvicorn's httptools protocol over a transport that holds writes.

uvicorn writes a response's head and its body with one ``transport.write`` each, and uvloop sends each
at once: two syscalls and two TCP segments per small answer, and a client that wakes for the head and
then again for the body. Measured on loopback with ``gateway.bench.loadgen``, an ASGI app doing no work
answered an exists-shaped POST (64 keys in, JSON out) at 1.5x the p50 latency of a HEAD (which has no
body to send), 1.1x with one write; a HEAD's own latency did not change.

So small writes are held until the response is complete (uvicorn calls ``on_response_complete`` from
the ``send`` of the last body message), until they add up to ``HOLD_LIMIT`` bytes, or at the latest
until the event loop turns (writes outside a response, such as ``100 Continue``); then they leave in
one ``writelines``. A write that would pass the limit goes out at once behind what was held, so a
streamed chunk body reaches the real transport, and its flow control (``pause_writing``), as before.

Large pieces of a chunked response (batch-get streams, where the length is not known up front) go
out without a copy: uvicorn frames each body message as ``b"".join([size, body, CRLF])``, a fresh copy
of every 8 MiB chunk, so ``chunked_without_copy`` writes the three parts as they are. Measured with
``kvgw bench io --ops batch``' client: batch-get of 16 x 8 MiB warm chunks 2701 -> 2961 MB/s, server
CPU 0.38 -> 0.34 s/GiB.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

HOLD_LIMIT = 64 * 1024
COPY_FREE_BYTES = 256 * 1024  # chunked body pieces from this size on are written without uvicorn's copy


class HoldingTransport(asyncio.Transport):
    """Wraps a connection's transport: ``write`` holds small data, everything else is passed on."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []
        self._held_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)  # the latest a held write waits
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes > HOLD_LIMIT:
            self.flush()

    def write_now(self, data: bytes) -> None:
        """``data`` sent at once, behind anything held: a response known to be complete (the lookup
        lane's), with no flush to schedule."""
        self.flush()
        if not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Send everything held, in one ``writelines`` (one syscall when the socket takes it all)."""
        if not self._held:
            return
        held, self._held, self._held_bytes = self._held, [], 0
        if not self._transport.is_closing():
            self._transport.writelines(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._held_bytes + self._transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class HoldingHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.run(http=...)``: httptools HTTP/1.1 whose small responses leave in one write."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._holding = HoldingTransport(transport, self.loop)
        super().connection_made(self._holding)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)  # None when the request was refused before it began
        if cycle is not None:
            cycle.send = chunked_without_copy(cycle)

    def on_response_complete(self) -> None:
        self._holding.flush()
        super().on_response_complete()


def chunked_without_copy(cycle: RequestResponseCycle) -> Callable[[Any], Awaitable[None]]:
    """``cycle.send``, except that a large body message in the middle of a chunked response is framed
    here and written as three parts instead of uvicorn's joined copy; what uvicorn's ``send`` does for
    such a message besides (wait while the transport is paused, drop it once the client is gone) is
    done the same way. Everything else, the first and the last message among them, is uvicorn's."""
    send = cycle.send

    async def send_chunk(message: Any) -> None:  # uvicorn's ASGISendEvent
        body: bytes | bytearray | memoryview = message.get("body", b"")
        if (message["type"] != "http.response.body" or not message.get("more_body", False)
                or len(body) < COPY_FREE_BYTES or not cycle.chunked_encoding or cycle.response_complete
                or cycle.scope["method"] == "HEAD"):
            await send(message)
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if not cycle.disconnected:
            cycle.transport.writelines([b"%x\r\n" % len(body), body, b"\r\n"])

    return send_chunk
