"""The tier mover: every copy of a chunk from one tier to another, and every removal the lifecycle makes.

The lifecycle engine moves chunks only through this (``demote``, ``replicate``, ``drop``, ``expire``);
the request path uses it to promote S3-only chunks into the filesystem tier on read (``promote``) and
ahead of reads (``prefetch``). Each move keeps a crash-safe order: a copy is counted only once it is
complete and verified, and a chunk that is deleted never comes back:

- copy: stream from the source, verify size and checksum against the index, publish at the target
  (create-if-absent; a stale leftover at the target is replaced; see "Reconciliation" for S3);
- promote / replicate: copy, then set the new tier bit (replicate: and clear the write-through queue
  entry in the same index transaction);
- demote: copy to S3 (unless S3 confirms it holds the chunk already), switch the index from fs to s3,
  then delete the local copy;
- drop: the last copy goes bytes first, then the index entry; a copy with a confirmed twin in the other
  tier goes index first, then bytes;
- expire: delete every tier's bytes, then the index entry (the chunk is absent to readers already).

Never the last reachable copy: ``demote`` and ``drop`` delete a copy only after the other copy has been
confirmed right then (``stat``: present, same size and checksum) or made by this very call, whoever
calls them. The index bit alone is not enough: with S3 unreachable, trusting it turned chunks into
503s for the whole outage. If the tier of the other copy cannot be reached (``TierUnavailable``),
nothing changes and the error goes to the caller (the lifecycle engine waits, and says so in its
stats); if the other copy is gone, the copy being dropped was the last one (``drop`` removes the
chunk, as an eviction without S3 does; ``demote`` copies it to S3 again).

Reconciliation with S3: a write to a filesystem-tier bucket is decided by the filesystem tier's
create-if-absent alone when S3 cannot be asked (``ChunkService.lookup_for_write``), so S3 may already
hold a different chunk under the same key (written by another gateway, or indexed before an index was
lost). It meets the filesystem copy when that copy goes to S3 (``demote``, ``replicate``), where the
conditional put answers "exists": an identical chunk is simply kept (the index records the S3 copy);
a *different live* chunk in S3 is the first write of the key, and stays: the index adopts S3's record,
the filesystem copy is deleted, and later reads serve S3's bytes (verified against its own checksum).
Write-once therefore holds with S3 as the arbiter between gateways: a write accepted during the outage
is provisional until it reaches S3. An *expired* object in S3 is a leftover (absent to readers) and
is replaced.

Error contract (unlike ``ChunkService``, which raises only ``gateway.errors``): ``copy``, ``demote``,
``replicate``, ``drop`` and ``expire`` raise the ``backends.errors`` tree unchanged, so the caller can
tell an unreachable tier (``TierUnavailable``: the lifecycle engine waits and retries later) from a
damaged or vanished chunk (``ChunkCorrupt``, ``ChunkNotFound``) or a full tier (``StorageFull``).
They never raise ``gateway.errors``.

- A failure before the index switch loses nothing: the source copy and the index are unchanged and
  a partly written target copy is discarded (after a crash only staging garbage is left, which the
  tier's ``cleanup_staging`` removes).
- A failure after the index switch (while deleting the old copy) leaves the index right and the old
  copy behind, unreferenced: it is never served, and ``kvgw index rebuild`` indexes it again. A
  last copy is deleted before its index entry, so a failure in between leaves an entry without bytes,
  which the next read of it drops.
- ``replicate`` answers False, changing nothing but the write-through queue, when there is nothing
  to copy (the chunk is gone, not in the filesystem tier, or already in S3).
- ``promote`` answers False instead of raising when the copy cannot be made (the reader then reads
  from S3 directly); an index failure after the copy still raises. ``prefetch`` never raises: its
  promotions run in the background, and ``close`` cancels those still running.

Every change is reported to ``events`` (the lifecycle ledgers and the cluster feed) with what it did to
the tier: a copy made (``promoted``, ``replicated``, ``demoted``) only when this mover created it, a
copy removed (``evicted``, ``expired``, ``demoted``) only when this mover deleted it; a copy found gone
already is ``vanished`` (another gateway removed it and told the cluster).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import xxhash

from backends import errors as backend
from backends.base import ChunkMeta, Tier
from backends.index import ChunkIndex, IndexEntry
from backends.tiers import TierId
from gateway.chunks import ChunkEvents, ChunkInfo, NoEvents, PrefetchResult, RemovedReason
from kvgw_client.keys import chunk_digest

log = logging.getLogger("kvgw.mover")


class EarlierWrite(backend.ChunkExists):
    """``copy`` to S3 met a different live chunk under the key: the first write, which stays."""

    def __init__(self, meta: ChunkMeta) -> None:
        super().__init__(f"S3 holds another chunk under {meta.bucket}/{meta.key}, written first")
        self.meta = meta


class TierMover:
    def __init__(
        self,
        index: ChunkIndex,
        tiers: Mapping[TierId, Tier],
        *,
        events: ChunkEvents | None = None,
        clock: Callable[[], float] = time.time,
        read_window_bytes: int = 4 << 20,
        prefetch_concurrency: int = 8,
    ) -> None:
        self._index = index
        self._tiers = dict(tiers)
        self._fs = self._tiers[TierId.FS]
        self._events: ChunkEvents = events if events is not None else NoEvents()
        self._clock = clock
        self._window = read_window_bytes
        self._promotions: dict[bytes, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[bool]] = set()
        self._prefetch_slots = asyncio.Semaphore(prefetch_concurrency)
        self.moved_bytes: Counter[str] = Counter()  # "fs->s3", "s3->fs": bytes copied between tiers
        self.promotions = 0

    @property
    def has_s3(self) -> bool:
        """Whether an S3 tier is configured (demotion, write-through and promotion need one)."""
        return TierId.S3 in self._tiers

    async def copy(self, digest: bytes, info: ChunkInfo, src: TierId, dst: TierId, *, retried: bool = False
                   ) -> bool:
        """Copy one chunk between tiers, verifying size and checksum on the way; the target keeps the
        source's full record (parent, attrs). An existing target copy is kept if it is the same chunk
        and replaced if it is a stale leftover (an earlier copy of a since re-written key); in S3, a
        different live chunk is the key's first write and raises ``EarlierWrite`` (module docstring).
        The index is not changed. True if this call created the target copy (False: it was there
        already)."""
        source, target = self._tiers[src], self._tiers[dst]
        meta_task = asyncio.ensure_future(source.stat(digest))
        staged = await target.stage(digest)
        try:
            hasher = xxhash.xxh3_64()
            size = 0
            pieces = source.stream(digest, 0, info.size, self._window)
            try:
                async for piece in pieces:
                    hasher.update(piece)
                    size += len(piece)
                    await staged.write(piece)
            finally:
                await pieces.aclose()  # type: ignore[attr-defined]
            meta = await meta_task
            if size != info.size or hasher.intdigest() != info.checksum:
                raise backend.ChunkCorrupt(f"copy from {src.label} does not match the index")
            created = await staged.publish(meta)
        except BaseException:
            meta_task.cancel()
            await staged.discard()
            raise
        self.moved_bytes[f"{src.label}->{dst.label}"] += size
        if created:
            return True
        existing = await target.stat(digest)
        if (existing.size, existing.checksum) != (info.size, info.checksum):
            if (dst == TierId.S3 and (existing.bucket, existing.key) == (info.bucket, info.key)
                    and not 0 < existing.expires <= self._clock()):
                raise EarlierWrite(existing)
            if retried:
                raise backend.BackendError("a different chunk keeps appearing at the copy target")
            await target.delete(digest)
            return await self.copy(digest, info, src, dst, retried=True)
        return False

    async def promote(self, digest: bytes, info: ChunkInfo) -> bool:
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
            created = await self.copy(digest, info, TierId.S3, TierId.FS)
        except backend.BackendError as exc:
            log.info("promotion of %s/%s skipped: %s", info.bucket, info.key, type(exc).__name__)
            return False
        if created and not await self._source_still_there(digest, info):
            # Deleted meanwhile, maybe by another gateway (S3 copy first, then the fs copy, which our
            # copy may have come after): the copy must not bring the chunk back.
            await self._fs.delete(digest)
            await self._index.update_tiers(digest, remove=TierId.S3)
            return False
        entry = await self._index.update_tiers(digest, add=TierId.FS)
        if entry is None:  # deleted meanwhile: drop the copy we made
            if created:
                await self._fs.delete(digest)
            return False
        if created:
            parent = self._index.parent_of(digest)
            self._events.stored(info.bucket, digest, TierId.FS, info.size, info.expires, parent, self._clock(),
                                reason="promoted", info=info)
        self.promotions += 1
        return True

    async def _source_still_there(self, digest: bytes, info: ChunkInfo) -> bool:
        try:
            meta = (await self._tiers[TierId.S3].stat_many([digest]))[0]
        except backend.BackendError:
            return True  # cannot tell: keep the copy (a delete's own fs step still removes it)
        return meta is not None and (meta.size, meta.checksum, meta.created) == (info.size, info.checksum,
                                                                                 info.created)

    def prefetch(self, infos: Sequence[ChunkInfo | None]) -> PrefetchResult:
        """Start promoting the S3-only chunks among resolved ``infos`` (None: absent) in the background,
        at most ``prefetch_concurrency`` at a time; returns at once with what was accepted."""
        accepted = local = missing = 0
        for info in infos:
            if info is None:
                missing += 1
            elif info.tiers & TierId.FS or not self.has_s3:
                local += 1
            else:
                accepted += 1
                task = asyncio.ensure_future(self._prefetch_one(info))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return PrefetchResult(accepted, local, missing)

    async def _prefetch_one(self, info: ChunkInfo) -> bool:
        async with self._prefetch_slots:
            return await self.promote(chunk_digest(info.bucket, info.key), info)

    async def demote(self, digest: bytes, entry: IndexEntry) -> None:
        """Move a chunk from the filesystem tier to S3: copy (unless S3 confirms its copy now), verify,
        switch the index, delete. TierUnavailable with S3 unreachable, before anything changed."""
        info = ChunkInfo.from_entry(entry)
        created = False
        if not await self._twin_confirmed(digest, entry, TierId.FS):
            try:
                created = await self.copy(digest, info, TierId.FS, TierId.S3)
            except EarlierWrite as earlier:
                await self._adopt(digest, entry, earlier.meta, "demoted")
                return
        updated = await self._index.update_tiers(digest, add=TierId.S3, remove=TierId.FS, done_pending=True)
        if created:
            self._events.stored(entry.bucket, digest, TierId.S3, entry.size, entry.expires,
                                self._index.parent_of(digest), self._clock(), reason="demoted",
                                info=info if updated is None else ChunkInfo.from_entry(updated))
        gone = await self._fs.delete(digest)
        self._events.removed(entry.bucket, digest, TierId.FS, reason="demoted" if gone else "vanished", info=info)

    async def replicate(self, digest: bytes) -> bool:
        """Write-through: copy a queued chunk to S3 and record it. False if there was nothing to do."""
        assert self.has_s3
        entry = self._index.get(digest)
        if entry is None or not entry.tiers & TierId.FS or entry.tiers & TierId.S3:
            await self._index.update_tiers(digest, done_pending=True)
            return False
        info = ChunkInfo.from_entry(entry)
        try:
            created = await self.copy(digest, info, TierId.FS, TierId.S3)
        except backend.ChunkNotFound:
            await self._index.update_tiers(digest, done_pending=True)
            return False
        except EarlierWrite as earlier:
            await self._adopt(digest, entry, earlier.meta, "deleted")
            return True
        await self._index.update_tiers(digest, add=TierId.S3, done_pending=True)
        self._events.stored(entry.bucket, digest, TierId.S3, entry.size, entry.expires,
                            self._index.parent_of(digest), self._clock(),
                            reason="replicated" if created else "learned", info=info)
        return True

    async def drop(self, digest: bytes, entry: IndexEntry, tier: TierId) -> None:
        """Evict one tier's copy. A copy whose twin elsewhere is confirmed now goes index first, then
        bytes, so the index never points at bytes that are gone; otherwise it is the last copy and goes
        bytes first, then the index entry. TierUnavailable, with nothing changed, if the twin's tier
        cannot be asked: the copy may be the last reachable one."""
        store = self._tiers[tier]
        info = ChunkInfo.from_entry(entry)
        if entry.tiers & ~tier and await self._twin_confirmed(digest, entry, tier):
            await self._index.update_tiers(digest, remove=tier)
            gone = await store.delete(digest)
        else:
            gone = await store.delete(digest)
            await self._index.delete(digest)
            for other in TierId:
                if other != tier and entry.tiers & other:  # the index named a twin that is gone
                    self._events.removed(entry.bucket, digest, other, reason="vanished", info=info)
        self._events.removed(entry.bucket, digest, tier, reason="evicted" if gone else "vanished", info=info)

    async def _twin_confirmed(self, digest: bytes, entry: IndexEntry, leaving: TierId) -> bool:
        """Whether a tier other than ``leaving`` that the entry names holds the chunk now (present, same
        size and checksum): asked, not taken from the index. TierUnavailable if such a tier cannot be
        asked; a tier that is not configured holds nothing reachable."""
        for bit in TierId:
            tier = self._tiers.get(bit)
            if bit == leaving or tier is None or not entry.tiers & bit:
                continue
            try:
                meta = await tier.stat(digest)
            except (backend.ChunkNotFound, backend.ChunkCorrupt):
                continue
            if (meta.size, meta.checksum) == (entry.size, entry.checksum):
                return True
        return False

    async def _adopt(self, digest: bytes, entry: IndexEntry, first: ChunkMeta, reason: RemovedReason) -> None:
        """Reconciliation (module docstring): S3's chunk was written first; the index takes its record,
        the write-through queue entry goes, and the filesystem copy of the later write is deleted."""
        log.warning("%s/%s: S3 already held another chunk under this key (written while S3 could not be "
                    "asked?); it was first and stays, the filesystem copy is dropped", entry.bucket, entry.key)
        adopted = IndexEntry(first.bucket, first.key, first.size, first.checksum, first.created, first.expires,
                             last_access=entry.last_access, hits=entry.hits, tiers=TierId.S3,
                             md5_etag=first.md5_etag)
        parent = None if first.parent is None else chunk_digest(first.bucket, first.parent)
        await self._index.put(digest, adopted, parent)
        await self._index.drop_pending(digest)
        gone = await self._fs.delete(digest)
        self._events.removed(entry.bucket, digest, TierId.FS, reason=reason if gone else "vanished",
                             info=ChunkInfo.from_entry(entry))
        self._events.stored(first.bucket, digest, TierId.S3, first.size, first.expires, parent, self._clock(),
                            reason="learned", info=ChunkInfo.from_entry(adopted))

    async def expire(self, digest: bytes, entry: IndexEntry) -> None:
        """Reclaim an expired chunk's bytes everywhere (it has been absent to readers since expiry)."""
        held = [tier for tier in (TierId.S3, TierId.FS) if entry.tiers & tier and tier in self._tiers]
        info = ChunkInfo.from_entry(entry)
        for tier in held:
            gone = await self._tiers[tier].delete(digest)
            self._events.removed(entry.bucket, digest, tier, reason="expired" if gone else "vanished", info=info)
        await self._index.delete(digest)

    async def close(self) -> None:
        """Cancel the prefetches still running (a promotion cut short leaves only staging garbage)."""
        for task in list(self._background):
            task.cancel()
