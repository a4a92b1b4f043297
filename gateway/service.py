"""The chunk service: the request path, the one place that implements write-once storage, lookups
and verified reads.

Every API (native, S3) calls this; it calls the index, the tiers and, to copy chunks between tiers,
the tier mover (``gateway.mover``, which is also the lifecycle engine's API). Rules it enforces:

- Write-once: the first complete write of a key wins; later writes store nothing and report the
  chunk that exists. A write becomes visible only complete and verified (tier ``publish``).
- The index is a cache: a miss falls through to the tiers (filesystem, then S3), so a chunk another
  gateway wrote (or one the index lost) is found and then indexed. An expired entry is absent at once.
  Lookups (HEAD, exists, prefix, locate) answer from an index hit without touching a tier; with
  several gateways an entry can be stale for as long as the cluster feed lags (``gateway.cluster``).
- A stale index costs a lookup, never a write: before a write answers "the key exists" (PUT 200 with
  ``X-Kvgw-Existed``, ``If-None-Match: *`` 412, S3 PutObject / CompleteMultipartUpload), the chunk
  is confirmed in a tier (``lookup_for_write``); a stale entry is dropped and the write proceeds. The
  tier's create-if-absent (``link``) stays the arbiter between concurrent writers.
- A read whose indexed copies are all gone asks the tiers once more before answering 404 (another
  gateway may have moved the chunk to the other tier); bytes of a deleted chunk are never served.
- Reads are verified before their first byte leaves (setting ``verify_reads``): a chunk whose bytes
  no longer match its checksum is quarantined and reported absent, never served.
- Tiers: a chunk lives in the filesystem tier, the S3 tier, or both (index tier bits, ``TierId``).
  Reads prefer the filesystem; a read of an S3-only chunk first copies it into the filesystem tier
  (``TierMover.promote``, once however many readers wait for it).

Errors: every public method raises only domain errors (``gateway.errors``), never a backend's
(``backends.errors``); the translation happens here, in ``translate_backend_error``. A ``ChunkBody``
also raises domain errors while it streams.

Every change is reported to ``events`` (the lifecycle ledgers and the cluster feed) so the lifecycle
engine can keep its order of eviction and other gateways their indexes. Writes and deletes are refused
(503) while ``admit_writes`` says no: the cluster feed cannot take more events (the catalog has been
unreachable for long; see ``gateway.cluster``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

import xxhash

from backends import errors as backend
from backends.base import HASH_ON_LOOP_BYTES, AheadRead, ChunkMeta, FileLocator, SyncStagedChunk, Tier
from backends.catalog.store import BucketPolicy
from backends.index import ChunkIndex, IndexEntry
from backends.request_path import RequestPathTier, request_budget
from backends.tiers import TierId
from gateway.access import Directory
from gateway.buckets import check_chunk_size
from gateway.chunks import (
    ByteRange,
    ChunkBody,
    ChunkEvents,
    ChunkInfo,
    ChunkLocation,
    ListPage,
    NoEvents,
    PrefetchResult,
    PutResult,
    RemovedReason,
    ThreadedBody,
    resolve_range,
)
from gateway.config import Settings
from gateway.errors import (
    BadDigest,
    Declined,
    IncompleteBody,
    InvalidKey,
    InvalidRequest,
    NoSuchChunk,
    ServiceUnavailable,
    translate_backend_error,
)
from gateway.hints import HINT_MARKS
from gateway.leases import LeaseBook, LeaseGrant
from gateway.lifecycle.admission import decide
from gateway.mover import TierMover
from gateway.read_budget import ReadBudget, budgeted
from kvgw_client.keys import InvalidKeyError, chunk_digest, digest_many
from kvgw_client.wire import Hint

log = logging.getLogger("kvgw.service")

_READ_PREFERENCE = tuple(TierId)  # reads and lookups try the tiers in TierId order: filesystem first


class _StaleEntry(Exception):
    """The index disagreed with a tier's own record of a chunk; it has been corrected."""

    def __init__(self, fresh: ChunkInfo) -> None:
        super().__init__()
        self.fresh = fresh


class _BodyTally:
    """What a PUT has received so far: its size, held to the declared length and the bucket's chunk
    size limit as the bytes arrive, its xxh3-64 and, when the client sent a Content-MD5 or the bucket's
    ETags are MD5s, its MD5. Fed
    one piece at a time, from the event loop or from a receiving thread, never both at once."""

    def __init__(self, bucket: BucketPolicy, length: int | None, *, md5: bool) -> None:
        self.bucket = bucket
        self.length = length
        self.received = 0
        self.hasher = xxhash.xxh3_64()
        self.md5 = hashlib.md5() if md5 else None

    def add(self, piece: bytes | memoryview) -> None:
        self.received += len(piece)
        if self.length is not None and self.received > self.length:
            raise InvalidRequest("the body is longer than Content-Length")
        if self.length is None and self.received > self.bucket.max_chunk_bytes:
            check_chunk_size(self.bucket, self.received)
        self.hasher.update(piece)
        if self.md5 is not None:
            self.md5.update(piece)


def _tally_and_write(tally: _BodyTally, write_now: Callable[[memoryview], None], piece: memoryview) -> None:
    """One piece of a threaded receive, in its worker thread: counted and hashed, then written."""
    tally.add(piece)
    write_now(piece)


class ChunkService:
    def __init__(
        self,
        settings: Settings,
        directory: Directory,
        index: ChunkIndex,
        tiers: Mapping[TierId, Tier],
        *,
        mover: TierMover | None = None,
        events: ChunkEvents | None = None,
        clock: Callable[[], float] = time.time,
        admit_writes: Callable[[], str | None] | None = None,
        leases: LeaseBook | None = None,
        pressed: Callable[[BucketPolicy], bool] | None = None,
    ) -> None:
        """``mover``: the tier mover promotions go through (the lifecycle engine shares it); by default
        one of the service's own over the same index, tiers, events and clock. ``admit_writes``: None
        while writes may proceed, else why not (the answer is 503 with that message). ``leases``: where
        lookups take read leases (``lease``); without it a lease request is refused. ``pressed(bucket)``:
        whether the bucket's filesystem tier is at its low watermark or above, when admission declines
        writes not worth what they would evict (``admit``); without it nothing is declined."""
        self._settings = settings
        self._directory = directory
        self._index = index
        self._tiers = dict(tiers)
        # What a waiting client asks of S3 runs under the request path's budgets (backends.request_path):
        # a hung S3 costs a lookup lookup_timeout, never the tier's 30 s operation deadline.
        self._s3_view = None if TierId.S3 not in self._tiers else RequestPathTier.for_s3(self._tiers[TierId.S3],
                                                                                        settings.s3)
        if self._s3_view is not None:
            self._tiers[TierId.S3] = self._s3_view
        self._s3 = self._tiers.get(TierId.S3)
        self._events: ChunkEvents = events if events is not None else NoEvents()
        self._clock = clock
        self._mover = mover if mover is not None else TierMover(
            index, tiers, events=self._events, clock=clock, read_window_bytes=settings.read_window_bytes,
            prefetch_concurrency=settings.prefetch_concurrency,
        )
        self._admit_writes = admit_writes
        self._leases = leases
        self._budget = ReadBudget(settings.read_buffer_budget_bytes)
        self._background: set[asyncio.Task[None]] = set()
        self.write_through_skipped = 0  # writes not queued for S3 because the queue was full
        self._pressed = pressed
        self.admission: dict[str, dict[str, int]] = {}  # bucket -> outcome under pressure -> writes

    async def bucket(self, name: str) -> BucketPolicy:
        return await self._directory.bucket(name)

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
        entry = self._index.get(digest)
        if entry is not None:
            return ChunkInfo.from_entry(entry) if self._readable(digest, entry, self._clock()) else None
        return (await self._fall_through_many([digest], bucket.name, [key], strict=strict))[0]

    # -- the same answers without waiting (the lookup lane, gateway.dataplane.lane) -----------------------
    #
    # Each gives what its async namesake gives when that needs no waiting: an index hit, or a miss
    # every tier to be asked rules out at once (``Tier.absent_now``: a local filesystem's dentry
    # cache; never S3 or NFS). None when only the async call can tell.

    def head_now(self, bucket: BucketPolicy, key: str) -> ChunkInfo | None:
        """``head``: the live chunk, NoSuchChunk when it is certainly absent, None when unknown."""
        digest = chunk_digest(bucket.name, key)
        entry = self._index.get(digest)
        if entry is not None:
            if self._readable(digest, entry, self._clock()):
                return ChunkInfo.from_entry(entry)
            raise NoSuchChunk()
        if self._absent_now([digest]):
            raise NoSuchChunk()
        return None

    def exists_now(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[bool] | None:
        digests = self._digests(bucket, keys)
        alive = self._index.alive_many(digests, self._clock())
        if all(alive) or self._absent_now([digests[i] for i, hit in enumerate(alive) if not hit]):
            return alive
        return None

    def prefix_now(self, bucket: BucketPolicy, keys: Sequence[str]) -> int | None:
        digests = self._digests(bucket, keys)
        length = self._index.alive_prefix(digests, self._clock())
        if length < len(keys) and not self._absent_now(digests[length : length + 1]):
            return None
        asyncio.get_running_loop().call_soon(self._events.chained, bucket.name, digests)
        return length

    def _absent_now(self, digests: list[bytes]) -> bool:
        """Whether ``_fall_through_many`` would find none of ``digests``, known without waiting."""
        todo = [digest for digest, entry in zip(digests, self._index.get_many(digests), strict=True) if entry is None]
        return not todo or all(tier.absent_now(todo) for _, tier in self._miss_tiers())

    def _miss_tiers(self) -> list[tuple[TierId, Tier]]:
        """The tiers an index miss is looked up in, in read order (S3 only with ``s3_lookup_on_miss``)."""
        return [(bit, tier) for bit in _READ_PREFERENCE if (tier := self._tiers.get(bit)) is not None
                and (bit != TierId.S3 or self._settings.s3_lookup_on_miss)]

    def _readable(self, digest: bytes, entry: IndexEntry, now: float) -> bool:
        """Alive, or expired under a read lease this process granted (``LeaseBook.leased_here``)."""
        return entry.alive(now) or (self._leases is not None and self._leases.leased_here(digest, now))

    async def head(self, bucket: BucketPolicy, key: str) -> ChunkInfo:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return info

    async def lookup_for_write(self, bucket: BucketPolicy, key: str) -> ChunkInfo | None:
        """The live chunk under (bucket, key) as the tiers hold it now: what a write must respect.

        Unlike ``lookup``, an index hit is not trusted: another gateway may have deleted, evicted or
        expired the chunk since this index learned of it, and answering "exists" for it would lose
        the write. The hit is confirmed by a ``stat`` of a tier the entry names (the chunk file's
        footer; in S3 a ranged read of it); a copy of another incarnation replaces the entry; an
        expired copy is reclaimed now (so the write can take the key); if no tier holds it, the entry
        is dropped and the tiers are asked as on a miss.

        Unreachable tiers (S3 down): an indexed copy that cannot be confirmed is trusted (write-once
        keeps the indexed chunk rather than storing a second one); on a miss, only a bucket whose write
        tier is S3 needs S3 to answer (ServiceUnavailable otherwise); a filesystem-tier bucket writes
        to the filesystem, whose create-if-absent decides (``gateway.mover`` reconciles with S3 later).
        """
        digest = chunk_digest(bucket.name, key)
        entry = self._index.get(digest)
        if entry is not None:
            now = self._clock()
            for bit in _READ_PREFERENCE:
                tier = self._tiers.get(bit)
                if tier is None or not entry.tiers & bit:
                    continue
                try:
                    meta = await tier.stat(digest)
                except backend.ChunkNotFound:
                    continue
                except backend.ChunkCorrupt:
                    await self._quarantine(tier, bit, digest, ChunkInfo.from_entry(entry))
                    continue
                except backend.TierUnavailable:
                    return ChunkInfo.from_entry(entry) if entry.alive(now) else None  # cannot confirm
                except backend.BackendError as exc:
                    raise translate_backend_error(exc) from exc
                if meta.bucket != bucket.name or meta.key != key:
                    continue
                try:
                    if 0 < meta.expires <= now:
                        await self._reclaim_expired(digest, meta)
                        return None
                    return await self._reindex(digest, meta, bit, now)
                except backend.BackendError as exc:
                    raise translate_backend_error(exc) from exc
            # no tier the entry names holds the chunk: forget it, then look everywhere as on a miss
            try:
                dropped = await self._index.delete(digest)
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
            if dropped is not None:
                for bit in TierId:
                    if dropped.tiers & bit:
                        self._events.removed(bucket.name, digest, bit, reason="vanished",
                                             info=ChunkInfo.from_entry(dropped))
        strict = bucket.write_tier == TierId.S3.label and self._s3 is not None
        return (await self._fall_through_many([digest], bucket.name, [key], strict=strict))[0]

    async def _reindex(self, digest: bytes, meta: ChunkMeta, bit: TierId, now: float) -> ChunkInfo:
        """Make the index agree with a copy found in tier ``bit``: keep an entry of the same incarnation
        (adding the tier bit if missing), replace one of another."""
        entry = self._index.get(digest)
        if entry is not None and (entry.size, entry.checksum, entry.created) == (meta.size, meta.checksum,
                                                                                 meta.created):
            if not entry.tiers & bit:
                updated = await self._index.update_tiers(digest, add=bit)
                if updated is not None:
                    entry = updated
                    self._events.stored(meta.bucket, digest, bit, meta.size, meta.expires, None, now,
                                        reason="learned", info=ChunkInfo.from_entry(entry))
            return ChunkInfo.from_entry(entry)
        return await self._index_found(digest, meta, bit, now)

    async def _reclaim_expired(self, digest: bytes, meta: ChunkMeta) -> None:
        """Delete an expired chunk's copies (absent to readers already) so a new write can take the key."""
        info = ChunkInfo(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires)
        for bit in (TierId.S3, TierId.FS):
            tier = self._tiers.get(bit)
            if tier is not None and await tier.delete(digest):
                self._events.removed(meta.bucket, digest, bit, reason="expired", info=info)
        await self._index.delete(digest)

    async def exists(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[bool]:
        digests = self._digests(bucket, keys)
        alive = self._index.alive_many(digests, self._clock())
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
        asyncio.get_running_loop().call_soon(self._events.chained, bucket.name, digests)
        start = 0
        while start < len(keys):
            start += self._index.alive_prefix(digests[start:] if start else digests, self._clock())
            if start == len(keys):
                break
            found = await self._fall_through_many([digests[start]], bucket.name, [keys[start]], strict=False)
            if found[0] is None:
                break
            start += 1
        return start

    def exists_leased_now(self, bucket: BucketPolicy, keys: Sequence[str],
                          lease_ms: int) -> tuple[list[bool], tuple[LeaseGrant, set[str]]] | None:
        """``exists_now`` and ``lease_now`` of its hits in one index pass (the lease's bytes read with the
        hits): what ``exists_now`` answers, and what ``lease_now`` answers; None when only the async calls
        can tell. Event loop; never blocks."""
        if self._leases is None:
            return None
        digests = self._digests(bucket, keys)
        sizes = self._index.live_sizes(digests, self._clock())
        found = [size >= 0 for size in sizes]
        if all(found):
            hits, held = digests, sizes
        else:
            if not self._absent_now([digest for digest, hit in zip(digests, found, strict=True) if not hit]):
                return None
            hits = [digest for digest, hit in zip(digests, found, strict=True) if hit]
            held = [size for size in sizes if size >= 0]
        grant = self._leases.grant_now(bucket.name, hits, held, lease_ms, max_lease_ms=bucket.max_lease_ms,
                                       cap_bytes=bucket.leased_bytes_cap())
        if grant is None:
            return None
        return found, (grant, _keys_of(grant.gone, keys, digests))

    def prefix_leased_now(self, bucket: BucketPolicy, keys: Sequence[str],
                          lease_ms: int) -> tuple[int, tuple[LeaseGrant, set[str]]] | None:
        """``prefix_now`` and ``lease_now`` of the run it found in one index pass: what each answers;
        None when only the async calls can tell. Event loop; never blocks."""
        if self._leases is None:
            return None
        digests = self._digests(bucket, keys)
        sizes = self._index.live_sizes(digests, self._clock())
        length = next((i for i, size in enumerate(sizes) if size < 0), len(sizes))
        if length < len(keys) and not self._absent_now(digests[length : length + 1]):
            return None
        grant = self._leases.grant_now(bucket.name, digests[:length], sizes[:length], lease_ms,
                                       max_lease_ms=bucket.max_lease_ms, cap_bytes=bucket.leased_bytes_cap())
        if grant is None:
            return None
        asyncio.get_running_loop().call_soon(self._events.chained, bucket.name, digests)
        return length, (grant, _keys_of(grant.gone, keys, digests))

    def lease_now(self, bucket: BucketPolicy, keys: Sequence[str], lease_ms: int) -> tuple[LeaseGrant, set[str]] | None:
        """``lease`` without waiting (a plain call the lookup path makes inline): None when only
        ``lease`` can answer (``LeaseBook.grant_now``: the process's first lease, one longer than it
        announced, one past its share of a capped bucket, a chunk removed a moment ago to re-check)."""
        if self._leases is None:
            return LeaseGrant(refused="this gateway grants no leases"), set()
        digests = self._digests(bucket, keys)
        grant = self._leases.grant_now(bucket.name, digests, self._index.sizes_many(digests), lease_ms,
                                       max_lease_ms=bucket.max_lease_ms, cap_bytes=bucket.leased_bytes_cap())
        if grant is None:
            return None
        return grant, _keys_of(grant.gone, keys, digests)

    async def lease(self, bucket: BucketPolicy, keys: Sequence[str], lease_ms: int) -> tuple[LeaseGrant, set[str]]:
        """Read-lease the chunks of ``keys``, which a lookup found just now (``gateway.leases``).

        Returns the grant and the keys to answer as absent after all: chunks the lifecycle is removing
        now, and chunks it removed a moment ago that no tier holds again. Never raises for the lease
        table: without it the lookup answers without a lease (``LeaseGrant.refused`` says why). Mostly
        ``lease_now``; otherwise one sync of the lease table first."""
        now = self.lease_now(bucket, keys, lease_ms)
        if now is not None:
            return now
        assert self._leases is not None
        digests = self._digests(bucket, keys)
        grant = await self._leases.grant(bucket.name, digests, self._index.sizes_many(digests), lease_ms,
                                         max_lease_ms=bucket.max_lease_ms, cap_bytes=bucket.leased_bytes_cap())
        by_digest = dict(zip(digests, keys, strict=True))
        absent = {by_digest[d] for d in grant.gone}
        if grant.recheck:
            rechecked = sorted(grant.recheck)
            present = await self._held_by_a_tier(bucket.name, rechecked, [by_digest[d] for d in rechecked])
            absent |= {by_digest[d] for d, held in zip(rechecked, present, strict=True) if not held}
        return grant, absent

    async def _held_by_a_tier(self, bucket: str, digests: list[bytes], keys: list[str]) -> list[bool]:
        """Whether some tier holds each chunk now (asked of the tiers, not the index: the lifecycle that
        removed it may run on another gateway, whose news this index has not had yet)."""
        held = [False] * len(digests)
        now = self._clock()
        for bit in _READ_PREFERENCE:
            tier = self._tiers.get(bit)
            todo = [i for i, h in enumerate(held) if not h]
            if tier is None or not todo:
                continue
            try:
                metas = await tier.stat_many([digests[i] for i in todo])
            except backend.BackendError:
                continue  # unknown: answered absent, which costs a recompute, never a failed load
            for i, meta in zip(todo, metas, strict=True):
                held[i] = (meta is not None and meta.bucket == bucket and meta.key == keys[i]
                           and not 0 < meta.expires <= now)
        return held

    async def _fall_through_many(
        self, digests: list[bytes], bucket: str, keys: Sequence[str], *, strict: bool
    ) -> list[ChunkInfo | None]:
        """Look index misses up in the tiers; index what is found (another gateway wrote it).

        Digests that are indexed but expired stay absent without touching a tier.
        """
        entries = self._index.get_many(digests)
        todo = [i for i, entry in enumerate(entries) if entry is None]
        out: list[ChunkInfo | None] = [None] * len(digests)
        for bit, tier in self._miss_tiers():
            if not todo:
                break
            try:
                metas = await tier.stat_many([digests[i] for i in todo])
            except backend.TierUnavailable as exc:
                if strict:
                    raise ServiceUnavailable() from exc
                continue
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
            now = self._clock()
            remaining = []
            for i, meta in zip(todo, metas, strict=True):
                if meta is None or meta.bucket != bucket or meta.key != keys[i]:
                    remaining.append(i)
                    continue
                if 0 < meta.expires <= now:
                    continue
                try:
                    out[i] = await self._index_found(digests[i], meta, bit, now)
                except backend.BackendError as exc:
                    raise translate_backend_error(exc) from exc
            todo = remaining
        return out

    async def _index_found(self, digest: bytes, meta: ChunkMeta, bit: TierId, now: float) -> ChunkInfo:
        """Index a copy found in a tier (written by another gateway, or before the index was lost)."""
        entry = IndexEntry(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires,
                           last_access=now, tiers=bit, md5_etag=meta.md5_etag)
        parent = None if meta.parent is None else chunk_digest(meta.bucket, meta.parent)
        await self._index.put(digest, entry, parent)
        info = ChunkInfo.from_entry(entry)
        self._events.stored(meta.bucket, digest, bit, meta.size, meta.expires, parent, now, reason="learned",
                            info=info)
        return info

    def touch(self, bucket: BucketPolicy, keys: Sequence[str]) -> int:
        """Record uses the gateway did not serve, so eviction still sees them: reads that bypassed it
        (clients reading chunk files directly from a shared tier directory), and writes of chunks
        already stored (the writer computed that prefix again: write-once keeps the stored bytes, and
        eviction counts the offer as a read). Returns how many keys were indexed and alive."""
        now = self._clock()
        digests = self._digests(bucket, keys)
        touched = 0
        for digest, entry in zip(digests, self._index.get_many(digests), strict=True):
            if entry is None or not entry.alive(now):
                continue
            self._index.touch(digest, now)
            self._events.read(bucket.name, digest, TierId.FS if entry.tiers & TierId.FS else TierId.S3, now)
            touched += 1
        return touched

    async def hint(self, bucket: BucketPolicy, keys: Sequence[str], hint: Hint) -> int:
        """Apply an engine hint to the chunks under ``keys`` (``gateway.hints``): their marks change in
        the index and the change goes to the cluster feed. Returns how many of the keys are indexed;
        the others (never stored, evicted, another gateway's not yet seen) are ignored."""
        set_marks, clear_marks = HINT_MARKS[hint]
        digests = self._digests(bucket, keys)
        try:
            found = await self._index.mark(digests, set_marks, clear_marks)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        now = self._clock()
        for digest, present in zip(digests, found, strict=True):
            if present:
                self._events.marked(bucket.name, digest, set_marks, clear_marks, now)
        return sum(found)

    async def locate(self, bucket: BucketPolicy, keys: Sequence[str]) -> list[ChunkLocation | None]:
        """Resolve a batch read whose bytes the client will read from the tier directory itself.

        Resolution is a batch-get's (index, fall-through, chain learning), and every located file
        copy counts as read for eviction. The client verifies size and checksum of what it reads and
        falls back to batch-get for anything it cannot read, so a file evicted meanwhile costs a
        retry, never wrong bytes. None: no such chunk.
        """
        infos = await self.open_many(bucket, keys)
        fs = self._tiers.get(TierId.FS)
        locator = fs if isinstance(fs, FileLocator) else None
        now = self._clock()
        located: list[ChunkLocation | None] = []
        for info in infos:
            if info is None:
                located.append(None)
                continue
            path = None
            if locator is not None and info.tiers & TierId.FS:
                digest = chunk_digest(info.bucket, info.key)
                path = locator.relative_path(digest)
                self._index.touch(digest, now)
                self._events.read(info.bucket, digest, TierId.FS, now)
            located.append(ChunkLocation(info, path))
        return located

    async def chunk_meta(self, info: ChunkInfo) -> ChunkMeta:
        """The chunk's full recorded metadata (attrs included), from a tier that holds it."""
        digest = chunk_digest(info.bucket, info.key)
        for bit in _READ_PREFERENCE:
            tier = self._tiers.get(bit)
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
        length: int | None,
        checksum: int | None = None,
        md5: bytes | None = None,
        ttl: int | None = None,
        parent: str | None = None,
        attrs: dict[str, str] | None = None,
        threaded: ThreadedBody | None = None,
        md5_etag: str | None = None,
        marks: int = 0,
    ) -> PutResult:
        """Stream ``body`` into the bucket's write tier; publish only if complete and matching the
        given digests. With write-through the chunk is queued for S3 in the same index commit.

        ``attrs`` is read only after the body has been consumed, so a caller may add values computed
        from the body while it streams (the S3 API stores the checksums it verified that way).
        ``length`` None: the body's end decides the size (a chunked upload), still within the bucket's
        chunk size limit, which is then enforced as the bytes arrive. ``threaded``: the same body, whose
        leading pieces can be received in a worker thread; where the tier can take bytes from that
        thread (``SyncStagedChunk``), they are hashed and written there, and ``body`` yields the rest.

        ETags (``BucketPolicy.etag_mode``): in an MD5-mode bucket the chunk records its S3 ETag, the MD5
        of the body, computed by the same pass that computes its xxh3 (in the receiving thread for a
        threaded receive), never by a second read; ``md5_etag`` gives it instead when the caller has it
        already (a multipart upload's, made of its parts' MD5s). Other buckets record none.
        ``marks``: hint marks the chunk starts with (its retention class, ``gateway.hints``).
        """
        if length is not None:
            check_chunk_size(bucket, length)
        self._check_admission()
        bit = TierId.S3 if bucket.write_tier == TierId.S3.label and self._s3 is not None else TierId.FS
        tier = self._tiers[bit]
        digest = chunk_digest(bucket.name, key)
        md5_mode = bucket.etag_mode == "md5"
        tally = _BodyTally(bucket, length, md5=md5 is not None or (md5_mode and md5_etag is None))
        try:
            staged = await tier.stage(digest)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        try:
            if threaded is not None and isinstance(staged, SyncStagedChunk):
                await threaded.consume_in_thread(functools.partial(_tally_and_write, tally, staged.write_now))
            async for piece in body:
                tally.add(piece)
                await staged.write(piece)
            size = tally.received
            if length is not None and size != length:
                raise IncompleteBody(f"received {size} of {length} bytes")
            if length is None:
                check_chunk_size(bucket, size)  # a chunked body that ended without a byte
            value = tally.hasher.intdigest()
            if checksum is not None and checksum != value:
                raise BadDigest("the body does not match X-Kvgw-Checksum")
            if md5 is not None and tally.md5 is not None and tally.md5.digest() != md5:
                raise BadDigest("the body does not match Content-MD5")
            if not md5_mode:
                md5_etag = None
            elif md5_etag is None and tally.md5 is not None:
                md5_etag = tally.md5.hexdigest()
            now = self._clock()
            ttl = ttl if ttl is not None else bucket.default_ttl_seconds
            meta = ChunkMeta(bucket.name, key, size, value, now, now + ttl if ttl else 0.0, parent,
                             tuple(sorted((attrs or {}).items())), md5_etag)
            created = await staged.publish(meta)
        except backend.BackendError as exc:
            await staged.discard()
            raise translate_backend_error(exc) from exc
        except BaseException:
            await staged.discard()
            raise
        if not created:
            existing = await self._winner(tier, bit, digest, bucket.name, key)
            if existing is None:
                # Another write won, and its chunk was already evicted or deleted: to the client this
                # is the same as "stored, then evicted". Report what the winner held as far as we know.
                existing = ChunkInfo.from_meta(meta, bit)
            return PutResult(False, existing)
        parent_digest = None if parent is None else chunk_digest(bucket.name, parent)
        entry = IndexEntry(bucket.name, key, size, value, now, meta.expires, last_access=now, tiers=bit,
                           md5_etag=md5_etag, marks=marks)
        replicate = bucket.write_through and bit == TierId.FS and self._s3 is not None
        if replicate and self._index.pending_count() >= self._settings.write_through_max_pending:
            replicate = False
            self.write_through_skipped += 1
        try:
            await self._index.put(digest, entry, parent_digest, replicate=replicate)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        info = ChunkInfo.from_entry(entry)
        self._events.stored(bucket.name, digest, bit, size, meta.expires, parent_digest, now, info=info)
        if marks:
            self._events.marked(bucket.name, digest, marks, 0, now)
        return PutResult(True, info)

    async def _winner(self, tier: Tier, bit: TierId, digest: bytes, bucket: str, key: str) -> ChunkInfo | None:
        """The chunk that kept the key when our publish lost the create-if-absent race: the tier's own
        record (the index may describe an older incarnation), indexed; None if it is gone already."""
        try:
            meta = await tier.stat(digest)
        except backend.BackendError:
            return None
        now = self._clock()
        if meta.bucket != bucket or meta.key != key or 0 < meta.expires <= now:
            return None
        try:
            return await self._reindex(digest, meta, bit, now)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc

    def admit(self, bucket: BucketPolicy, marks: int) -> None:
        """Admission under pressure (``gateway.lifecycle.admission``), before a new chunk's body is read:
        while the bucket's filesystem tier is at its low watermark or above, a chunk hinted as read by
        no one again is declined (``Declined``, with the reason). Outcomes under pressure are counted
        per bucket (``admission``; ``kvgw_admission_total``). Only the native API asks: S3 clients know
        no "not stored" answer."""
        if self._pressed is None or not self._pressed(bucket):
            return
        reason = decide(marks=marks)
        counts = self.admission.setdefault(bucket.name, {})
        outcome = reason or "admitted"
        counts[outcome] = counts.get(outcome, 0) + 1
        if reason is not None:
            raise Declined(reason)

    def _check_admission(self) -> None:
        if self._admit_writes is not None and (why := self._admit_writes()) is not None:
            raise ServiceUnavailable(why)

    async def delete(self, bucket: BucketPolicy, key: str) -> bool:
        """Remove a chunk from every tier, S3 first (if S3 is down nothing changes: 503), then the
        filesystem, then the index (a crash in between leaves a dangling entry, which the next read
        drops; the reverse order would resurrect the chunk).

        Each copy is read (``stat``) before it is deleted, so the event that tells the cluster says
        which incarnation went and how many bytes the tier got back, whatever this index knew."""
        self._check_admission()
        digest = chunk_digest(bucket.name, key)
        entry = self._index.get(digest)
        removed = await self._delete_copies(digest, bucket.name, key, (TierId.S3, TierId.FS), entry)
        try:
            dropped = await self._index.delete(digest)
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        return removed or dropped is not None or entry is not None

    async def _delete_copies(self, digest: bytes, bucket: str, key: str, bits: Sequence[TierId],
                             entry: IndexEntry | None) -> bool:
        removed = False
        for bit in bits:
            tier = self._tiers.get(bit)
            if tier is None:
                continue
            try:
                meta = (await tier.stat_many([digest]))[0]
                gone = await tier.delete(digest)
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
            if not gone:
                continue
            removed = True
            if meta is not None and (meta.bucket, meta.key) == (bucket, key):
                info: ChunkInfo | None = ChunkInfo(bucket, key, meta.size, meta.checksum, meta.created,
                                                   meta.expires, bit)
            else:
                info = None if entry is None else ChunkInfo.from_entry(entry)
            self._events.removed(bucket, digest, bit, reason="deleted", info=info)
        return removed

    # -- reads ---------------------------------------------------------------------------------

    async def open(self, bucket: BucketPolicy, key: str, byte_range: ByteRange | None = None, *,
                   reader_verifies: bool = False, as_file: bool = False) -> ChunkBody:
        info = await self.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return await self.open_info(info, byte_range, reader_verifies=reader_verifies, as_file=as_file)

    async def open_many(self, bucket: BucketPolicy, keys: Sequence[str], *, read_ahead: bool = False,
                        reader_verifies: bool = False, as_file: bool = False) -> list[ChunkInfo | None]:
        """Resolve many keys for a batch read (one index transaction for the hits). ``read_ahead``:
        the gateway itself is about to read them all, whole and in this order, each with ``open_info``
        and the same ``reader_verifies`` / ``as_file``: the filesystem tier may start now."""
        digests = self._digests(bucket, keys)
        asyncio.get_running_loop().call_soon(self._events.chained, bucket.name, digests)
        now = self._clock()
        infos: list[ChunkInfo | None] = []
        misses: list[int] = []
        for i, (digest, entry) in enumerate(zip(digests, self._index.get_many(digests), strict=True)):
            if entry is None:
                misses.append(i)
            infos.append(ChunkInfo.from_entry(entry) if entry is not None and self._readable(digest, entry, now)
                         else None)
        if misses:
            found = await self._fall_through_many([digests[i] for i in misses], bucket.name,
                                                  [keys[i] for i in misses], strict=False)
            for i, info in zip(misses, found, strict=True):
                infos[i] = info
        if read_ahead:
            self._read_ahead(infos, reader_verifies=reader_verifies, as_file=as_file)
        return infos

    def _read_ahead(self, infos: list[ChunkInfo | None], *, reader_verifies: bool, as_file: bool) -> None:
        """Let the filesystem tier start reading a batch's chunks from disk while the first is served,
        and open each ahead exactly as ``_read_copy`` will (``FileLocator.read_ahead``)."""
        fs = self._tiers.get(TierId.FS)
        if not isinstance(fs, FileLocator):
            return
        verify = self._settings.verify_reads and not reader_verifies
        files = as_file and not verify  # as _read_copy decides
        reads = [AheadRead(chunk_digest(i.bucket, i.key), i.size, i.checksum if verify else None, as_file=files)
                 for i in infos if i is not None and i.tiers & TierId.FS
                 and (files or i.size <= self._settings.whole_read_max_bytes)]
        if len(reads) > 1:
            task = asyncio.ensure_future(fs.read_ahead(reads))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def open_info(self, info: ChunkInfo, byte_range: ByteRange | None = None, *,
                        reader_verifies: bool = False, as_file: bool = False) -> ChunkBody:
        """Verified bytes of a resolved chunk, from the best tier holding it.

        ``reader_verifies``: the reader checks the bytes against ``info.checksum`` itself (kvgw's client
        does, on every get and batch-get frame), so they are not verified here: every byte is verified
        once, at the end that consumes it; a reader that finds a mismatch reports it (``report_damaged``).
        With ``as_file`` too, a copy in the filesystem tier comes as an open file (``ChunkBody.fd``), for
        the HTTP server to ``sendfile``: the bytes never enter this process.

        NoSuchChunk if every copy vanished or failed verification; ServiceUnavailable if the only
        copy is in a tier that cannot be reached.
        """
        offset, length = resolve_range(byte_range, info.size)
        digest = chunk_digest(info.bucket, info.key)
        now = self._clock()
        self._index.touch(digest, now)
        indexed_tiers = info.tiers
        for attempt in range(2):
            try:
                for bit in _READ_PREFERENCE:
                    if not info.tiers & bit or bit not in self._tiers:
                        continue
                    source = bit
                    if (bit == TierId.S3 and self._settings.promote_on_read
                            and await self._promote(digest, info)):
                        source = TierId.FS
                    body = await self._read_copy(source, digest, info, offset, length,
                                                 verify=self._settings.verify_reads and not reader_verifies,
                                                 as_file=as_file)
                    if body is not None:
                        self._events.read(info.bucket, digest, source, now)
                        if self._leases is not None:
                            self._leases.loaded(info.bucket, ((digest, info.size),))
                        return body
                    info = replace(info, tiers=info.tiers & ~bit)
                if attempt == 0 and (fresh := await self._moved_elsewhere(digest, info, indexed_tiers)):
                    info = fresh
                    offset, length = resolve_range(byte_range, info.size)
                    continue
                raise NoSuchChunk()
            except _StaleEntry as stale:
                if attempt:
                    raise NoSuchChunk() from None
                info = stale.fresh
                offset, length = resolve_range(byte_range, info.size)
            except backend.BackendError as exc:  # from correcting the index or the tier, or a promotion
                raise translate_backend_error(exc) from exc
        raise NoSuchChunk()

    async def _promote(self, digest: bytes, info: ChunkInfo) -> bool:
        """Promote on read (``TierMover.promote``), its S3 calls under the request path's budget: a hung or
        dead S3 fails the promotion within ``request_timeout``, never after the tier's background
        deadlines. If it failed because S3 did not answer, ServiceUnavailable at once (a direct read
        would only wait again); if it failed for another reason (the filesystem tier full), False: the
        reader reads from S3 directly."""
        if self._s3_view is None:
            return await self._mover.promote(digest, info)
        with request_budget(self._s3_view.request_timeout) as budget:
            promoted = await self._mover.promote(digest, info)
        if not promoted and budget.unavailable:
            raise ServiceUnavailable()
        return promoted

    async def _moved_elsewhere(self, digest: bytes, info: ChunkInfo, indexed_tiers: int) -> ChunkInfo | None:
        """Every copy the index named was gone: another gateway may have demoted or promoted the
        chunk meanwhile (the feed tells this index a moment later). Ask the tiers, as on a miss."""
        if info.tiers & indexed_tiers == indexed_tiers:
            return None  # nothing vanished (only unreachable tiers): not a stale entry
        found = await self._fall_through_many([digest], info.bucket, [info.key], strict=False)
        return found[0]

    async def _read_copy(self, bit: TierId, digest: bytes, info: ChunkInfo, offset: int, length: int, *,
                         verify: bool, as_file: bool) -> ChunkBody | None:
        """The range from one tier's copy (verified if ``verify``; an open file if ``as_file`` and the
        tier has files), or None if that copy is gone or damaged (the index and the tier are corrected
        first)."""
        tier = self._tiers[bit]
        if as_file and not verify and isinstance(tier, FileLocator):
            return await self._open_copy(tier, tier, bit, digest, info, offset, length)
        whole = info.size if verify else length
        release = self._budget.try_take(whole) if whole <= self._settings.whole_read_max_bytes else None
        try:
            if release is not None:
                start = 0 if verify else offset
                data = await tier.read(digest, start, whole, checksum=info.checksum if verify else None)
                if len(data) != whole:  # a torn file (a power loss with fsync off): never a partial answer
                    raise backend.ChunkCorrupt("short read")
                if offset != start or length != len(data):
                    data = memoryview(data)[offset - start : offset - start + length]
                return ChunkBody(info, offset, length, data=data, release=release, tier=bit)
            if verify:
                await self._verify_streaming(tier, digest, info)
            window = self._settings.read_window_bytes
            pieces = budgeted(tier.stream(digest, offset, length, window), self._budget, min(length, 2 * window))
            return ChunkBody(info, offset, length, pieces=pieces, tier=bit)
        except backend.ChunkCorrupt:
            if release is not None:
                release()
            await self._check_stale(tier, bit, digest, info)
            await self._quarantine(tier, bit, digest, info)
            return None
        except backend.ChunkNotFound:
            if release is not None:
                release()
            await self._forget_copy(digest, info, bit, "vanished")  # deleted behind our back
            return None
        except backend.BackendError as exc:
            if release is not None:
                release()
            raise translate_backend_error(exc) from exc
        except BaseException:
            if release is not None:
                release()
            raise

    async def _open_copy(self, tier: Tier, files: FileLocator, bit: TierId, digest: bytes, info: ChunkInfo,
                         offset: int, length: int) -> ChunkBody | None:
        """The range as an open file (``open_info``'s ``as_file``): no byte is read here, and no read
        budget is taken (the kernel sends from the page cache)."""
        try:
            fd = await files.open_data(digest, info.size)
        except backend.ChunkCorrupt:
            await self._check_stale(tier, bit, digest, info)  # re-written since: _StaleEntry
            await self._quarantine(tier, bit, digest, info)
            return None
        except backend.ChunkNotFound:
            await self._forget_copy(digest, info, bit, "vanished")
            return None
        except backend.BackendError as exc:
            raise translate_backend_error(exc) from exc
        return ChunkBody(info, offset, length, fd=fd, tier=bit)

    async def report_damaged(self, bucket: BucketPolicy, keys: Sequence[str]) -> int:
        """Readers that verify (``open_info``'s ``reader_verifies``) report chunks whose bytes did not
        match their checksum here. Each one's filesystem copy is verified again, here, and quarantined
        if it really is damaged (a report alone destroys nothing: a wrong or hostile report costs one
        read); the next read is then served from another tier's copy, or answers 404. The number of
        copies quarantined."""
        quarantined = 0
        fs = self._tiers.get(TierId.FS)
        if fs is None:
            return 0
        for key in keys:
            info = await self.lookup(bucket, key)
            if info is None or not info.tiers & TierId.FS:
                continue
            digest = chunk_digest(bucket.name, key)
            try:
                await fs.read(digest, 0, info.size, checksum=info.checksum)
            except backend.ChunkCorrupt:
                try:
                    await self._check_stale(fs, TierId.FS, digest, info)
                except _StaleEntry:
                    continue  # the index was behind the file, not the file damaged: corrected
                await self._quarantine(fs, TierId.FS, digest, info)
                quarantined += 1
            except backend.ChunkNotFound:
                await self._forget_copy(digest, info, TierId.FS, "vanished")
            except backend.BackendError as exc:
                raise translate_backend_error(exc) from exc
        return quarantined

    async def _quarantine(self, tier: Tier, bit: TierId, digest: bytes, info: ChunkInfo) -> None:
        log.warning("chunk %s/%s failed verification in %s: quarantined", info.bucket, info.key, bit.label)
        moved = False
        try:
            moved = await tier.quarantine(digest)
        finally:
            await self._forget_copy(digest, info, bit, "quarantined" if moved else "vanished")

    async def _forget_copy(self, digest: bytes, info: ChunkInfo, bit: TierId, reason: RemovedReason) -> None:
        await self._index.update_tiers(digest, remove=bit)
        self._events.removed(info.bucket, digest, bit, reason=reason, info=info)

    async def _verify_streaming(self, tier: Tier, digest: bytes, info: ChunkInfo) -> None:
        hasher = xxhash.xxh3_64()
        size = 0
        window = self._settings.read_window_bytes
        pieces = budgeted(tier.stream(digest, 0, info.size, window), self._budget, min(info.size, 2 * window))
        try:
            async for piece in pieces:
                if len(piece) > HASH_ON_LOOP_BYTES:
                    await asyncio.to_thread(hasher.update, piece)  # first touch of mapped pages: off the loop
                else:
                    hasher.update(piece)
                size += len(piece)
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        if size != info.size or hasher.intdigest() != info.checksum:
            raise backend.ChunkCorrupt("checksum mismatch")

    async def _check_stale(self, tier: Tier, bit: TierId, digest: bytes, info: ChunkInfo) -> None:
        """A mismatch may be the index's fault (an entry from before the chunk was re-written, here
        or by another gateway): the tier's own record decides. Raises _StaleEntry if so."""
        try:
            meta = await tier.stat(digest)
        except backend.BackendError:
            return
        if (meta.size, meta.checksum) == (info.size, info.checksum):
            return
        await self._index.delete(digest)
        fresh = await self._index_found(digest, meta, bit, self._clock())
        raise _StaleEntry(fresh)

    # -- prefetch and listing ------------------------------------------------------------------

    async def prefetch(self, bucket: BucketPolicy, keys: Sequence[str]) -> PrefetchResult:
        """Start promoting the S3-only chunks among ``keys``; returns at once with what was accepted."""
        infos = await self.open_many(bucket, keys)
        return self._mover.prefetch(infos)

    async def list_page(self, bucket: BucketPolicy, *, prefix: str = "", delimiter: str | None = None,
                        after: str | None = None, skip_prefix: str | None = None, max_keys: int = 1000
                        ) -> ListPage:
        """Up to ``max_keys`` live keys and common prefixes of ``bucket`` under ``prefix``, strictly after
        ``after`` (and not under ``skip_prefix``), in UTF-8 byte order; ``truncated`` tells whether more
        follow. See ``_scan_listing``."""
        now = self._clock()
        return await asyncio.to_thread(
            _scan_listing, self._index, bucket.name, prefix=prefix, delimiter=delimiter, after=after,
            skip_prefix=skip_prefix, max_keys=max_keys, now=now,
        )

    async def close(self) -> None:
        """Cancel the background work started for requests: read-ahead, and the mover's prefetches."""
        for task in list(self._background):
            task.cancel()
        await self._mover.close()


_LIST_BATCH = 1000
_PAST_PREFIX = "\U0010ffff"  # sorts after every character a key can continue a prefix with


def _scan_listing(index: ChunkIndex, bucket: str, *, prefix: str, delimiter: str | None, after: str | None,
                  skip_prefix: str | None, max_keys: int, now: float) -> ListPage:
    """A listing page over the index's name table (``ChunkService.list_page``).

    Synchronous: it reads LMDB batch by batch in short transactions, so it runs in a worker thread.
    Keys come in UTF-8 byte order, which is S3's. With a delimiter, keys that share a common prefix
    roll up into one entry; the scan then jumps past that prefix instead of reading every key under
    it. Expired chunks are skipped (they are absent to readers).
    """
    page = ListPage()
    if max_keys <= 0:
        return page
    after_raw = after.encode() if after is not None else None
    cursor = prefix if after is None or after < prefix else after
    if skip_prefix is not None and cursor < skip_prefix + _PAST_PREFIX:
        cursor = skip_prefix + _PAST_PREFIX
    count = 0
    while True:
        entries = index.list_names(bucket, cursor, _LIST_BATCH)
        jumped = False
        for entry in entries:
            key = entry.key
            if after_raw is not None and key.encode() <= after_raw:
                continue
            if skip_prefix is not None and key.startswith(skip_prefix):
                continue
            if not key.startswith(prefix):
                return page  # sorted: past the prefix
            if not entry.alive(now):
                continue
            if delimiter:
                at = key.find(delimiter, len(prefix))
                if at >= 0:
                    common = key[: at + len(delimiter)]
                    if count == max_keys:
                        page.truncated = True
                        return page
                    page.prefixes.append(common)
                    page.last = ("p", common)
                    count += 1
                    skip_prefix = common
                    cursor = common + _PAST_PREFIX
                    jumped = True
                    break
            if count == max_keys:
                page.truncated = True
                return page
            page.contents.append(ChunkInfo.from_entry(entry))
            page.last = ("k", key)
            count += 1
        if jumped:
            continue
        if len(entries) < _LIST_BATCH:
            return page
        cursor = entries[-1].key + "\x00"


def _keys_of(gone: frozenset[bytes], keys: Sequence[str], digests: Sequence[bytes]) -> set[str]:
    """The keys of the ``gone`` digests (a lease found them being removed: answered absent)."""
    return {key for key, digest in zip(keys, digests, strict=True) if digest in gone} if gone else set()
