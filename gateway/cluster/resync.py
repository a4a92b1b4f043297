"""Resync: bring a live index in line with the tiers, and count what the tiers hold.

Used when the change feed cannot bring an index up to date: a new or lost index (``rm -rf`` of the
index directory), an index that followed another catalog, or one that fell behind what the feed keeps.
Unlike ``kvgw index rebuild`` it runs beside a serving gateway and keeps what the index knows that the
tiers do not say (access history, prefix links, the write-through queue): each tier is scanned in
digest order (the filesystem tier's directory order, S3's listing order) and merged with the index
walked in the same order, in batches of small index transactions:

- a chunk in the tier that the index lacks (or holds as another incarnation) is indexed;
- an entry whose copy the tier's listing did not show loses that tier's bit (the entry goes with its
  last bit), unless it was created after the scan started or a ``stat`` finds the copy now (a write,
  copy or promotion that landed after the listing passed it).

A tier that cannot be reached (S3 down) is left out and named in the report (``failed``); the caller
resyncs it later.

Lookups keep working meanwhile (a miss falls through to the tiers). The scan also counts bytes and
chunks per (bucket, tier) (a ``TierCount``, with the times at which it passed points of each tier's
digest order), which ``gateway.cluster.usage`` writes to the shared usage ledger, corrected by the
events published while the scan ran. A tier that does not list in digest order is only added from,
never subtracted from.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from backends.base import ChunkMeta, Tier
from backends.errors import TierUnavailable
from backends.index import ChunkIndex, IndexEntry
from backends.tiers import TierId
from kvgw_client.keys import chunk_digest

log = logging.getLogger("kvgw.cluster")

_BATCH = 512

Totals = dict[tuple[str, int], list[int]]
"""(bucket, tier) -> [bytes, chunks]."""

_END = b"\xff" * 17  # sorts after every digest


@dataclass
class TierCount:
    """What a scan counted per (bucket, tier), and when it passed which digests.

    ``passes[tier]`` is a list of (digest, unix time) in digest order: every chunk up to that digest
    had been read by that time. A change to a chunk made after the scan passed it is not in ``totals``
    (``missed`` tells which), one made before is.
    """

    totals: Totals = field(default_factory=dict)
    passes: dict[int, list[tuple[bytes, float]]] = field(default_factory=dict)

    def add(self, bucket: str, tier: int, size: int) -> None:
        slot = self.totals.setdefault((bucket, tier), [0, 0])
        slot[0] += size
        slot[1] += 1

    def forget(self, tier: int) -> None:
        """Drop what was counted of ``tier`` (its scan did not finish)."""
        self.passes.pop(tier, None)
        for key in [key for key in self.totals if key[1] == tier]:
            del self.totals[key]

    def passed(self, tier: int, digest: bytes, when: float) -> None:
        self.passes.setdefault(tier, []).append((digest, when))

    def missed(self, tier: int, digest: bytes, at: float) -> bool:
        """Whether a change to ``digest`` in ``tier`` made at ``at`` came after the scan read it."""
        passes = self.passes.get(tier)
        if not passes:
            return False  # the tier was not scanned
        i = bisect.bisect_left(passes, (digest, -1.0))
        when = passes[min(i, len(passes) - 1)][1]
        return at > when


@dataclass
class ResyncReport:
    chunks: int = 0  # chunks found in the tiers (copies: a chunk in two tiers counts twice)
    added: int = 0  # index entries created or given a tier bit
    removed: int = 0  # tier bits cleared from entries the tiers did not hold
    seconds: float = 0.0
    ordered: dict[str, bool] = field(default_factory=dict)  # tier label -> listed in digest order
    failed: list[TierId] = field(default_factory=list)  # tiers that could not be read (left out)
    count: TierCount = field(default_factory=TierCount)


class _IndexWalk:
    """The index's digests in order, read a page at a time (short read transactions)."""

    def __init__(self, index: ChunkIndex, bit: int) -> None:
        self._index = index
        self._bit = bit
        self._page: list[tuple[bytes, IndexEntry]] = []
        self._at = 0
        self._after: bytes | None = None
        self._done = False

    def _fill(self) -> bool:
        if self._at < len(self._page):
            return True
        if self._done:
            return False
        self._page = self._index.scan(self._after, limit=1024)
        self._at = 0
        if not self._page:
            self._done = True
            return False
        self._after = self._page[-1][0]
        return True

    def before(self, digest: bytes | None) -> list[bytes]:
        """Digests holding this tier's bit strictly before ``digest`` (None: all the rest); ``digest``
        itself is passed over."""
        out: list[bytes] = []
        while self._fill():
            found, entry = self._page[self._at]
            if digest is not None and found >= digest:
                if found == digest:
                    self._at += 1
                return out
            if entry.tiers & self._bit:
                out.append(found)
            self._at += 1
        return out


def entry_of(meta: ChunkMeta, bit: int) -> IndexEntry:
    return IndexEntry(meta.bucket, meta.key, meta.size, meta.checksum, meta.created, meta.expires,
                      last_access=meta.created, tiers=bit, md5_etag=meta.md5_etag)


async def resync_index(index: ChunkIndex, tiers: Mapping[TierId, Tier], *,
                       added: Callable[[bytes, IndexEntry, int], None] | None = None,
                       clock: Callable[[], float] = time.time) -> ResyncReport:
    """Merge every tier into the index (see the module docstring); ``added(digest, entry, tier)`` is
    told of every copy newly indexed (the lifecycle ledgers take them)."""
    report = ResyncReport()
    started = time.monotonic()
    since = clock()
    for bit, tier in sorted(tiers.items()):
        try:
            report.ordered[bit.label] = await _merge_tier(index, bit, tier, report, added, since, clock)
        except TierUnavailable as exc:
            log.warning("resync: tier %s unreachable (%s); left out for now", bit.label, exc)
            report.failed.append(bit)
            report.count.forget(int(bit))
    report.seconds = time.monotonic() - started
    return report


async def _merge_tier(index: ChunkIndex, bit: TierId, tier: Tier, report: ResyncReport,
                      added: Callable[[bytes, IndexEntry, int], None] | None, since: float,
                      clock: Callable[[], float]) -> bool:
    """Merge one tier into the index; returns whether it listed in digest order."""
    walk = _IndexWalk(index, bit)
    found: list[tuple[bytes, IndexEntry, bytes | None]] = []
    absent: list[bytes] = []
    previous: bytes | None = None
    ordered = True

    async def flush() -> None:
        if absent:  # the listing did not show them; a copy made after it passed them is kept
            metas = await tier.stat_many(list(absent))
            absent[:] = [digest for digest, meta in zip(list(absent), metas, strict=True) if meta is None]
        new, gone = await index.reconcile_tier(bit, found, absent, since)
        report.added += len(new)
        report.removed += gone
        if added is not None:
            for digest, entry in new:
                added(digest, entry, bit)
        found.clear()
        absent.clear()

    async for digest, meta in tier.scan():
        if previous is not None and digest <= previous:
            if ordered:
                log.info("resync: tier %s does not list in digest order; only adding from it", bit.label)
            ordered = False
        previous = digest
        if ordered:
            absent.extend(walk.before(digest))
        if meta is None or chunk_digest(meta.bucket, meta.key) != digest:
            continue  # damaged or misplaced: scrub's business
        report.chunks += 1
        report.count.add(meta.bucket, int(bit), meta.size)
        parent = None if meta.parent is None else chunk_digest(meta.bucket, meta.parent)
        found.append((digest, entry_of(meta, bit), parent))
        if len(found) >= _BATCH or len(absent) >= _BATCH:
            report.count.passed(int(bit), digest, clock())
            await flush()
    if ordered:
        absent.extend(walk.before(None))
    report.count.passed(int(bit), _END, clock())
    await flush()
    return ordered


async def count_tiers(tiers: Mapping[TierId, Tier], *, clock: Callable[[], float] = time.time) -> TierCount:
    """Bytes and chunks per (bucket, tier) as the tiers hold them (reads every chunk's record)."""
    count = TierCount()
    for bit, tier in sorted(tiers.items()):
        n = 0
        async for digest, meta in tier.scan():
            n += 1
            if n % _BATCH == 0:
                count.passed(int(bit), digest, clock())
            if meta is None or chunk_digest(meta.bucket, meta.key) != digest:
                continue
            count.add(meta.bucket, int(bit), meta.size)
        count.passed(int(bit), _END, clock())
    return count
