"""The chunk service: the one place that implements write-once storage, lookups and verified reads.

Every API (native, S3) and every background job (lifecycle, prefetch) calls this; it calls the index
and the tiers. Rules it enforces for all of them:

- Write-once: the first complete write of a key wins; later writes store nothing and report the
  chunk that exists. A write becomes visible only complete and verified (tier ``publish``).
- The index is a cache: a miss falls through to the tier, so a chunk another gateway wrote (or one
  the index lost) is found and then indexed. An expired entry is absent at once.
- Reads are verified before their first byte leaves (setting ``verify_reads``): a chunk whose bytes
  no longer match its checksum is quarantined and reported absent, never served.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import xxhash

from backends import errors as backend
from backends.base import ChunkMeta, Tier
from backends.catalog.store import BucketPolicy
from backends.index import TIER_FS, ChunkIndex, IndexEntry
from gateway.access import Directory
from gateway.config import Settings
from gateway.errors import (
    BadDigest,
    ChunkTooLarge,
    IncompleteBody,
    InternalError,
    InvalidRange,
    InvalidRequest,
    NoSuchChunk,
    translate_backend_error,
)
from gateway.keys import chunk_digest

MAX_TTL_SECONDS = 10 * 365 * 86400
_HASH_ON_LOOP_BYTES = 1 << 20  # larger buffers are hashed in a worker thread


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    bucket: str
    key: str
    size: int
    checksum: int
    created: float
    expires: float
    tier: str = "fs"

    @property
    def checksum_hex(self) -> str:
        return f"{self.checksum:016x}"

    @property
    def etag(self) -> str:
        return f'"{self.checksum:016x}"'

    @classmethod
    def from_entry(cls, entry: IndexEntry) -> ChunkInfo:
        return cls(entry.bucket, entry.key, entry.size, entry.checksum, entry.created, entry.expires)


@dataclass(frozen=True, slots=True)
class PutResult:
    created: bool  # False: the key already held a chunk, which was left unchanged
    info: ChunkInfo


class ChunkBody:
    """Verified bytes of a chunk or a range of it. Iterate once; ``close`` releases buffers."""

    def __init__(
        self,
        info: ChunkInfo,
        offset: int,
        length: int,
        pieces: AsyncIterator[bytes] | None = None,
        data: bytes | memoryview | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.info = info
        self.offset = offset
        self.length = length
        self.data = data  # set when the bytes are already in memory (one piece)
        self._pieces = pieces
        self._release = release

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        if self.data is not None:
            yield self.data
        elif self._pieces is not None:
            async for piece in self._pieces:
                yield piece

    async def close(self) -> None:
        self.data = None
        if self._pieces is not None:
            await self._pieces.aclose()  # type: ignore[attr-defined]
            self._pieces = None
        if self._release is not None:
            self._release()
            self._release = None


class _ByteBudget:
    """Caps the bytes held by whole-chunk read buffers across all requests (memory stays bounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def try_take(self, n: int) -> Callable[[], None] | None:
        if self.used + n > self.limit:
            return None
        self.used += n

        def release() -> None:
            self.used -= n

        return release


def parse_ttl(raw: str | None) -> int | None:
    if raw is None:
        return None
    if not raw.isdigit() or not 0 < int(raw) <= MAX_TTL_SECONDS:
        raise InvalidRequest(f"TTL must be a whole number of seconds between 1 and {MAX_TTL_SECONDS}")
    return int(raw)


class ChunkService:
    def __init__(
        self,
        settings: Settings,
        directory: Directory,
        index: ChunkIndex,
        fs: Tier,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.index = index
        self.fs = fs
        self.clock = clock
        self._budget = _ByteBudget(settings.read_buffer_budget_bytes)

    async def bucket(self, name: str) -> BucketPolicy:
        return await self.directory.bucket(name)

    # -- lookups -------------------------------------------------------------------------------

    async def lookup(self, bucket: BucketPolicy, key: str) -> ChunkInfo | None:
        """The live chunk under (bucket, key), from the index or, on a miss, from the tier."""
        digest = chunk_digest(bucket.name, key)
        entry = self.index.get(digest)
        if entry is not None:
            return ChunkInfo.from_entry(entry) if entry.alive(self.clock()) else None
        return await self._fall_through(digest, bucket.name, key)

    async def head(self, bucket: BucketPolicy, key: str) -> ChunkInfo:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return info

    async def exists(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[bool]:
        digests = [chunk_digest(bucket.name, k) for k in keys]
        alive = self.index.alive_many(digests, self.clock())
        misses = [i for i, hit in enumerate(alive) if not hit]
        if misses:
            found = await self._fall_through_many([digests[i] for i in misses], bucket.name,
                                                  [keys[i] for i in misses])
            for i, info in zip(misses, found, strict=True):
                alive[i] = info is not None
        return alive

    async def prefix(self, bucket: BucketPolicy, keys: Sequence[str]) -> int:
        """How many leading keys are all present (stops at the first absent one)."""
        digests = [chunk_digest(bucket.name, k) for k in keys]
        start = 0
        while start < len(keys):
            alive = self.index.alive_many(digests[start:], self.clock(), stop_at_miss=True)
            start += sum(alive)
            if start == len(keys) or await self._fall_through(digests[start], bucket.name, keys[start]) is None:
                break
            start += 1
        return start

    async def _fall_through(self, digest: bytes, bucket: str, key: str) -> ChunkInfo | None:
        found = await self._fall_through_many([digest], bucket, [key])
        return found[0]

    async def _fall_through_many(
        self, digests: list[bytes], bucket: str, keys: Sequence[str]
    ) -> list[ChunkInfo | None]:
        """Look index misses up in the tier; index what is found (another gateway wrote it).

        Digests that are indexed but expired stay absent without touching the tier.
        """
        entries = self.index.get_many(digests)
        candidates = [i for i, entry in enumerate(entries) if entry is None]
        out: list[ChunkInfo | None] = [None] * len(digests)
        if not candidates:
            return out
        try:
            metas = await self.fs.stat_many([digests[i] for i in candidates])
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        now = self.clock()
        for i, meta in zip(candidates, metas, strict=True):
            if meta is None or meta.bucket != bucket or meta.key != keys[i] or 0 < meta.expires <= now:
                continue
            await self.index.put(digests[i], self._entry_from_meta(meta, now), self._parent_digest(meta))
            out[i] = ChunkInfo(bucket, keys[i], meta.size, meta.checksum, meta.created, meta.expires)
        return out

    @staticmethod
    def _entry_from_meta(meta: ChunkMeta, now: float) -> IndexEntry:
        return IndexEntry(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires,
                          last_access=now, tiers=TIER_FS)

    @staticmethod
    def _parent_digest(meta: ChunkMeta) -> bytes | None:
        return None if meta.parent is None else chunk_digest(meta.bucket, meta.parent)

    async def chunk_meta(self, info: ChunkInfo) -> ChunkMeta:
        """The chunk's full recorded metadata (attrs included), from the tier that holds it."""
        try:
            return await self.fs.stat(chunk_digest(info.bucket, info.key))
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc

    # -- writes --------------------------------------------------------------------------------

    async def put(
        self,
        bucket: BucketPolicy,
        key: str,
        body: AsyncIterator[bytes],
        *,
        length: int,
        checksum: int | None = None,
        md5: bytes | None = None,
        ttl: int | None = None,
        parent: str | None = None,
        attrs: dict[str, str] | None = None,
    ) -> PutResult:
        """Stream ``body`` into the tier; publish only if complete and matching the given digests."""
        if length > bucket.max_chunk_bytes:
            raise ChunkTooLarge(f"{length} bytes exceeds the bucket limit of {bucket.max_chunk_bytes}")
        digest = chunk_digest(bucket.name, key)
        hasher = xxhash.xxh3_64()
        md5_hasher = hashlib.md5() if md5 is not None else None
        received = 0
        try:
            staged = await self.fs.stage(digest)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        try:
            async for piece in body:
                received += len(piece)
                if received > length:
                    raise InvalidRequest("the body is longer than Content-Length")
                hasher.update(piece)
                if md5_hasher is not None:
                    md5_hasher.update(piece)
                await staged.write(piece)
            if received != length:
                raise IncompleteBody(f"received {received} of {length} bytes")
            value = hasher.intdigest()
            if checksum is not None and checksum != value:
                raise BadDigest("the body does not match X-Kvgw-Checksum")
            if md5_hasher is not None and md5_hasher.digest() != md5:
                raise BadDigest("the body does not match Content-MD5")
            now = self.clock()
            ttl = ttl if ttl is not None else bucket.default_ttl_seconds
            meta = ChunkMeta(bucket.name, key, length, value, now, now + ttl if ttl else 0.0, parent,
                             tuple(sorted((attrs or {}).items())))
            created = await staged.publish(meta)
        except backend.BackendError as exc:
            await staged.discard()
            raise translate_backend_error(exc) from exc
        except BaseException:
            await staged.discard()
            raise
        if not created:
            existing = await self.lookup(bucket, key)
            if existing is None:  # published by someone else, then deleted or expired at once
                raise InternalError("the chunk changed while it was written; retry")
            return PutResult(False, existing)
        parent_digest = None if parent is None else chunk_digest(bucket.name, parent)
        await self.index.put(digest, self._entry_from_meta(meta, now), parent_digest)
        return PutResult(True, ChunkInfo(bucket.name, key, length, value, now, meta.expires))

    async def delete(self, bucket: BucketPolicy, key: str) -> bool:
        """Remove a chunk: the tier copy first, then the index entry (a crash in between leaves a
        dangling entry, which the next read drops; the reverse would resurrect the chunk)."""
        digest = chunk_digest(bucket.name, key)
        try:
            removed = await self.fs.delete(digest)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        entry = await self.index.delete(digest)
        return removed or entry is not None

    # -- reads ---------------------------------------------------------------------------------

    async def open(self, bucket: BucketPolicy, key: str, byte_range: tuple[int | None, int | None] | None = None
                   ) -> ChunkBody:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return await self.open_info(info, byte_range)

    async def open_many(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[ChunkInfo | None]:
        """Resolve many keys for a batch read (one index transaction for the hits)."""
        digests = [chunk_digest(bucket.name, k) for k in keys]
        now = self.clock()
        infos: list[ChunkInfo | None] = []
        misses: list[int] = []
        for i, entry in enumerate(self.index.get_many(digests)):
            if entry is None:
                misses.append(i)
            infos.append(ChunkInfo.from_entry(entry) if entry is not None and entry.alive(now) else None)
        if misses:
            found = await self._fall_through_many([digests[i] for i in misses], bucket.name,
                                                  [keys[i] for i in misses])
            for i, info in zip(misses, found, strict=True):
                infos[i] = info
        return infos

    async def open_info(self, info: ChunkInfo, byte_range: tuple[int | None, int | None] | None = None,
                        *, retried: bool = False) -> ChunkBody:
        """Verified bytes of a resolved chunk; NoSuchChunk if it vanished or failed verification."""
        offset, length = resolve_range(byte_range, info.size)
        digest = chunk_digest(info.bucket, info.key)
        self.index.touch(digest, self.clock())
        verify = self.settings.verify_reads
        whole = info.size if verify else length
        release = self._budget.try_take(whole) if whole <= self.settings.whole_read_max_bytes else None
        try:
            if release is not None:
                start = 0 if verify else offset
                data = await self.fs.read(digest, start, whole)
                if verify and not await self._matches(data, info):
                    raise backend.ChunkCorrupt("checksum mismatch")
                if offset != start or length != len(data):
                    data = memoryview(data)[offset - start : offset - start + length]
                return ChunkBody(info, offset, length, data=data, release=release)
            if verify:
                await self._verify_streaming(digest, info)
            pieces = self.fs.stream(digest, offset, length, self.settings.read_window_bytes)
            return ChunkBody(info, offset, length, pieces=pieces)
        except backend.ChunkCorrupt:
            if release is not None:
                release()
            if not retried and await self._index_was_stale(digest, info):
                fresh = await self.lookup(await self.bucket(info.bucket), info.key)
                if fresh is not None:
                    return await self.open_info(fresh, byte_range, retried=True)
            await self._quarantine(digest)
            raise NoSuchChunk("the chunk failed verification and was quarantined") from None
        except backend.ChunkNotFound:
            if release is not None:
                release()
            await self.index.delete(digest)  # deleted behind our back (scrub, another gateway)
            raise NoSuchChunk() from None
        except backend.BackendError as exc:
            if release is not None:
                release()
            raise translate_backend_error(exc) from exc
        except BaseException:
            if release is not None:
                release()
            raise

    @staticmethod
    async def _matches(data: bytes | memoryview, info: ChunkInfo) -> bool:
        if len(data) != info.size:
            return False
        if len(data) <= _HASH_ON_LOOP_BYTES:
            return xxhash.xxh3_64_intdigest(data) == info.checksum
        return await asyncio.to_thread(xxhash.xxh3_64_intdigest, data) == info.checksum

    async def _verify_streaming(self, digest: bytes, info: ChunkInfo) -> None:
        hasher = xxhash.xxh3_64()
        size = 0
        pieces = self.fs.stream(digest, 0, info.size, self.settings.read_window_bytes)
        try:
            async for piece in pieces:
                hasher.update(piece)
                size += len(piece)
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        if size != info.size or hasher.intdigest() != info.checksum:
            raise backend.ChunkCorrupt("checksum mismatch")

    async def _index_was_stale(self, digest: bytes, info: ChunkInfo) -> bool:
        """A mismatch may be the index's fault (an entry from before a rebuild): the footer decides."""
        try:
            meta = await self.fs.stat(digest)
        except backend.BackendError:
            return False
        if (meta.size, meta.checksum) == (info.size, info.checksum):
            return False
        await self.index.delete(digest)
        return True

    async def _quarantine(self, digest: bytes) -> None:
        try:
            await self.fs.quarantine(digest)
        finally:
            await self.index.delete(digest)


def resolve_range(byte_range: tuple[int | None, int | None] | None, size: int) -> tuple[int, int]:
    """(first, last) as parsed from a Range header → (offset, length); InvalidRange if unsatisfiable.

    ``(a, None)`` is ``bytes=a-``; ``(None, n)`` is the suffix ``bytes=-n``.
    """
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

