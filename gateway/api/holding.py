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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HOLD_LIMIT = 64 * 1024


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

    def on_response_complete(self) -> None:
        self._holding.flush()
        super().on_response_complete()
