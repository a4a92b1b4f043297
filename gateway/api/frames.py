"""Batch-get frames onto an ASGI ``send``, with as few writes as the server allows.

A batch-get answer is a run of frames (``kvgw_client.wire``: a header, then the chunk's bytes). Sent one
message per header and one per payload, a batch of small chunks costs two trips through the request
cycle and two socket writes per chunk: with 64 KiB chunks that per-frame cost, not the bytes, set the
pace. Where the server takes ``BODY_PARTS`` (kvgw's data plane), frames whose bytes are in memory are
gathered and leave together, up to ``GATHER_BYTES`` per write; a frame sent from a file (``ZEROCOPY``)
or streamed piece by piece ends the gathering first, so the order on the wire is the order of calls.

What a caller must know: ``chunk`` takes ownership of the body it is given and closes it once its bytes
are written (a gathered body stays open until the write that carries it); ``close`` closes whatever a
failed write left open. Runs on the event loop.
"""

from __future__ import annotations

from gateway.api.http import BODY_PARTS, ZEROCOPY, Send
from gateway.chunks import ChunkBody
from kvgw_client import wire

GATHER_BYTES = 1 << 20
"""In-memory frames gathered into one write up to about this many bytes (a larger frame goes alone)."""


class FrameSender:
    """Frames to ``send``; ``gather``: the server takes ``BODY_PARTS`` messages."""

    def __init__(self, send: Send, *, gather: bool) -> None:
        self._send = send
        self._gather = gather
        self._parts: list[bytes | memoryview] = []
        self._held: list[ChunkBody] = []  # bodies whose bytes wait in _parts
        self._held_bytes = 0

    async def status(self, status: int) -> None:
        """A frame without payload (``wire.FRAME_MISSING``, ``wire.FRAME_ERROR``)."""
        self._parts.append(wire.encode_frame_header(status))
        if not self._gather:
            await self.flush()

    async def chunk(self, body: ChunkBody) -> None:
        """A chunk's frame; ``body`` is closed once written."""
        self._parts.append(wire.encode_frame_header(wire.FRAME_OK, body.length, body.info.checksum))
        if self._gather and body.data is not None:
            self._parts.append(body.data)
            self._held.append(body)
            self._held_bytes += body.length
            if self._held_bytes >= GATHER_BYTES:
                await self.flush()
            return
        try:
            await self.flush()
            if body.fd is not None:  # only opened so where the server takes ZEROCOPY (``sends_files``)
                await self._send({"type": ZEROCOPY, "file": body, "offset": 0, "count": body.length,
                                  "more_body": True})
            else:
                async for piece in body:
                    await self._send({"type": "http.response.body", "body": piece, "more_body": True})
        finally:
            await body.close()

    async def flush(self) -> None:
        """Write what is gathered, then close the bodies it held."""
        parts, self._parts = self._parts, []
        try:
            if not parts:
                return
            if self._gather:
                await self._send({"type": BODY_PARTS, "parts": parts, "more_body": True})
            else:
                for part in parts:
                    await self._send({"type": "http.response.body", "body": part, "more_body": True})
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the bodies still held (after a failed write: their bytes are not sent)."""
        held, self._held = self._held, []
        self._held_bytes = 0
        for body in held:
            await body.close()
