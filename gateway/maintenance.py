"""Offline reconciliation of the index with a tier: ``kvgw index rebuild`` and ``kvgw scrub``.

Both trust the tier (chunks are self-describing) and treat the index as a cache to be made to agree.
They may run beside a live gateway: LMDB serialises writers across processes, and every step is an
idempotent statement about one chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import xxhash

from backends.base import ChunkMeta, Tier
from backends.errors import BackendError, ChunkNotFound
from backends.index import ChunkIndex, IndexEntry
from backends.tiers import TierId
from kvgw_client.keys import chunk_digest

_BATCH = 512


def entry_from_meta(meta: ChunkMeta, tiers: int = TierId.FS) -> IndexEntry:
    return IndexEntry(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires,
                      last_access=meta.created, tiers=tiers, md5_etag=meta.md5_etag)


@dataclass
class ScrubReport:
    chunks: int = 0
    verified_bytes: int = 0
    reindexed: int = 0  # in the tier, missing from (or wrong in) the index
    dangling: int = 0  # in the index, missing from the tier
    corrupt: int = 0  # bytes or footer damaged: quarantined
    misplaced: int = 0  # file name does not match its recorded (bucket, key)
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, int)}


async def rebuild_index(index: ChunkIndex, tiers: Mapping[TierId, Tier]) -> int:
    """Drop the index and recreate it from every tier (a chunk in several tiers gets every bit);
    returns the number of chunks indexed."""
    await index.clear()
    found: dict[bytes, IndexEntry] = {}
    for bit, tier in sorted(tiers.items()):
        async for digest, meta in tier.scan():
            if meta is None or chunk_digest(meta.bucket, meta.key) != digest:
                continue
            known = found.get(digest)
            found[digest] = entry_from_meta(meta, bit) if known is None else replace(known, tiers=known.tiers | bit)
    items = list(found.items())
    for start in range(0, len(items), _BATCH):
        await index.put_many(items[start : start + _BATCH])
    return len(items)


async def _gone(tier: Tier, digest: bytes) -> bool:
    """Whether the tier says for certain that it has no copy: ``stat`` (which on a shared directory looks
    again before it says "not found"), not ``stat_many`` (a lookup of chunks nobody said exist)."""
    try:
        await tier.stat(digest)
    except ChunkNotFound:
        return True
    except BackendError:
        return False  # damaged (the scan's business) or unreachable / not visible yet: not dangling
    return False


async def _verify(tier: Tier, digest: bytes, meta: ChunkMeta, window: int) -> bool:
    hasher = xxhash.xxh3_64()
    size = 0
    async for piece in tier.stream(digest, 0, meta.size, window):
        hasher.update(piece)
        size += len(piece)
    return size == meta.size and hasher.intdigest() == meta.checksum


async def scrub(index: ChunkIndex, tier: Tier, *, repair: bool = True, window: int = 4 << 20) -> ScrubReport:
    """Verify every chunk of the tier and reconcile the index with what is really there."""
    report = ScrubReport()
    seen: set[bytes] = set()
    async for digest, meta in tier.scan():
        report.chunks += 1
        seen.add(digest)
        if meta is None:
            report.corrupt += 1
            report.details.append(f"{digest.hex()}: unreadable footer")
            if repair:
                await tier.quarantine(digest)
                await index.delete(digest)
            continue
        if chunk_digest(meta.bucket, meta.key) != digest:
            report.misplaced += 1
            report.details.append(f"{digest.hex()}: footer names another key")
            if repair:
                await tier.quarantine(digest)
                await index.delete(digest)
            continue
        try:
            intact = await _verify(tier, digest, meta, window)
        except BackendError as exc:
            report.details.append(f"{digest.hex()}: {exc}")
            continue
        if not intact:
            report.corrupt += 1
            report.details.append(f"{digest.hex()}: checksum mismatch ({meta.bucket}/{meta.key})")
            if repair:
                await tier.quarantine(digest)
                await index.delete(digest)
            continue
        report.verified_bytes += meta.size
        entry = index.get(digest)
        if entry is None or (entry.size, entry.checksum) != (meta.size, meta.checksum):
            report.reindexed += 1
            if repair:
                await index.put(digest, entry_from_meta(meta))
    after: bytes | None = None
    while True:
        page = index.scan(after, limit=_BATCH)
        if not page:
            break
        for digest, entry in page:
            if digest in seen or not entry.tiers & TierId.FS:
                continue
            if not await _gone(tier, digest):
                continue  # written after the scan passed its directory, or not visible here yet
            report.dangling += 1
            report.details.append(f"{digest.hex()}: indexed but not in the tier ({entry.bucket}/{entry.key})")
            if repair:
                await index.delete(digest)
        after = page[-1][0]
    return report

