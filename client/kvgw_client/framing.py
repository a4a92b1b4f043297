"""Incremental reader of batch-get streams that copies each payload straight into its destination.

The framing itself (structs, magics, statuses) is defined once, in ``kvgw_client.wire``; this reader
differs from ``wire.BatchParser`` only in where payload bytes go. ``BatchParser`` returns each payload
as a new ``bytes``; ``BatchReader`` asks a caller-provided ``BufferProvider`` for the frame's
destination when the frame header arrives (it then knows the exact length) and writes the payload
into it as the bytes arrive, hashing on the way. So a 64 MiB KV chunk lands in LMCache's own buffer
with one copy and without a second 64 MiB allocation.

Contract (what callers rely on):

* Every requested index produces exactly one ``BatchItem``, in index order: from ``feed`` as frames
  complete, and from ``close`` for whatever the stream did not deliver (status LOST). A caller that
  handed out buffers can therefore always reconcile them.
* An item is OK only after its full payload arrived and its xxh3-64 matched the frame header. A
  destination may hold bytes of a CORRUPT or LOST item: its owner must discard them.
* A framing violation stops the reader: ``error`` is set, ``feed`` returns the items completed before
  the violation and ignores further input, and ``close`` reports the rest as LOST.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvgw_client import wire

Destination = memoryview | Sequence[memoryview]
"""Where a payload goes: one writable byte view of exactly the payload length, or several whose
lengths add up to it (filled in order; LMCache's metadata header and tensor, for example)."""

BufferProvider = Callable[[int, int], Destination | None]
"""``(index, length) -> destination``, or None to refuse the payload (it is then read and dropped and
the item is REFUSED). Called on the thread that reads the stream."""


class ItemStatus(enum.StrEnum):
    OK = "ok"
    MISSING = "missing"  # the gateway has no such chunk
    FAILED = "failed"  # the chunk exists but the gateway could not serve it (FRAME_ERROR)
    CORRUPT = "corrupt"  # payload checksum mismatch: damaged in flight
    LOST = "lost"  # the stream ended, broke or failed before this frame was complete
    REFUSED = "refused"  # the buffer provider declined the payload


@dataclass(frozen=True, slots=True)
class BatchItem:
    index: int
    status: ItemStatus
    length: int = 0
    data: bytearray | None = None  # the payload, when no buffer provider was given

    @property
    def ok(self) -> bool:
        return self.status is ItemStatus.OK


def byte_view(buf: object, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying.

    LMCache's ``MemoryObj.byte_array`` is a ctypes-backed view with format ``<B``, which refuses slice
    assignment from ``bytes``; casting to ``B`` fixes that.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)  # type: ignore[arg-type]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view


def destination_views(dest: Destination) -> list[memoryview]:
    """Writable flat byte views of a destination, in fill order."""
    if isinstance(dest, memoryview):
        return [byte_view(dest, writable=True)]
    return [byte_view(v, writable=True) for v in dest]


class PayloadWriter:
    """Receives one frame's payload: hashes it and scatters it over the destination views."""

    def __init__(self, views: list[memoryview] | None, length: int) -> None:
        self.views = views
        self.remaining = length
        self._hasher = xxhash.xxh3_64()
        self._i = 0
        self._off = 0

    def write(self, chunk: memoryview) -> None:
        self.remaining -= len(chunk)
        if self.views is None:  # refused: drop
            return
        self._hasher.update(chunk)
        while chunk:
            view = self.views[self._i]
            n = min(len(view) - self._off, len(chunk))
            view[self._off : self._off + n] = chunk[:n]
            chunk = chunk[n:]
            self._off += n
            if self._off == len(view):
                self._i += 1
                self._off = 0

    def target(self) -> memoryview | None:
        """The destination bytes not written yet, in the current view (None when refused or full): a
        reader may receive straight into them and then call ``written``."""
        if self.views is None or not self.remaining:
            return None
        while self._off == len(self.views[self._i]):  # skip empty views
            self._i += 1
            self._off = 0
        return self.views[self._i][self._off :]

    def written(self, n: int) -> None:
        """``n`` bytes were received into ``target()``: hash them and move on."""
        assert self.views is not None and 0 < n <= self.remaining
        view = self.views[self._i]
        self._hasher.update(view[self._off : self._off + n])
        self.remaining -= n
        self._off += n
        if self._off == len(view) and self.remaining:
            self._i += 1
            self._off = 0

    def digest(self) -> int:
        return self._hasher.intdigest()


_HEADER, _FRAME, _PAYLOAD, _TRAILER, _DONE = range(5)


class BatchReader:
    def __init__(self, count: int, *, into: BufferProvider | None = None, max_length: int = 1 << 30) -> None:
        self._count = count
        self._into = into
        self._max_length = max_length
        self._state = _HEADER
        self._small = bytearray()
        self._next = 0
        self._frame: tuple[int, int] | None = None  # length, expected checksum of the open frame
        self._payload: PayloadWriter | None = None
        self._data: bytearray | None = None
        self.error: wire.FramingError | None = None
        self.bytes_received = 0

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    @property
    def next_index(self) -> int:
        return self._next

    def feed(self, data: bytes | bytearray | memoryview) -> list[BatchItem]:
        out: list[BatchItem] = []
        if self.error is not None:
            return out
        mv = byte_view(data)
        self.bytes_received += len(mv)
        try:
            self._consume(mv, out)
        except wire.FramingError as exc:
            self.error = exc
        return out

    def payload_target(self) -> memoryview | None:
        """Where the next bytes of the stream belong when they are payload bytes of the open frame with
        a destination (``PayloadWriter.target``); None otherwise (``feed`` them). Receiving straight
        into it and calling ``payload_written`` saves ``feed``'s copy."""
        if self._state != _PAYLOAD or self.error is not None:
            return None
        assert self._payload is not None
        return self._payload.target()

    def payload_written(self, n: int) -> list[BatchItem]:
        """``n`` bytes were received into ``payload_target()``; the frame's item once it is complete."""
        assert self._payload is not None
        self.bytes_received += n
        self._payload.written(n)
        return [self._finish_frame()] if self._payload.remaining == 0 else []

    def close(self) -> list[BatchItem]:
        """Report every index not yet reported as LOST; the reader accepts nothing afterwards."""
        out = [BatchItem(i, ItemStatus.LOST) for i in range(self._next, self._count)]
        self._next = self._count
        if self._state != _DONE and self.error is None:
            self.error = wire.FramingError("batch stream ended before its trailer")
        self._payload = None
        self._data = None
        return out

    def _fill(self, mv: memoryview, pos: int, size: int) -> int:
        take = mv[pos : pos + size - len(self._small)]
        self._small += take
        return pos + len(take)

    def _consume(self, mv: memoryview, out: list[BatchItem]) -> None:
        pos = 0
        end = len(mv)
        while pos < end:
            state = self._state
            if state == _DONE:
                raise wire.FramingError("bytes after the batch trailer")
            if state == _PAYLOAD:
                assert self._payload is not None
                n = min(self._payload.remaining, end - pos)
                self._payload.write(mv[pos : pos + n])
                pos += n
                if self._payload.remaining == 0:
                    out.append(self._finish_frame())
                continue
            size = {_HEADER: wire.BATCH_HEADER.size, _FRAME: wire.FRAME_HEADER.size}.get(
                state, wire.BATCH_TRAILER.size
            )
            pos = self._fill(mv, pos, size)
            if len(self._small) < size:
                return
            if state == _HEADER:
                self._on_header()
            elif state == _FRAME:
                item = self._on_frame_header()
                if item is not None:
                    out.append(item)
            else:
                self._on_trailer()
            self._small.clear()

    def _after_frame(self) -> None:
        self._state = _TRAILER if self._next == self._count else _FRAME

    def _on_header(self) -> None:
        magic, version, _, count = wire.BATCH_HEADER.unpack(self._small)
        if magic != wire.BATCH_MAGIC or version != wire.BATCH_VERSION:
            raise wire.FramingError("not a kvgw batch stream (bad magic or version)")
        if count != self._count:
            raise wire.FramingError(f"batch header announces {count} frames, {self._count} keys were asked")
        self._after_frame()

    def _on_trailer(self) -> None:
        magic, count = wire.BATCH_TRAILER.unpack(self._small)
        if magic != wire.BATCH_END_MAGIC or count != self._count:
            raise wire.FramingError("bad batch trailer")
        self._state = _DONE

    def _on_frame_header(self) -> BatchItem | None:
        status, length, expected = wire.FRAME_HEADER.unpack(self._small)
        index = self._next
        if status in (wire.FRAME_MISSING, wire.FRAME_ERROR):
            if length != 0:
                raise wire.FramingError(f"frame {index}: status {status} with a {length}-byte payload")
            self._next += 1
            self._after_frame()
            return BatchItem(index, ItemStatus.MISSING if status == wire.FRAME_MISSING else ItemStatus.FAILED)
        if status != wire.FRAME_OK:
            raise wire.FramingError(f"frame {index}: unknown status {status}")
        if length > self._max_length:
            raise wire.FramingError(f"frame {index}: {length} bytes exceeds the {self._max_length}-byte limit")
        views: list[memoryview] | None
        if self._into is None:
            self._data = bytearray(length)
            views = [memoryview(self._data)]
        else:
            dest = self._into(index, length)
            views = None if dest is None else destination_views(dest)
            if views is not None and sum(len(v) for v in views) != length:
                raise ValueError(f"buffer provider returned {sum(len(v) for v in views)} bytes for {length}")
        self._frame = (length, expected)
        self._payload = PayloadWriter(views, length)
        self._state = _PAYLOAD
        if length == 0:
            return self._finish_frame()
        return None

    def _finish_frame(self) -> BatchItem:
        assert self._payload is not None and self._frame is not None
        length, expected = self._frame
        index = self._next
        if self._payload.views is None:
            status = ItemStatus.REFUSED
        elif self._payload.digest() != expected:
            status = ItemStatus.CORRUPT
        else:
            status = ItemStatus.OK
        data = self._data if status is ItemStatus.OK else None
        self._payload = None
        self._frame = None
        self._data = None
        self._next += 1
        self._after_frame()
        return BatchItem(index, status, length, data)
