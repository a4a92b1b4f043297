"""``gateway.api.frames.FrameSender``: batch-get frames gathered into few writes, in order, every body
closed once its bytes are written (or the write failed)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from gateway.api.frames import GATHER_BYTES, FrameSender
from gateway.api.http import BODY_PARTS, ZEROCOPY, Message
from gateway.chunks import ChunkBody, ChunkInfo
from kvgw_client import wire


def info(size: int) -> ChunkInfo:
    return ChunkInfo("kvcache", f"k{size}", size, 0xABC, 0.0, 0.0)


class Closed:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def in_memory(size: int, closed: Closed) -> ChunkBody:
    return ChunkBody(info(size), 0, size, data=bytes([size % 251]) * size, release=closed)


class Wire:
    """What the server would write: each message's bytes, in order."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.messages: list[Message] = []
        self.fail_at = fail_at

    async def send(self, message: Message) -> None:
        if self.fail_at is not None and len(self.messages) == self.fail_at:
            raise ConnectionResetError("the client went away")
        if message["type"] == BODY_PARTS:
            message = {**message, "parts": [bytes(p) for p in message["parts"]]}  # as written, now
        self.messages.append(message)

    def written(self) -> bytes:
        out = bytearray()
        for m in self.messages:
            if m["type"] == BODY_PARTS:
                out += b"".join(m["parts"])
            elif m["type"] == "http.response.body":
                out += m["body"]
            else:
                out += b"<file %d>" % m["count"]
        return bytes(out)


def frame(body: ChunkBody) -> bytes:
    assert body.data is not None
    return wire.encode_frame_header(wire.FRAME_OK, body.length, body.info.checksum) + bytes(body.data)


async def test_small_frames_leave_together_and_large_ones_alone() -> None:
    out, closed = Wire(), Closed()
    frames = FrameSender(out.send, gather=True)
    small = [in_memory(64 << 10, closed) for _ in range(3)]
    expected = b"".join(frame(b) for b in small) + wire.encode_frame_header(wire.FRAME_MISSING)
    for body in small:
        await frames.chunk(body)
    await frames.status(wire.FRAME_MISSING)
    assert out.messages == [] and closed.count == 0  # gathered: nothing written, nothing closed yet
    large = in_memory(GATHER_BYTES, closed)
    expected += frame(large)
    await frames.chunk(large)  # reaches GATHER_BYTES: everything gathered goes in one write
    assert [m["type"] for m in out.messages] == [BODY_PARTS] and closed.count == 4
    await frames.flush()
    assert out.written() == expected and len(out.messages) == 1


async def test_file_and_streamed_frames_end_the_gathering_in_order() -> None:
    out, closed = Wire(), Closed()
    frames = FrameSender(out.send, gather=True)
    first = in_memory(1000, closed)
    first_frame = frame(first)
    await frames.chunk(first)
    fd = os.open(os.devnull, os.O_RDONLY)
    await frames.chunk(ChunkBody(info(5000), 0, 5000, fd=fd, release=closed))

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a" * 10
        yield b"b" * 20

    await frames.chunk(ChunkBody(info(30), 0, 30, pieces=pieces(), release=closed))
    await frames.flush()
    kinds = [m["type"] for m in out.messages]
    assert kinds == [BODY_PARTS, ZEROCOPY, BODY_PARTS, "http.response.body", "http.response.body"]
    header = wire.encode_frame_header
    assert out.written() == (first_frame + header(wire.FRAME_OK, 5000, 0xABC) + b"<file 5000>"
                             + header(wire.FRAME_OK, 30, 0xABC) + b"a" * 10 + b"b" * 20)
    assert closed.count == 3
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # the file body was closed after its send


async def test_without_parts_every_piece_is_its_own_message() -> None:
    out, closed = Wire(), Closed()
    frames = FrameSender(out.send, gather=False)
    body = in_memory(100, closed)
    expected = frame(body)
    await frames.chunk(body)
    await frames.status(wire.FRAME_ERROR)
    assert [m["type"] for m in out.messages] == ["http.response.body"] * 3
    assert out.written() == expected + wire.encode_frame_header(wire.FRAME_ERROR) and closed.count == 1


async def test_a_failed_write_closes_every_body_it_held() -> None:
    out, closed = Wire(fail_at=0), Closed()
    frames = FrameSender(out.send, gather=True)
    await frames.chunk(in_memory(10, closed))
    await frames.chunk(in_memory(10, closed))
    with pytest.raises(ConnectionResetError):
        await frames.flush()
    assert closed.count == 2
    await frames.close()  # nothing left: closing again is harmless
    assert closed.count == 2

