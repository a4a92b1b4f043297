"""Wire definitions of the native chunk API, shared by the server and every client.

Standard library plus ``xxhash`` only: the LMCache connector and the prefetcher import this module
inside the inference process without pulling in the server.

Batch-get framing (``POST /v1/buckets/{bucket}/batch-get``, content type ``BATCH_CONTENT_TYPE``),
all integers little-endian::

    stream  := header frame{count} trailer
    header  := "KVGB" | version:u16 | reserved:u16 | count:u32                    (12 bytes)
    frame   := status:u8 | reserved:3 | length:u64 | checksum:u64 | payload       (20 bytes + length)
    trailer := "KVGE" | count:u32                                                 (8 bytes)

Frame ``i`` answers the request's key ``i``. ``status`` is FRAME_OK (``length`` payload bytes follow,
``checksum`` is their xxh3-64), FRAME_MISSING (no such chunk; length 0) or FRAME_ERROR (the chunk
exists but could not be served: failed verification, tier unavailable; length 0). The server has
verified a payload before it sends the frame header, so a client can copy the payload straight into
its destination buffer; it still checks ``checksum`` to catch corruption in flight. A stream without
its trailer was cut short: treat every frame not fully received as missing.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import xxhash

API_PREFIX = "/v1"

# Request / response headers of the native API.
H_CHECKSUM = "x-kvgw-checksum"  # xxh3-64 of the whole chunk, 16 lowercase hex digits
H_TTL = "x-kvgw-ttl"  # seconds a chunk lives, on PUT
H_PARENT = "x-kvgw-parent"  # key of the previous chunk in the same prefix chain, on PUT
H_EXISTED = "x-kvgw-existed"  # "true" on a PUT answered 200 because the key was already stored
H_TIER = "x-kvgw-tier"  # tier a GET/HEAD was served from
H_REQUEST_ID = "x-kvgw-request-id"
H_VERIFY = "x-kvgw-verify"  # on GET and batch-get: the client checks each chunk against its checksum itself
VERIFY_XXH3 = "xxh3"  # the one value of H_VERIFY: the server then sends the bytes unverified (zero-copy)
H_RETENTION = "x-kvgw-retention"  # a chunk's retention class (``Retention``), on PUT
H_DECLINED = "x-kvgw-declined"  # on a 507 Declined answer to PUT: admission did not store it (why)


class Hint(enum.StrEnum):
    """What an engine tells kvgw about chunks (``POST /v1/buckets/{bucket}/hints``), so that eviction
    and admission keep what will be read again. ``docs/lifecycle.md`` says what each engine sends."""

    ENDED = "ended"  # the request that wrote or read them finished (another turn may follow)
    SESSION_ENDED = "session-ended"  # their session is over: no further turn of it will read them
    SHARED = "shared"  # retention class: shared by many requests (a system prompt, few-shot examples)
    NORMAL = "normal"  # retention class: the default
    ONE_OFF = "one-off"  # retention class: read by one request only (a one-off document)
    PIN = "pin"  # keep them whatever the policy says (they still count toward the capacity)
    UNPIN = "unpin"  # undo pin


class Retention(enum.StrEnum):
    """A chunk's retention class, set by ``X-Kvgw-Retention`` on PUT or by a hint."""

    SHARED = "shared"
    NORMAL = "normal"
    ONE_OFF = "one-off"


BATCH_CONTENT_TYPE = "application/x-kvgw-batch"
CHUNK_CONTENT_TYPE = "application/octet-stream"

FRAME_OK = 0
FRAME_MISSING = 1
FRAME_ERROR = 2

BATCH_MAGIC = b"KVGB"
BATCH_END_MAGIC = b"KVGE"
BATCH_VERSION = 1
BATCH_HEADER = struct.Struct("<4sHHI")
FRAME_HEADER = struct.Struct("<B3xQQ")
BATCH_TRAILER = struct.Struct("<4sI")


class ErrorCode:
    """Machine-readable error codes of the native API (``{"error": {"code": ...}}``)."""

    NO_SUCH_BUCKET = "NoSuchBucket"
    NO_SUCH_CHUNK = "NoSuchChunk"
    INVALID_KEY = "InvalidKey"
    INVALID_REQUEST = "InvalidRequest"
    INCOMPLETE_BODY = "IncompleteBody"
    BAD_DIGEST = "BadDigest"
    MISSING_CONTENT_LENGTH = "MissingContentLength"
    CHUNK_TOO_LARGE = "ChunkTooLarge"
    EMPTY_CHUNK = "EmptyChunk"
    PRECONDITION_FAILED = "PreconditionFailed"
    INVALID_RANGE = "InvalidRange"
    UNAUTHORIZED = "Unauthorized"
    ACCESS_DENIED = "AccessDenied"
    METHOD_NOT_ALLOWED = "MethodNotAllowed"
    NOT_FOUND = "NotFound"
    INSUFFICIENT_STORAGE = "InsufficientStorage"
    SERVICE_UNAVAILABLE = "ServiceUnavailable"
    INTERNAL_ERROR = "InternalError"
    DECLINED = "Declined"  # 507 to a PUT: admission under pressure did not store the chunk (not a failure)


def encode_key(key: str) -> str:
    """A key as one URL path segment, and as the ``X-Kvgw-Parent`` value: every reserved byte is
    escaped (``/`` -> ``%2F``, ``@`` -> ``%40``), so a single percent-decoding gives the key back."""
    return quote(key, safe="")


def checksum(data: bytes | bytearray | memoryview) -> str:
    """The chunk checksum as sent on the wire: xxh3-64, 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def checksum_int(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksum_hex(value: int) -> str:
    return f"{value:016x}"


def etag(value: int) -> str:
    """The ETag of a chunk (or multipart part) whose xxh3-64 is ``value``: its checksum, quoted. Both
    of the gateway's APIs send it; the S3 API also takes it back unquoted."""
    return f'"{checksum_hex(value)}"'


def encode_batch_header(count: int) -> bytes:
    return BATCH_HEADER.pack(BATCH_MAGIC, BATCH_VERSION, 0, count)


def encode_frame_header(status: int, length: int = 0, checksum_value: int = 0) -> bytes:
    return FRAME_HEADER.pack(status, length, checksum_value)


def encode_batch_trailer(count: int) -> bytes:
    return BATCH_TRAILER.pack(BATCH_END_MAGIC, count)


class FramingError(ValueError):
    """The batch stream does not follow the framing above."""


@dataclass(frozen=True, slots=True)
class Frame:
    index: int
    status: int
    payload: bytes
    checksum: int

    @property
    def ok(self) -> bool:
        return self.status == FRAME_OK


class BatchParser:
    """Incremental parser of a batch-get stream: feed bytes as they arrive, take frames as they complete.

    Holds at most one frame's payload, so a client never buffers the whole response. Payload
    checksums are verified here; a mismatch raises FramingError.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._count: int | None = None
        self._next = 0
        self._frame: tuple[int, int, int] | None = None  # status, length, checksum of the open frame
        self.complete = False

    @property
    def count(self) -> int | None:
        return self._count

    def feed(self, data: bytes) -> Iterator[Frame]:
        self._buf += data
        while True:
            frame = self._step()
            if frame is None:
                return
            yield frame

    def _step(self) -> Frame | None:
        if self.complete:
            if self._buf:
                raise FramingError("bytes after the batch trailer")
            return None
        if self._count is None:
            if len(self._buf) < BATCH_HEADER.size:
                return None
            magic, version, _, count = BATCH_HEADER.unpack_from(self._buf)
            if magic != BATCH_MAGIC or version != BATCH_VERSION:
                raise FramingError("not a kvgw batch stream")
            del self._buf[: BATCH_HEADER.size]
            self._count = count
        if self._next == self._count:
            if len(self._buf) < BATCH_TRAILER.size:
                return None
            magic, count = BATCH_TRAILER.unpack_from(self._buf)
            if magic != BATCH_END_MAGIC or count != self._count:
                raise FramingError("bad batch trailer")
            del self._buf[: BATCH_TRAILER.size]
            self.complete = True
            return None
        if self._frame is None:
            if len(self._buf) < FRAME_HEADER.size:
                return None
            self._frame = FRAME_HEADER.unpack_from(self._buf)
            del self._buf[: FRAME_HEADER.size]
        status, length, expected = self._frame
        if len(self._buf) < length:
            return None
        payload = bytes(self._buf[:length])
        del self._buf[:length]
        self._frame = None
        index = self._next
        self._next += 1
        if status == FRAME_OK and checksum_int(payload) != expected:
            raise FramingError(f"frame {index}: payload checksum mismatch")
        return Frame(index=index, status=status, payload=payload, checksum=expected)
