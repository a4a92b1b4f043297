"""The value types of the chunk service, shared by the request path, the tier mover and the APIs.

``ChunkInfo`` is what is known about one live chunk; ``ChunkBody`` its verified bytes (or a range of
them); ``ChunkLocation``, ``PutResult``, ``PrefetchResult`` and ``ListPage`` are the answers of the
service's calls. ``ByteRange`` / ``resolve_range`` turn a parsed Range header into bytes of a chunk.
``ChunkEvents`` is what the service and the tier mover report to the lifecycle ledgers and the
cluster change feed.

Tier identities are ``backends.tiers.TierId`` (index bit, name); nothing here defines them again.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from backends import errors as backend
from backends.base import ChunkMeta
from backends.index import IndexEntry
from backends.tiers import TierId
from gateway.errors import InvalidRange, translate_backend_error
from kvgw_client import wire

MAX_TTL_SECONDS = 10 * 365 * 86400  # the longest TTL a client may ask for

ByteRange = tuple[int | None, int | None]
"""(first, last) as parsed from a Range header: ``(a, b)`` is ``bytes=a-b``, ``(a, None)`` is
``bytes=a-`` and ``(None, n)`` the suffix ``bytes=-n``."""


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    bucket: str
    key: str
    size: int
    checksum: int
    created: float
    expires: float
    tiers: int = TierId.FS  # bit mask of TierId values: the tiers holding a copy
    md5_etag: str | None = None  # recorded when written to an MD5-mode bucket (``backends.base.MD5_ETAG``)

    @property
    def tier(self) -> TierId:
        """The tier a read is served from (the filesystem when it holds a copy)."""
        return TierId.FS if self.tiers & TierId.FS else TierId.S3

    @property
    def checksum_hex(self) -> str:
        return wire.checksum_hex(self.checksum)

    @property
    def etag(self) -> str:
        """The native API's ETag: the xxh3-64 quoted (equal to ``X-Kvgw-Checksum``), in every bucket."""
        return wire.etag(self.checksum)

    @property
    def s3_etag(self) -> str:
        """The S3 API's ETag: the MD5 form recorded when the chunk was written to an MD5-mode bucket,
        else the native one. Fixed at write time, so changing a bucket's mode never changes the ETag of
        a chunk already stored (sync tools would take that for a changed object)."""
        return f'"{self.md5_etag}"' if self.md5_etag is not None else wire.etag(self.checksum)

    @classmethod
    def from_entry(cls, entry: IndexEntry) -> ChunkInfo:
        return cls(entry.bucket, entry.key, entry.size, entry.checksum, entry.created, entry.expires, entry.tiers,
                   entry.md5_etag)

    @classmethod
    def from_meta(cls, meta: ChunkMeta, tiers: int) -> ChunkInfo:
        return cls(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires, tiers, meta.md5_etag)


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a client on the tier's host (or on its shared mount) finds a chunk's bytes itself."""

    info: ChunkInfo
    path: str | None  # chunk file relative to the filesystem tier's root; None: no file copy (S3 only)


@dataclass(frozen=True, slots=True)
class PutResult:
    created: bool  # False: the key already held a chunk, which was left unchanged
    info: ChunkInfo


class ThreadedBody(Protocol):
    """A request body whose pieces can be received in a worker thread (``gateway.dataplane.intake``'s
    threaded receives): a PUT then receives, hashes and writes each piece in one thread, with no
    hand-off per piece and the bytes still in that thread's cache when they are written."""

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        """Call ``consume`` from one worker thread with the body's leading pieces, in order, while they
        arrive fast; return once the body is complete or stops arriving fast (or no reader thread is
        free): the rest, if any, then comes from the body's async iterator as usual. ``consume`` must
        not keep a piece: its buffer is refilled once it returns. An exception from ``consume`` ends
        the reading and is raised here, after the body's state is consistent again."""


ThreadedOutcome = Literal["complete", "slow", "gone", "skipped"]
"""How a threaded receive ended: the whole body read; a piece too slow to come (the event loop reads the
rest); the client went away; not tried (no reader thread free, TLS, nothing left to read)."""


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    accepted: int  # S3-only chunks now being copied into the filesystem tier
    local: int  # already in the filesystem tier
    missing: int  # no such chunk


@dataclass(slots=True)
class ListPage:
    """One page of a bucket listing, in UTF-8 byte order of keys (S3's order)."""

    contents: list[ChunkInfo] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)  # common prefixes (with a delimiter)
    truncated: bool = False
    last: tuple[str, str] | None = None  # ("k", key) or ("p", common prefix): where the next page resumes


class ChunkBody:
    """Bytes of a chunk or a range of it: verified, unless the reader verifies them itself
    (``ChunkService.open_info``'s ``reader_verifies``). Three forms: ``data`` (in memory, one piece),
    pieces (iterate once), or ``fd`` (an open chunk file whose bytes ``offset``..``offset+length`` are
    the range: the HTTP server sends them with ``sendfile``, never reading them into Python). ``close``
    releases buffers and descriptors.

    A tier failing while the bytes stream raises the domain error for it (``gateway.errors``).
    """

    def __init__(
        self,
        info: ChunkInfo,
        offset: int,
        length: int,
        pieces: AsyncIterator[bytes | memoryview] | None = None,
        data: bytes | memoryview | None = None,
        release: Callable[[], None] | None = None,
        tier: TierId = TierId.FS,
        fd: int | None = None,
    ) -> None:
        self.info = info
        self.offset = offset
        self.length = length
        self.data = data  # set when the bytes are already in memory (one piece)
        self.fd = fd  # set when the bytes are to be sent from a file
        self.tier = tier  # where the bytes came from
        self._pieces = pieces
        self._release = release

    def fileno(self) -> int:
        """The chunk file's descriptor (``fd`` bodies): what ASGI's ``http.response.zerocopysend`` takes."""
        assert self.fd is not None
        return self.fd

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        if self.data is not None:
            yield self.data
        elif self._pieces is not None:
            try:
                async for piece in self._pieces:
                    yield piece
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc

    async def close(self) -> None:
        self.data = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._pieces is not None:
            await self._pieces.aclose()  # type: ignore[attr-defined]
            self._pieces = None
        if self._release is not None:
            self._release()
            self._release = None


def resolve_range(byte_range: ByteRange | None, size: int) -> tuple[int, int]:
    """A parsed Range (``ByteRange``) → (offset, length) in a chunk of ``size`` bytes; InvalidRange if
    unsatisfiable. None is the whole chunk."""
    if byte_range is None:
        return 0, size
    first, last = byte_range
    if first is None:
        if last is None or last == 0:
            raise InvalidRange(size)
        n = min(last, size)
        return size - n, n
    if first >= size:
        raise InvalidRange(size)
    end = size - 1 if last is None else min(last, size - 1)
    if end < first:
        raise InvalidRange(size)
    return first, end - first + 1


StoredReason = Literal["stored", "promoted", "replicated", "demoted", "learned"]
"""Why a tier copy is reported: a client write (``stored``), a copy S3 -> fs on read or prefetch
(``promoted``), a write-through copy fs -> S3 (``replicated``), the S3 copy a demotion made
(``demoted``); ``learned``: this gateway's index found a copy that was already in the tier (a miss that
fell through, a stale entry corrected): nothing changed in the tier."""

RemovedReason = Literal["deleted", "evicted", "expired", "demoted", "quarantined", "vanished"]
"""Why a tier copy is reported gone: a client delete, an eviction, a TTL reclaim, the fs copy a
demotion removed, a damaged copy moved aside; ``vanished``: this gateway found the copy missing
(another gateway removed it): nothing changed in the tier by this gateway."""

INDEX_ONLY_REASONS = frozenset({"learned", "vanished"})
"""Reasons that change only the reporting gateway's view, never the tier (nothing to tell the cluster)."""


class ChunkEvents(Protocol):
    """What the service and the tier mover report: to the lifecycle ledgers (``gateway.lifecycle.ledgers``)
    and, through ``gateway.cluster.ClusterEvents``, to the cluster change feed.

    ``reason`` says what happened to the tier (see ``StoredReason`` / ``RemovedReason``); the
    index-only reasons (``learned``, ``vanished``) are never published to other gateways and never
    change the shared usage ledger. ``info`` is the chunk (key, checksum, creation time) when the
    caller knows it; the feed needs it to describe the chunk to gateways that never saw it.

    Called on the event loop; must not block.
    """

    def stored(self, bucket: str, digest: bytes, tier: TierId, size: int, expires: float,
               parent: bytes | None, now: float, *, reason: StoredReason = "stored",
               info: ChunkInfo | None = None) -> None: ...

    def read(self, bucket: str, digest: bytes, tier: TierId, now: float) -> None: ...

    def removed(self, bucket: str, digest: bytes, tier: TierId, *, reason: RemovedReason = "deleted",
                info: ChunkInfo | None = None) -> None: ...

    def chained(self, bucket: str, digests: list[bytes]) -> None: ...

    def marked(self, bucket: str, digest: bytes, set_marks: int, clear_marks: int, now: float) -> None:
        """An engine hint set and cleared these marks of an indexed chunk (``gateway.hints``)."""
        ...


class NoEvents:
    """A ``ChunkEvents`` that listens to nothing (a service without a lifecycle engine)."""

    def stored(self, bucket: str, digest: bytes, tier: TierId, size: int, expires: float,
               parent: bytes | None, now: float, *, reason: StoredReason = "stored",
               info: ChunkInfo | None = None) -> None:
        return None

    def read(self, bucket: str, digest: bytes, tier: TierId, now: float) -> None:
        return None

    def removed(self, bucket: str, digest: bytes, tier: TierId, *, reason: RemovedReason = "deleted",
                info: ChunkInfo | None = None) -> None:
        return None

    def chained(self, bucket: str, digests: list[bytes]) -> None:
        return None

    def marked(self, bucket: str, digest: bytes, set_marks: int, clear_marks: int, now: float) -> None:
        return None
