"""The chunk service: the one place that implements write-once storage, lookups and verified reads.

Every API (native, S3) and every background job (lifecycle, prefetch) calls this; it calls the index
and the tiers. Rules it enforces for all of them:

- Write-once: the first complete write of a key wins; later writes store nothing and report the
  chunk that exists. A write becomes visible only complete and verified (tier ``publish``).
- The index is a cache: a miss falls through to the tiers (filesystem, then S3), so a chunk another
  gateway wrote (or one the index lost) is found and then indexed. An expired entry is absent at once.
- Reads are verified before their first byte leaves (setting ``verify_reads``): a chunk whose bytes
  no longer match its checksum is quarantined and reported absent, never served.
- Tiers: a chunk lives in the filesystem tier, the S3 tier, or both (index tier bits). Reads prefer
  the filesystem; a read of an S3-only chunk first copies it into the filesystem tier (promotion,
  once however many readers wait for it). Moves keep a crash-safe order: copy, verify, switch the
  index, then delete the old copy.

Every change is reported to ``events`` (the lifecycle engine) so it can keep its ledgers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import xxhash

from backends import errors as backend
from backends.base import ChunkMeta, FileLocator, Tier
from backends.catalog.store import BucketPolicy
from backends.index import TIER_FS, TIER_S3, ChunkIndex, IndexEntry
from gateway.access import Directory
from gateway.config import Settings
from gateway.errors import (
    BadDigest,
    ChunkTooLarge,
    IncompleteBody,
    InvalidKey,
    InvalidRange,
    InvalidRequest,
    NoSuchChunk,
    ServiceUnavailable,
    translate_backend_error,
)
from gateway.keys import InvalidKeyError, chunk_digest, digest_many

log = logging.getLogger("kvgw.service")

MAX_TTL_SECONDS = 10 * 365 * 86400
_HASH_ON_LOOP_BYTES = 1 << 20  # larger buffers are hashed in a worker thread
TIER_ORDER = (TIER_FS, TIER_S3)  # read preference
TIER_NAMES = {TIER_FS: "fs", TIER_S3: "s3"}


class ChunkEvents(Protocol):
    """What the service reports to the lifecycle engine. Called on the event loop; must not block."""

    def stored(self, bucket: str, digest: bytes, tier: int, size: int, expires: float,
               parent: bytes | None, now: float) -> None: ...

    def read(self, bucket: str, digest: bytes, tier: int, now: float) -> None: ...

    def removed(self, bucket: str, digest: bytes, tier: int) -> None: ...

    def chained(self, bucket: str, digests: list[bytes]) -> None: ...


class NoEvents:
    def stored(self, bucket: str, digest: bytes, tier: int, size: int, expires: float,
               parent: bytes | None, now: float) -> None:
        return None

    def read(self, bucket: str, digest: bytes, tier: int, now: float) -> None:
        return None

    def removed(self, bucket: str, digest: bytes, tier: int) -> None:
        return None

    def chained(self, bucket: str, digests: list[bytes]) -> None:
        return None


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    bucket: str
    key: str
    size: int
    checksum: int
    created: float
    expires: float
    tiers: int = TIER_FS

    @property
    def tier(self) -> str:
        """The tier a read is served from (the filesystem when it holds a copy)."""
        return "fs" if self.tiers & TIER_FS else "s3"

    @property
    def checksum_hex(self) -> str:
        return f"{self.checksum:016x}"

    @property
    def etag(self) -> str:
        return f'"{self.checksum:016x}"'

    @classmethod
    def from_entry(cls, entry: IndexEntry) -> ChunkInfo:
        return cls(entry.bucket, entry.key, entry.size, entry.checksum, entry.created, entry.expires, entry.tiers)


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a client on the tier's host (or on its shared mount) finds a chunk's bytes itself."""

    info: ChunkInfo
    path: str | None  # chunk file relative to the filesystem tier's root; None: no file copy (S3 only)


@dataclass(frozen=True, slots=True)
class PutResult:
    created: bool  # False: the key already held a chunk, which was left unchanged
    info: ChunkInfo


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    accepted: int  # S3-only chunks now being copied into the filesystem tier
    local: int  # already in the filesystem tier
    missing: int  # no such chunk


class ChunkBody:
    """Verified bytes of a chunk or a range of it. Iterate once; ``close`` releases buffers."""

    def __init__(
        self,
        info: ChunkInfo,
        offset: int,
        length: int,
        pieces: AsyncIterator[bytes | memoryview] | None = None,
        data: bytes | memoryview | None = None,
        release: Callable[[], None] | None = None,
        tier: int = TIER_FS,
    ) -> None:
        self.info = info
        self.offset = offset
        self.length = length
        self.data = data  # set when the bytes are already in memory (one piece)
        self.tier = tier  # where the bytes came from
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


class _StaleEntry(Exception):
    """The index disagreed with a tier's own record of a chunk; it has been corrected."""

    def __init__(self, fresh: ChunkInfo) -> None:
        super().__init__()
        self.fresh = fresh


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
        tiers: Mapping[int, Tier],
        *,
        events: ChunkEvents | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.index = index
        self.tiers = dict(tiers)
        self.fs = self.tiers[TIER_FS]
        self.s3 = self.tiers.get(TIER_S3)
        self.events: ChunkEvents = events or NoEvents()
        self.clock = clock
        self._budget = _ByteBudget(settings.read_buffer_budget_bytes)
        self._promotions: dict[bytes, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[bool]] = set()
        self._prefetch_slots = asyncio.Semaphore(settings.prefetch_concurrency)
        self.moved_bytes: Counter[str] = Counter()  # "fs->s3", "s3->fs": bytes copied between tiers
        self.promotions = 0
        self.write_through_skipped = 0  # writes not queued for S3 because the queue was full

    async def bucket(self, name: str) -> BucketPolicy:
        return await self.directory.bucket(name)

    @staticmethod
    def _digests(bucket: BucketPolicy, keys: Sequence[str]) -> list[bytes]:
        try:
            return digest_many(bucket.name, keys)
        except InvalidKeyError as exc:
            raise InvalidKey(str(exc)) from None

    # -- lookups -------------------------------------------------------------------------------

    async def lookup(self, bucket: BucketPolicy, key: str, *, strict: bool = True) -> ChunkInfo | None:
        """The live chunk under (bucket, key), from the index or, on a miss, from the tiers.

        ``strict``: if a tier that might hold the chunk is unreachable, raise ServiceUnavailable
        rather than answer "absent".
        """
        digest = chunk_digest(bucket.name, key)
        entry = self.index.get(digest)
        if entry is not None:
            return ChunkInfo.from_entry(entry) if entry.alive(self.clock()) else None
        return (await self._fall_through_many([digest], bucket.name, [key], strict=strict))[0]

    async def head(self, bucket: BucketPolicy, key: str) -> ChunkInfo:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return info

    async def exists(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[bool]:
        digests = self._digests(bucket, keys)
        alive = self.index.alive_many(digests, self.clock())
        if all(alive):  # the common case: nothing to look up in the tiers
            return alive
        misses = [i for i, hit in enumerate(alive) if not hit]
        found = await self._fall_through_many([digests[i] for i in misses], bucket.name,
                                              [keys[i] for i in misses], strict=False)
        for i, info in zip(misses, found, strict=True):
            alive[i] = info is not None
        return alive

    async def prefix(self, bucket: BucketPolicy, keys: Sequence[str]) -> int:
        """How many leading keys are all present (stops at the first absent one)."""
        digests = self._digests(bucket, keys)
        # learning the chain can wait until the answer is on its way
        asyncio.get_running_loop().call_soon(self.events.chained, bucket.name, digests)
        start = 0
        while start < len(keys):
            start += self.index.alive_prefix(digests[start:] if start else digests, self.clock())
            if start == len(keys):
                break
            found = await self._fall_through_many([digests[start]], bucket.name, [keys[start]], strict=False)
            if found[0] is None:
                break
            start += 1
        return start

    async def _fall_through_many(
        self, digests: list[bytes], bucket: str, keys: Sequence[str], *, strict: bool
    ) -> list[ChunkInfo | None]:
        """Look index misses up in the tiers; index what is found (another gateway wrote it).

        Digests that are indexed but expired stay absent without touching a tier.
        """
        entries = self.index.get_many(digests)
        todo = [i for i, entry in enumerate(entries) if entry is None]
        out: list[ChunkInfo | None] = [None] * len(digests)
        for bit in TIER_ORDER:
            tier = self.tiers.get(bit)
            if not todo or tier is None or (bit == TIER_S3 and not self.settings.s3_lookup_on_miss):
                continue
            try:
                metas = await tier.stat_many([digests[i] for i in todo])
            except backend.TierUnavailable as exc:
                if strict:
                    raise ServiceUnavailable() from exc
                continue
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
            now = self.clock()
            remaining = []
            for i, meta in zip(todo, metas, strict=True):
                if meta is None or meta.bucket != bucket or meta.key != keys[i]:
                    remaining.append(i)
                    continue
                if 0 < meta.expires <= now:
                    continue
                out[i] = await self._index_found(digests[i], meta, bit, now)
            todo = remaining
        return out

    async def _index_found(self, digest: bytes, meta: ChunkMeta, bit: int, now: float) -> ChunkInfo:
        entry = IndexEntry(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires,
                           last_access=now, tiers=bit)
        parent = None if meta.parent is None else chunk_digest(meta.bucket, meta.parent)
        await self.index.put(digest, entry, parent)
        self.events.stored(meta.bucket, digest, bit, meta.size, meta.expires, parent, now)
        return ChunkInfo.from_entry(entry)

    def touch(self, bucket: BucketPolicy, keys: Sequence[str]) -> int:
        """Record reads that bypassed the gateway (clients reading chunk files directly from a shared
        tier directory), so eviction still sees them. Returns how many keys were indexed and alive."""
        now = self.clock()
        digests = self._digests(bucket, keys)
        touched = 0
        for digest, entry in zip(digests, self.index.get_many(digests), strict=True):
            if entry is None or not entry.alive(now):
                continue
            self.index.touch(digest, now)
            self.events.read(bucket.name, digest, TIER_FS if entry.tiers & TIER_FS else TIER_S3, now)
            touched += 1
        return touched

    async def locate(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[ChunkLocation | None]:
        """Resolve a batch read whose bytes the client will read from the tier directory itself.

        Resolution is a batch-get's (index, fall-through, chain learning), and every located file
        copy counts as read for eviction. The client verifies size and checksum of what it reads and
        falls back to batch-get for anything it cannot read, so a file evicted meanwhile costs a
        retry, never wrong bytes. None: no such chunk.
        """
        infos = await self.open_many(bucket, keys)
        fs = self.tiers.get(TIER_FS)
        locator = fs if isinstance(fs, FileLocator) else None
        now = self.clock()
        located: list[ChunkLocation | None] = []
        for info in infos:
            if info is None:
                located.append(None)
                continue
            path = None
            if locator is not None and info.tiers & TIER_FS:
                digest = chunk_digest(info.bucket, info.key)
                path = locator.relative_path(digest)
                self.index.touch(digest, now)
                self.events.read(info.bucket, digest, TIER_FS, now)
            located.append(ChunkLocation(info, path))
        return located

    async def chunk_meta(self, info: ChunkInfo) -> ChunkMeta:
        """The chunk's full recorded metadata (attrs included), from a tier that holds it."""
        digest = chunk_digest(info.bucket, info.key)
        for bit in TIER_ORDER:
            tier = self.tiers.get(bit)
            if tier is None or not info.tiers & bit:
                continue
            try:
                return await tier.stat(digest)
            except backend.ChunkNotFound:
                continue
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
        raise NoSuchChunk()

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
        """Stream ``body`` into the bucket's write tier; publish only if complete and matching the
        given digests. With write-through the chunk is queued for S3 in the same index commit.

        ``attrs`` is read only after the body has been consumed, so a caller may add values computed
        from the body while it streams (the S3 API stores the checksums it verified that way).
        """
        if length > bucket.max_chunk_bytes:
            raise ChunkTooLarge(f"{length} bytes exceeds the bucket limit of {bucket.max_chunk_bytes}")
        bit = TIER_S3 if bucket.write_tier == "s3" and self.s3 is not None else TIER_FS
        tier = self.tiers[bit]
        digest = chunk_digest(bucket.name, key)
        hasher = xxhash.xxh3_64()
        md5_hasher = hashlib.md5() if md5 is not None else None
        received = 0
        try:
            staged = await tier.stage(digest)
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
            existing = await self.lookup(bucket, key, strict=False)
            if existing is None:
                # Another write won, and its chunk was already evicted or deleted: to the client this
                # is the same as "stored, then evicted". Report what the winner held as far as we know.
                existing = ChunkInfo(bucket.name, key, length, value, now, meta.expires, bit)
            return PutResult(False, existing)
        parent_digest = None if parent is None else chunk_digest(bucket.name, parent)
        entry = IndexEntry(bucket.name, key, length, value, now, meta.expires, last_access=now, tiers=bit)
        replicate = bucket.write_through and bit == TIER_FS and self.s3 is not None
        if replicate and self.index.pending_count() >= self.settings.write_through_max_pending:
            replicate = False
            self.write_through_skipped += 1
        await self.index.put(digest, entry, parent_digest, replicate=replicate)
        self.events.stored(bucket.name, digest, bit, length, meta.expires, parent_digest, now)
        return PutResult(True, ChunkInfo.from_entry(entry))

    async def delete(self, bucket: BucketPolicy, key: str) -> bool:
        """Remove a chunk from every tier, S3 first (if S3 is down nothing changes: 503), then the
        filesystem, then the index (a crash in between leaves a dangling entry, which the next read
        drops; the reverse order would resurrect the chunk)."""
        digest = chunk_digest(bucket.name, key)
        entry = self.index.get(digest)
        removed = await self._delete_copies(digest, bucket.name, (TIER_S3, TIER_FS))
        dropped = await self.index.delete(digest)
        return removed or dropped is not None or entry is not None

    async def _delete_copies(self, digest: bytes, bucket: str, bits: Sequence[int]) -> bool:
        removed = False
        for bit in bits:
            tier = self.tiers.get(bit)
            if tier is None:
                continue
            try:
                removed = await tier.delete(digest) or removed
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
            self.events.removed(bucket, digest, bit)
        return removed

    # -- reads ---------------------------------------------------------------------------------

    async def open(self, bucket: BucketPolicy, key: str, byte_range: tuple[int | None, int | None] | None = None
                   ) -> ChunkBody:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return await self.open_info(info, byte_range)

    async def open_many(self, bucket: BucketPolicy, keys: Sequence[str], *, read_ahead: bool = False
                        ) -> list[ChunkInfo | None]:
        """Resolve many keys for a batch read (one index transaction for the hits). ``read_ahead``:
        the gateway itself is about to read them all, so the filesystem tier may start now."""
        digests = self._digests(bucket, keys)
        asyncio.get_running_loop().call_soon(self.events.chained, bucket.name, digests)
        now = self.clock()
        infos: list[ChunkInfo | None] = []
        misses: list[int] = []
        for i, entry in enumerate(self.index.get_many(digests)):
            if entry is None:
                misses.append(i)
            infos.append(ChunkInfo.from_entry(entry) if entry is not None and entry.alive(now) else None)
        if misses:
            found = await self._fall_through_many([digests[i] for i in misses], bucket.name,
                                                  [keys[i] for i in misses], strict=False)
            for i, info in zip(misses, found, strict=True):
                infos[i] = info
        if read_ahead:
            self._read_ahead(infos)
        return infos

    def _read_ahead(self, infos: list[ChunkInfo | None]) -> None:
        """Let the filesystem tier start reading a batch's chunks from disk while the first is served."""
        fs = self.tiers.get(TIER_FS)
        if not isinstance(fs, FileLocator):
            return
        digests = [chunk_digest(i.bucket, i.key) for i in infos if i is not None and i.tiers & TIER_FS]
        if len(digests) > 1:
            task = asyncio.ensure_future(fs.will_read(digests))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def open_info(self, info: ChunkInfo, byte_range: tuple[int | None, int | None] | None = None
                        ) -> ChunkBody:
        """Verified bytes of a resolved chunk, from the best tier holding it.

        NoSuchChunk if every copy vanished or failed verification; ServiceUnavailable if the only
        copy is in a tier that cannot be reached.
        """
        offset, length = resolve_range(byte_range, info.size)
        digest = chunk_digest(info.bucket, info.key)
        now = self.clock()
        self.index.touch(digest, now)
        for attempt in range(2):
            try:
                for bit in TIER_ORDER:
                    if not info.tiers & bit or bit not in self.tiers:
                        continue
                    source = bit
                    if bit == TIER_S3 and self.settings.promote_on_read and await self._promote(digest, info):
                        source = TIER_FS
                    body = await self._read_copy(source, digest, info, offset, length)
                    if body is not None:
                        self.events.read(info.bucket, digest, source, now)
                        return body
                    info = replace(info, tiers=info.tiers & ~bit)
                raise NoSuchChunk()
            except _StaleEntry as stale:
                if attempt:
                    raise NoSuchChunk() from None
                info = stale.fresh
                offset, length = resolve_range(byte_range, info.size)
        raise NoSuchChunk()

    async def _read_copy(self, bit: int, digest: bytes, info: ChunkInfo, offset: int, length: int
                         ) -> ChunkBody | None:
        """The verified range from one tier's copy, or None if that copy is gone or damaged (the index
        and the tier are corrected first)."""
        tier = self.tiers[bit]
        verify = self.settings.verify_reads
        whole = info.size if verify else length
        release = self._budget.try_take(whole) if whole <= self.settings.whole_read_max_bytes else None
        try:
            if release is not None:
                start = 0 if verify else offset
                data = await tier.read(digest, start, whole)
                if verify and not await self._matches(data, info):
                    raise backend.ChunkCorrupt("checksum mismatch")
                if offset != start or length != len(data):
                    data = memoryview(data)[offset - start : offset - start + length]
                return ChunkBody(info, offset, length, data=data, release=release, tier=bit)
            if verify:
                await self._verify_streaming(tier, digest, info)
            pieces = tier.stream(digest, offset, length, self.settings.read_window_bytes)
            return ChunkBody(info, offset, length, pieces=pieces, tier=bit)
        except backend.ChunkCorrupt:
            if release is not None:
                release()
            await self._check_stale(tier, bit, digest, info)
            log.warning("chunk %s/%s failed verification in %s: quarantined", info.bucket, info.key,
                        TIER_NAMES[bit])
            try:
                await tier.quarantine(digest)
            finally:
                await self._forget_copy(digest, info, bit)
            return None
        except backend.ChunkNotFound:
            if release is not None:
                release()
            await self._forget_copy(digest, info, bit)  # deleted behind our back
            return None
        except backend.BackendError as exc:
            if release is not None:
                release()
            raise translate_backend_error(exc) from exc
        except BaseException:
            if release is not None:
                release()
            raise

    async def _forget_copy(self, digest: bytes, info: ChunkInfo, bit: int) -> None:
        await self.index.update_tiers(digest, remove=bit)
        self.events.removed(info.bucket, digest, bit)

    @staticmethod
    async def _matches(data: bytes | memoryview, info: ChunkInfo) -> bool:
        if len(data) != info.size:
            return False
        if len(data) <= _HASH_ON_LOOP_BYTES:
            return xxhash.xxh3_64_intdigest(data) == info.checksum
        return await asyncio.to_thread(xxhash.xxh3_64_intdigest, data) == info.checksum

    async def _verify_streaming(self, tier: Tier, digest: bytes, info: ChunkInfo) -> None:
        hasher = xxhash.xxh3_64()
        size = 0
        pieces = tier.stream(digest, 0, info.size, self.settings.read_window_bytes)
        try:
            async for piece in pieces:
                if len(piece) > _HASH_ON_LOOP_BYTES:
                    await asyncio.to_thread(hasher.update, piece)  # first touch of mapped pages: off the loop
                else:
                    hasher.update(piece)
                size += len(piece)
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        if size != info.size or hasher.intdigest() != info.checksum:
            raise backend.ChunkCorrupt("checksum mismatch")

    async def _check_stale(self, tier: Tier, bit: int, digest: bytes, info: ChunkInfo) -> None:
        """A mismatch may be the index's fault (an entry from before the chunk was re-written, here
        or by another gateway): the tier's own record decides. Raises _StaleEntry if so."""
        try:
            meta = await tier.stat(digest)
        except backend.BackendError:
            return
        if (meta.size, meta.checksum) == (info.size, info.checksum):
            return
        await self.index.delete(digest)
        fresh = await self._index_found(digest, meta, bit, self.clock())
        raise _StaleEntry(fresh)

    # -- moving chunks between tiers (lifecycle, promotion, prefetch) -------------------------

    async def copy_chunk(self, digest: bytes, info: ChunkInfo, src: int, dst: int, *, retried: bool = False
                         ) -> None:
        """Copy one chunk between tiers, verifying size and checksum on the way; the target keeps the
        source's full record (parent, attrs). An existing target copy is kept if it is the same chunk
        and replaced if it is a stale leftover (an earlier copy of a since re-written key)."""
        source, target = self.tiers[src], self.tiers[dst]
        meta_task = asyncio.ensure_future(source.stat(digest))
        staged = await target.stage(digest)
        try:
            hasher = xxhash.xxh3_64()
            size = 0
            pieces = source.stream(digest, 0, info.size, self.settings.read_window_bytes)
            try:
                async for piece in pieces:
                    hasher.update(piece)
                    size += len(piece)
                    await staged.write(piece)
            finally:
                await pieces.aclose()  # type: ignore[attr-defined]
            meta = await meta_task
            if size != info.size or hasher.intdigest() != info.checksum:
                raise backend.ChunkCorrupt(f"copy from {TIER_NAMES[src]} does not match the index")
            created = await staged.publish(meta)
        except BaseException:
            meta_task.cancel()
            await staged.discard()
            raise
        self.moved_bytes[f"{TIER_NAMES[src]}->{TIER_NAMES[dst]}"] += size
        if created:
            return
        existing = await target.stat(digest)
        if (existing.size, existing.checksum) != (info.size, info.checksum):
            if retried:
                raise backend.BackendError("a different chunk keeps appearing at the copy target")
            await target.delete(digest)
            await self.copy_chunk(digest, info, src, dst, retried=True)

    async def _promote(self, digest: bytes, info: ChunkInfo) -> bool:
        """Copy an S3-only chunk into the filesystem tier, once for all concurrent readers.

        False if that is not possible now (filesystem full, S3 copy damaged or unreachable): the
        caller then reads from S3 directly and reports what it finds.
        """
        future = self._promotions.get(digest)
        if future is None:
            future = asyncio.ensure_future(self._do_promote(digest, info))
            self._promotions[digest] = future
            future.add_done_callback(lambda _: self._promotions.pop(digest, None))
        return await asyncio.shield(future)

    async def _do_promote(self, digest: bytes, info: ChunkInfo) -> bool:
        try:
            await self.copy_chunk(digest, info, TIER_S3, TIER_FS)
        except backend.BackendError as exc:
            log.info("promotion of %s/%s skipped: %s", info.bucket, info.key, type(exc).__name__)
            return False
        entry = await self.index.update_tiers(digest, add=TIER_FS)
        if entry is None:  # deleted meanwhile: drop the copy we made
            await self.fs.delete(digest)
            return False
        parent = self.index.parent_of(digest)
        self.events.stored(info.bucket, digest, TIER_FS, info.size, info.expires, parent, self.clock())
        self.promotions += 1
        return True

    async def prefetch(self, bucket: BucketPolicy, keys: Sequence[str]) -> PrefetchResult:
        """Start promoting the S3-only chunks among ``keys``; returns at once with what was accepted."""
        infos = await self.open_many(bucket, keys)
        accepted = local = missing = 0
        for info in infos:
            if info is None:
                missing += 1
            elif info.tiers & TIER_FS or self.s3 is None:
                local += 1
            else:
                accepted += 1
                task = asyncio.ensure_future(self._prefetch_one(info))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return PrefetchResult(accepted, local, missing)

    async def _prefetch_one(self, info: ChunkInfo) -> bool:
        async with self._prefetch_slots:
            return await self._promote(chunk_digest(info.bucket, info.key), info)

    async def demote(self, digest: bytes, entry: IndexEntry) -> None:
        """Move a chunk from the filesystem tier to S3: copy, verify, switch the index, delete."""
        info = ChunkInfo.from_entry(entry)
        if not entry.tiers & TIER_S3:
            await self.copy_chunk(digest, info, TIER_FS, TIER_S3)
        updated = await self.index.update_tiers(digest, add=TIER_S3, remove=TIER_FS, done_pending=True)
        if updated is not None and not entry.tiers & TIER_S3:
            self.events.stored(entry.bucket, digest, TIER_S3, entry.size, entry.expires,
                               self.index.parent_of(digest), self.clock())
        await self.fs.delete(digest)
        self.events.removed(entry.bucket, digest, TIER_FS)

    async def replicate(self, digest: bytes) -> bool:
        """Write-through: copy a queued chunk to S3 and record it. False if there was nothing to do."""
        assert self.s3 is not None
        entry = self.index.get(digest)
        if entry is None or not entry.tiers & TIER_FS or entry.tiers & TIER_S3:
            await self.index.update_tiers(digest, done_pending=True)
            return False
        try:
            await self.copy_chunk(digest, ChunkInfo.from_entry(entry), TIER_FS, TIER_S3)
        except backend.ChunkNotFound:
            await self.index.update_tiers(digest, done_pending=True)
            return False
        await self.index.update_tiers(digest, add=TIER_S3, done_pending=True)
        self.events.stored(entry.bucket, digest, TIER_S3, entry.size, entry.expires,
                           self.index.parent_of(digest), self.clock())
        return True

    async def drop_copy(self, digest: bytes, entry: IndexEntry, bit: int) -> None:
        """Evict one tier's copy. The last copy goes bytes first, then index; a copy that has a twin
        elsewhere goes index first, so the index never points at bytes that are gone."""
        tier = self.tiers[bit]
        if entry.tiers & ~bit:
            await self.index.update_tiers(digest, remove=bit)
            await tier.delete(digest)
        else:
            await tier.delete(digest)
            await self.index.delete(digest)
        self.events.removed(entry.bucket, digest, bit)

    async def expire(self, digest: bytes, entry: IndexEntry) -> None:
        """Reclaim an expired chunk's bytes everywhere (it has been absent to readers since expiry)."""
        bits = [bit for bit in (TIER_S3, TIER_FS) if entry.tiers & bit and bit in self.tiers]
        for bit in bits:
            await self.tiers[bit].delete(digest)
            self.events.removed(entry.bucket, digest, bit)
        await self.index.delete(digest)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()


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
