"""The storage-tier contract: what the service needs from a place that holds chunk bytes.

A tier stores immutable chunks addressed by a 16-byte digest of (bucket, key) (``kvgw_client.keys``);
a key never becomes a path or an object name. Chunks are self-describing: ``ChunkMeta`` (bucket, key,
size, checksum, timestamps) is recoverable from the tier alone, so the index can be rebuilt from it.

Writes are staged: bytes go to a private staging area, and ``publish`` makes the chunk visible
atomically and only if no chunk with that digest exists (create-if-absent). A staged write that is
neither published nor discarded (a crash) leaves only staging garbage that ``cleanup_staging`` removes;
a reader can never see a partial chunk.

Reads trust nothing: the service says which checksum a whole-chunk read must have (from its index) and
the tier checks the bytes against it where it reads them (``check_bytes``), or the service hashes a
stream itself; a tier only reports what it holds. Every method may raise the ``backends.errors`` tree
and nothing else.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import xxhash

from backends.errors import ChunkCorrupt

HASH_ON_LOOP_BYTES = 1 << 20  # larger buffers are hashed in a worker thread, off the event loop


def check_bytes(data: bytes | memoryview, checksum: int | None) -> None:
    """ChunkCorrupt unless ``data``'s xxh3-64 is ``checksum`` (None: nothing to check). Hashes on the
    calling thread: a tier that reads in a worker thread calls it there, in the same step."""
    if checksum is not None and xxhash.xxh3_64_intdigest(data) != checksum:
        raise ChunkCorrupt("checksum mismatch")


async def check_bytes_soon(data: bytes | memoryview, checksum: int | None) -> None:
    """``check_bytes`` from the event loop: buffers over ``HASH_ON_LOOP_BYTES`` are hashed in a worker
    thread (the first touch of mapped pages must not stall the loop)."""
    if checksum is None:
        return
    if len(data) <= HASH_ON_LOOP_BYTES:
        check_bytes(data, checksum)
    else:
        await asyncio.to_thread(check_bytes, data, checksum)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a tier records beside a chunk's bytes (and the index caches)."""

    bucket: str
    key: str
    size: int
    checksum: int  # xxh3-64 of the bytes
    created: float  # unix seconds
    expires: float = 0.0  # unix seconds; 0 means never
    parent: str | None = None  # key of the previous chunk in its prefix chain, when a client said so
    attrs: tuple[tuple[str, str], ...] = ()  # small client metadata kept with the bytes (content type,
    # S3 checksums); read from the tier only when a client asks for it
    md5_etag: str | None = None  # the S3 ETag (unquoted) of a chunk written to an MD5-mode bucket: see MD5_ETAG


MD5_ETAG = re.compile(r"[0-9a-f]{32}(-[1-9][0-9]{0,4})?")
"""An MD5-mode ETag, unquoted: the hex MD5 of the body, or for a multipart upload the hex MD5 of its
part MD5s (binary, concatenated in part order) then ``-`` and the number of parts, as S3 makes them.
It is recorded with the chunk when written (chunk file footer, index record, feed event), never
recomputed; the chunk's xxh3-64 stays its checksum either way."""
_MD5_ETAG_RECORD = struct.Struct("<16sH")  # digest, parts (0: not multipart)
MD5_ETAG_BYTES = _MD5_ETAG_RECORD.size


def pack_md5_etag(etag: str) -> bytes:
    """``MD5_ETAG`` text as ``MD5_ETAG_BYTES`` bytes (index records, feed events)."""
    digest, _, parts = etag.partition("-")
    return _MD5_ETAG_RECORD.pack(bytes.fromhex(digest), int(parts) if parts else 0)


def unpack_md5_etag(raw: bytes | memoryview, offset: int = 0) -> str:
    digest, parts = _MD5_ETAG_RECORD.unpack_from(raw, offset)
    return f"{bytes(digest).hex()}-{parts}" if parts else bytes(digest).hex()


class StagedChunk(Protocol):
    """One in-progress write. Exactly one of ``publish`` / ``discard`` must be awaited."""

    async def write(self, data: bytes | memoryview) -> None:
        """Append bytes. May raise StorageFull or TierUnavailable (then call ``discard``)."""

    async def publish(self, meta: ChunkMeta) -> bool:
        """Make the chunk visible if absent. True if this write created it, False if one existed.

        Either way the staging area is cleaned. Durable before returning when the tier's sync
        policy says so.
        """

    async def discard(self) -> None:
        """Drop the staged bytes. Safe to call after a failed ``write`` or twice."""


@runtime_checkable
class SyncStagedChunk(StagedChunk, Protocol):
    """A staged chunk that can also take bytes from a worker thread, written before the call returns
    (the filesystem tier): the service then receives, hashes and writes a body's pieces in one thread
    (``gateway.dataplane.intake``'s threaded receives), the bytes still in that thread's cache when they are
    written, with no hand-off per piece."""

    def write_now(self, data: bytes | memoryview) -> None:
        """Append ``data`` at once, from the calling (worker) thread; ``data`` is not kept after the
        call. Only before the first ``write``: the two do not mix in one chunk, except ``write``
        after ``write_now``. A ``write_now`` of other than whole ``FOLIO_BYTES`` multiples must be the
        chunk's last. May raise StorageFull or TierUnavailable (then call ``discard``)."""


class Tier(Protocol):
    """A place that holds chunk bytes: the POSIX/NFS directory tier, the S3 tier, the test memory tier."""

    name: str

    async def stage(self, digest: bytes) -> StagedChunk: ...

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        """Bytes ``[offset, offset+length)`` of the chunk's data; short only if the chunk is truncated.

        With ``checksum``, the bytes are checked against it before they are returned (``check_bytes``;
        ChunkCorrupt if they differ), in the same step that reads them where the tier can (one worker
        thread call for a file, instead of one to read and one to hash).

        May be a read-only view of memory the tier manages (a file mapping): hold it no longer than
        the response that sends it.
        """
        ...

    def stream(self, digest: bytes, offset: int, length: int, window: int) -> AsyncIterator[bytes | memoryview]:
        """The same bytes in pieces of at most ``window`` bytes, opening the chunk once."""
        ...

    async def stat(self, digest: bytes) -> ChunkMeta:
        """The chunk's recorded metadata, from the tier alone. ChunkNotFound if absent."""
        ...

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        """``stat`` for many chunks in one call; None for absent or unreadable ones."""
        ...

    def absent_now(self, digests: list[bytes]) -> bool:
        """True when the tier certainly holds none of these chunks and could say so without waiting
        (no I/O that may block the event loop); False when it holds one or cannot tell at once. For
        callers that cannot await (the lookup lane); ``stat_many`` is the full answer."""
        ...

    async def delete(self, digest: bytes) -> bool:
        """Remove the chunk; False if it was not there."""
        ...

    async def quarantine(self, digest: bytes) -> bool:
        """Move a chunk whose bytes failed verification out of the way (kept for inspection)."""
        ...

    def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        """Every published chunk as (digest, meta); meta is None when unreadable (scrub reports it)."""
        ...

    async def cleanup_staging(self, older_than: float) -> int:
        """Remove staging leftovers of dead writers; returns how many were removed."""
        ...

    async def usage(self) -> int:
        """Bytes the tier's chunks occupy (for capacity checks); may be approximate."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AheadRead:
    """One whole-chunk read a batch read is about to make (``FileLocator.read_ahead``): ``read(digest,
    0, size, checksum=checksum)``, or ``open_data(digest, size)`` when ``as_file``."""

    digest: bytes
    size: int
    checksum: int | None = None
    as_file: bool = False


@runtime_checkable
class FileLocator(Protocol):
    """A tier whose chunks are plain files that clients on the same host (or on the shared mount) may
    read themselves: data at offset 0, ``size`` bytes, the footer after it (``backends.chunkfile``)."""

    def relative_path(self, digest: bytes) -> str:
        """The chunk file's path relative to the tier root, with ``/`` separators."""
        ...

    async def read_ahead(self, reads: list[AheadRead]) -> None:
        """Hint that these chunks are about to be read, in this order and each as described: start
        reading them from disk now, and open them ahead where that saves the reads work."""
        ...

    async def open_data(self, digest: bytes, size: int) -> int:
        """An open read-only descriptor on the chunk's file, whose data part is ``size`` bytes (checked
        against the file's own footer, which catches a file re-written since the caller's index entry
        was made; not the bytes themselves: the reader verifies them). The caller closes it.
        ChunkNotFound if there is no file, ChunkCorrupt if its footer says another size."""
        ...
