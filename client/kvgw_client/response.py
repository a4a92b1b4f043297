"""HTTP/1.1 responses read without I/O of its own: whoever owns the socket reads into ``buffer()`` and
reports ``updated(n)``. The asyncio protocol of batch-get streams (``kvgw_client.stream``) and the
blocking connections of callers' threads (``kvgw_client.calls``) both drive one ``ResponseReader``, so
there is one response parser in the client.

Whenever a body's payload is next in the stream and its ``BodySink`` offers a ``target``, ``buffer()``
*is* that target: the socket is read straight into the caller's destination (one copy per byte).
Everything else (the head, chunk-size lines, an error's body) is read into a small buffer and parsed.

What a caller must know:
- HTTP/1.1 as kvgw's gateway speaks it to this client: a body with ``Content-Length``,
  ``Transfer-Encoding: chunked``, or delimited by the connection closing (``closed``).
- One response at a time: ``start`` before each request's answer; ``complete`` says it has ended.
- ``updated`` raises ``StreamError`` for an answer it cannot read (or whatever the sink raises); the
  connection is then unusable. Not thread safe: one connection, one owner at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024  # a response head (or a chunk-size line, or trailers) longer than this is refused
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error response's body kept for its message
READ_BYTES = 64 * 1024
"""The small buffer everything but payloads is read into. A read there may take the start of the next
payload too (copied on, ``BodySink.feed``): at most this much per frame, under 1% of an 8 MiB chunk."""

# where the body is
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_CLOSE, _DONE = range(8)


class StreamError(Exception):
    """The server's answer is not HTTP/1.1 as this reader understands it, or it ended early."""


class BodySink:
    """Where a response body's bytes go. ``feed`` copies; ``target`` (optional) is a writable view the
    next bytes may be read into directly, which ``written`` then accounts for."""

    def feed(self, data: memoryview) -> None:
        raise NotImplementedError

    def target(self) -> memoryview | None:
        return None

    def written(self, n: int) -> None:
        raise NotImplementedError


class Collect(BodySink):
    """A (small) body kept whole, up to ``limit`` bytes (the rest dropped, ``truncated`` set): an
    error's JSON, or a JSON answer."""

    def __init__(self, limit: int = ERROR_BODY_LIMIT) -> None:
        self.data = bytearray()
        self.limit = limit
        self.truncated = False

    def feed(self, data: memoryview) -> None:
        room = max(0, self.limit - len(self.data))
        self.truncated |= len(data) > room
        self.data += data[:room]


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    reason: str
    headers: Mapping[str, str]  # names lower-cased; a repeated name keeps its last value


class ResponseReader:
    """One connection's responses, one at a time, parsed from the bytes read into ``buffer()``."""

    def __init__(self) -> None:
        self._read = bytearray(READ_BYTES)
        self._read_view = memoryview(self._read)
        self._line = bytearray()  # a head or line read so far
        self._direct = False  # the last buffer() handed out the sink's target
        self._state = _DONE
        self._remaining = 0  # body bytes (length mode) or chunk bytes (chunked) still to come
        self._sink: BodySink | None = None
        self._sink_for: Callable[[Head], BodySink] | None = None
        self.head: Head | None = None  # the answer's head, once it arrived
        self.complete = False  # the answer ended
        self.close_after = False  # the answer asked to close the connection after it

    def start(self, sink_for: Callable[[Head], BodySink]) -> None:
        """Expect the answer to a request just sent; its body goes to the sink ``sink_for`` picks by
        the head (a batch reader for a 200, a collector for an error)."""
        self._sink_for = sink_for
        self._sink = None
        self._state = _HEAD
        self._line.clear()
        self.head = None
        self.complete = False
        self.close_after = False

    @property
    def idle(self) -> bool:
        """No answer is being read: none was started, or the last one ended or failed."""
        return self._state == _DONE

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket go: the sink's target while a payload is next, else the
        small read buffer."""
        if self._state in (_LENGTH, _CHUNK_DATA, _TO_CLOSE) and self._sink is not None:
            target = self._sink.target()
            if target is not None and len(target):
                self._direct = True
                return target if self._state == _TO_CLOSE else target[: self._remaining]
        self._direct = False
        return self._read_view

    def updated(self, nbytes: int) -> None:
        """``nbytes`` arrived in the last ``buffer()``. Raises for an answer this reader cannot read
        (the reader is then idle, the connection unusable)."""
        try:
            if self._direct:
                assert self._sink is not None
                self._sink.written(nbytes)
                if self._state != _TO_CLOSE:
                    self._remaining -= nbytes
                    if not self._remaining:
                        self._state = _DONE if self._state == _LENGTH else _CHUNK_END
                        if self._state == _DONE:
                            self._finish()
                return
            self._parse(self._read_view[:nbytes])
        except Exception:
            self.fail()
            raise

    def closed(self) -> bool:
        """The connection closed: True when that ended the answer (a body delimited by the close), else
        False (the answer was cut short, or none was expected)."""
        if self._state == _TO_CLOSE:
            self._finish()
            return True
        self.fail()
        return False

    def fail(self) -> None:
        """Stop reading the answer (broken, or abandoned by its caller)."""
        self._state = _DONE
        self._sink = None

    # -- parsing ---------------------------------------------------------------------------------

    def _parse(self, data: memoryview) -> None:
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA, _TO_CLOSE):
                n = end - pos if state == _TO_CLOSE else min(self._remaining, end - pos)
                assert self._sink is not None
                self._sink.feed(data[pos : pos + n])
                pos += n
                if state != _TO_CLOSE:
                    self._remaining -= n
                    if not self._remaining:
                        self._state = _CHUNK_END if state == _CHUNK_DATA else _DONE
                        if self._state == _DONE:
                            self._finish()
                continue
            if state == _DONE:
                raise StreamError("bytes after the end of the response")
            line, pos = self._take_line(data, pos, b"\r\n\r\n" if state == _HEAD else b"\r\n")
            if line is None:
                return
            if state == _HEAD:
                self._on_head(line)
            elif state == _CHUNK_SIZE:
                size_text = line.split(b";", 1)[0].strip()
                try:
                    self._remaining = int(size_text, 16)
                except ValueError:
                    raise StreamError(f"bad chunk size {size_text[:20]!r}") from None
                self._state = _CHUNK_DATA if self._remaining else _TRAILERS
            elif state == _CHUNK_END:
                if line:
                    raise StreamError("chunk data not followed by CRLF")
                self._state = _CHUNK_SIZE
            elif not line:  # _TRAILERS: the empty line ends them
                self._finish()

    def _take_line(self, data: memoryview, pos: int, end_mark: bytes) -> tuple[bytes | None, int]:
        """The next line (or head) without its end mark, and the position after it; (None, end) when it
        has not all arrived (kept for the next read). ``data`` is the start of the read buffer."""
        kept = len(self._line)
        if kept:  # a line begun in an earlier read: its end mark may straddle the two
            self._line += data[pos : pos + MAX_HEAD_BYTES]
            at = self._line.find(end_mark, max(0, kept - len(end_mark) + 1))
            if at < 0:
                if len(self._line) > MAX_HEAD_BYTES:
                    raise StreamError("response head or line too long")
                return None, len(data)
            line = bytes(self._line[:at])
            self._line.clear()
            return line, pos + at + len(end_mark) - kept
        at = self._read.find(end_mark, pos, len(data))
        if at < 0:
            if len(data) - pos > MAX_HEAD_BYTES:
                raise StreamError("response head or line too long")
            self._line += data[pos:]
            return None, len(data)
        return bytes(self._read[pos:at]), at + len(end_mark)

    def _on_head(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise StreamError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise StreamError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if 100 <= status < 200:
            return  # an interim answer: the real head follows
        self.close_after = (headers.get("connection", "").lower() == "close" or parts[0] == b"HTTP/1.0")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise StreamError(f"bad content-length {headers['content-length'][:20]!r}") from None
            self._state = _LENGTH if self._remaining else _DONE
        else:
            self._state = _TO_CLOSE
            self.close_after = True
        self.head = Head(status, parts[2].decode("latin-1") if len(parts) > 2 else "", headers)
        assert self._sink_for is not None
        self._sink = self._sink_for(self.head)
        if self._state == _DONE:
            self._finish()

    def _finish(self) -> None:
        self._state = _DONE
        self._sink = None
        self.complete = True
