"""The cluster change feed: what each gateway did to the tiers, applied by every other gateway's index.

Every copy a gateway adds to a tier (stored, promoted, replicated, demoted into S3) or removes from one
(deleted, evicted, expired, demoted out of the filesystem, quarantined) becomes one row of
``chunk_events`` in the shared catalog; reads become aggregated ``read`` rows. Each row has a
sequence number that is gap-free and in commit order (revision 0005): a batch takes its numbers from
the single ``feed_head`` row in the same transaction that inserts it, so the head's row lock orders
the publishers' commits, and a reader that has applied every event up to N never sees an event with a
lower number committed later.

Publishing (``FeedPublisher``) never adds a database round trip to a request: events go into an
in-memory queue and a background flusher writes them, one transaction per batch, a few milliseconds
after the first one arrives (``cluster_flush_seconds``) or as soon as ``cluster_flush_events`` are
queued. The same transaction applies the batch's usage deltas to ``tier_usage`` (bytes and chunks per
bucket and tier for the whole tier: the shared usage ledger, ``gateway.cluster.usage``) and, on
PostgreSQL, sends ``NOTIFY kvgw_feed`` so subscribers wake at once. Reads are folded per (bucket,
chunk, tier) into one ``read`` event with a count and the last read time, and flushed every
``cluster_read_flush_seconds``; so are the prefix chains clients reveal by the order of keys in prefix
and batch-get calls (``linked`` events, child and parent; a bounded memory of recently shipped links
keeps a chain that is looked up again and again from being shipped each time). Every gateway's index
thus holds every gateway's reads and chains, which is what the lifecycle leader orders eviction by.

Subscribing (``FeedSubscriber``) applies the events of other gateways in sequence order to the local
LMDB index (events of processes that share this index are skipped: it has them already; member ids end
with the index's identity token, ``gateway.cluster.members.new_member_id``), together with the new position in the
same index transaction (``ChunkIndex.apply_changes``), so a crash neither skips nor repeats an event.
It wakes on ``LISTEN kvgw_feed`` (PostgreSQL) and polls every ``cluster_poll_seconds`` in any case
(the only wake-up on SQLite, and the safety net when a notification is lost). After a disconnect or a
restart it continues from its position. When the events it needs were trimmed already (a gap
between its position and the oldest kept event), or the index never followed this feed (a new index,
an index from another catalog), it resyncs the index with the tiers (``gateway.cluster.resync``) and
continues from the head it read before the scan.

Retention (``trim_feed``): events older than ``cluster_feed_retention_seconds`` or beyond the newest
``cluster_feed_retention_events`` are deleted; any member may run it (a range delete on the primary
key), the heartbeat does it every ``cluster_trim_seconds``.

What a crash costs. The tier is written first and the event later, so a gateway that dies between
the two (its queue is in memory: at most one flush interval of events, or more during a catalog
outage) leaves the tier right and the other gateways' indexes and the usage ledger behind:

- a stored chunk they were not told about is found by their fall-through on the first miss, and
  indexed then (listing misses it until then, or until a resync);
- a removed chunk they were not told about still answers HEAD / exists from their index; a GET finds
  the copy gone and drops the entry (never serving the bytes), and a PUT confirms with the tier before
  it answers "exists", so no write is lost;
- ``tier_usage`` is off by the sizes of the lost events until it is recounted from the tiers
  (``kvgw cluster reconcile``; also done automatically when a gateway starts with a new or lost index,
  and the first time a catalog's feed is used).

An event is never published for something that did not happen: the tier change comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import pairwise
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError

from backends.base import MD5_ETAG_BYTES, pack_md5_etag, unpack_md5_etag
from backends.index import ChangeOp, ChunkIndex, IndexChange, IndexEntry
from backends.tiers import TierId
from gateway.chunks import ChunkEvents, ChunkInfo, RemovedReason, StoredReason
from gateway.cluster.db import EVENTS, HEAD, USAGE, ClusterDB

log = logging.getLogger("kvgw.cluster")


class Kind(IntEnum):
    """``chunk_events.kind``: what happened to the copy of a chunk in ``tier``."""

    STORED = 1  # a client wrote it
    PROMOTED = 2  # copied S3 -> fs
    REPLICATED = 3  # copied fs -> S3 (write-through)
    DEMOTED_IN = 4  # copied fs -> S3 by a demotion
    DELETED = 11
    EVICTED = 12
    EXPIRED = 13
    DEMOTED = 14  # the fs copy removed by a demotion
    QUARANTINED = 15
    READ = 21  # read ``count`` times, last at ``at``
    LINKED = 22  # ``detail`` (a digest) precedes the chunk in its prefix chain
    MARKED = 23  # engine hints: marks ``count & 0xFF`` set, ``count >> 8`` cleared (backends.index.MARK_*)


ADDS = frozenset({Kind.STORED, Kind.PROMOTED, Kind.REPLICATED, Kind.DEMOTED_IN})
REMOVALS = frozenset({Kind.DELETED, Kind.EVICTED, Kind.EXPIRED, Kind.DEMOTED, Kind.QUARANTINED})
HINTS = frozenset({Kind.READ, Kind.LINKED, Kind.MARKED})  # for eviction order only: no tier changed
STORED_KINDS: dict[str, Kind] = {"stored": Kind.STORED, "promoted": Kind.PROMOTED,
                                 "replicated": Kind.REPLICATED, "demoted": Kind.DEMOTED_IN}
REMOVED_KINDS: dict[str, Kind] = {"deleted": Kind.DELETED, "evicted": Kind.EVICTED, "expired": Kind.EXPIRED,
                                  "demoted": Kind.DEMOTED, "quarantined": Kind.QUARANTINED}

# detail of an add: checksum, created, key length, key, then the parent's digest (16 bytes) if any, then
# the MD5 ETag (``_MD5_MARK`` + ``backends.base.pack_md5_etag``) if the chunk has one: what follows the
# key is told apart by its length (0, 16, 20 or 36 bytes); of a removal: checksum, created of the
# incarnation removed, when the remover knew it, then its key length and key (readers before the
# change stream read the first 16 bytes only: compatible both ways)
_ADD_DETAIL = struct.Struct("<QdH")
_MD5_MARK = b"M5"
_MD5_TAIL = len(_MD5_MARK) + MD5_ETAG_BYTES
_SHIPPED_LINKS = 65536  # links remembered as shipped (a bounded memory, whatever the number of chunks)
_REMOVE_DETAIL = struct.Struct("<Qd")
_KEY_LENGTH = struct.Struct("<H")


@dataclass(slots=True)
class FeedEvent:
    kind: Kind
    bucket: str
    digest: bytes
    tier: int
    size: int = 0
    expires: float = 0.0
    at: float = 0.0
    count: int = 1
    detail: bytes | None = None

    def usage_delta(self) -> tuple[int, int]:
        """(bytes, chunks) this event adds to its (bucket, tier) in ``tier_usage``."""
        if self.kind in ADDS:
            return self.size, 1
        if self.kind in REMOVALS:
            return -self.size, -1
        return 0, 0

    def row(self, seq: int, member: str) -> dict[str, Any]:
        return {"seq": seq, "at": self.at, "member": member, "bucket": self.bucket, "digest": self.digest,
                "kind": int(self.kind), "tier": self.tier, "size": self.size, "expires": self.expires,
                "count": self.count, "detail": self.detail}


def add_detail(info: ChunkInfo, parent: bytes | None) -> bytes:
    key = info.key.encode()
    md5 = b"" if info.md5_etag is None else _MD5_MARK + pack_md5_etag(info.md5_etag)
    return _ADD_DETAIL.pack(info.checksum, info.created, len(key)) + key + (parent or b"") + md5


def removal_detail(info: ChunkInfo | None) -> bytes | None:
    if info is None:
        return None
    key = info.key.encode()
    return _REMOVE_DETAIL.pack(info.checksum, info.created) + _KEY_LENGTH.pack(len(key)) + key


def detail_key(kind: int, detail: bytes | None) -> str | None:
    """The key a feed row names in its detail: every add's; a removal's when its remover knew it (and
    published it: rows written before the change stream existed carry none). None otherwise."""
    if detail is None:
        return None
    try:
        if kind in ADDS and len(detail) >= _ADD_DETAIL.size:
            _, _, key_len = _ADD_DETAIL.unpack_from(detail)
            start = _ADD_DETAIL.size
        elif kind in REMOVALS and len(detail) >= _REMOVE_DETAIL.size + _KEY_LENGTH.size:
            (key_len,) = _KEY_LENGTH.unpack_from(detail, _REMOVE_DETAIL.size)
            start = _REMOVE_DETAIL.size + _KEY_LENGTH.size
        else:
            return None
        if len(detail) < start + key_len:
            return None
        return detail[start : start + key_len].decode()
    except (struct.error, UnicodeDecodeError):
        return None


def to_change(kind: int, bucket: str, digest: bytes, tier: int, size: int, expires: float, at: float,
              count: int, detail: bytes | None) -> IndexChange | None:
    """The index change a feed row asks for; None for rows this version does not understand."""
    if kind == Kind.READ:
        return IndexChange(ChangeOp.READ, digest, tier, count=count, at=at)
    if kind == Kind.MARKED:
        return IndexChange(ChangeOp.MARK, digest, tier, count=count, at=at)
    if kind == Kind.LINKED:
        if detail is None or len(detail) != 16:
            return None
        return IndexChange(ChangeOp.LINK, digest, tier, parent=detail, at=at)
    if kind in ADDS:
        if detail is None or len(detail) < _ADD_DETAIL.size:
            return None
        checksum, created, key_len = _ADD_DETAIL.unpack_from(detail)
        end = _ADD_DETAIL.size + key_len
        key = detail[_ADD_DETAIL.size : end].decode()
        rest = len(detail) - end
        md5 = None
        if rest in (_MD5_TAIL, 16 + _MD5_TAIL) and detail[len(detail) - _MD5_TAIL:].startswith(_MD5_MARK):
            md5 = unpack_md5_etag(detail, len(detail) - MD5_ETAG_BYTES)
            rest -= _MD5_TAIL
        parent = detail[end : end + 16] if rest >= 16 else None
        entry = IndexEntry(bucket, key, size, checksum, created, expires, last_access=created, tiers=tier,
                           md5_etag=md5)
        return IndexChange(ChangeOp.ADD, digest, tier, entry, parent, at=at)
    if kind in REMOVALS:
        removed: IndexEntry | None = None
        if detail is not None and len(detail) >= _REMOVE_DETAIL.size:
            checksum, created = _REMOVE_DETAIL.unpack_from(detail)
            removed = IndexEntry(bucket, "", size, checksum, created)
        return IndexChange(ChangeOp.REMOVE, digest, tier, removed, at=at)
    return None


# -- publishing ------------------------------------------------------------------------------------


class FeedPublisher:
    """Queues this gateway's events and writes them to the feed in batches (see the module docstring).

    ``add`` and ``read`` are called on the event loop and never block. Past ``max_queued`` queued changes
    (the catalog unreachable for a while) ``admit`` refuses new client writes; changes already made
    (evictions, expiries) are still queued. Reads are hints for eviction order: while that many events
    wait, new ones are dropped (counted) rather than queued.
    """

    def __init__(self, db: ClusterDB, member: str, *, flush_seconds: float = 0.1, batch_events: int = 1000,
                 read_flush_seconds: float = 1.0, max_queued: int = 100_000,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self.member = member
        self._index_token = member.rpartition(":")[2]  # NOTIFY names it: this index's subscriber skips the wake-up
        self.flush_seconds = flush_seconds
        self.batch_events = batch_events
        self.read_flush_seconds = read_flush_seconds
        self.max_queued = max_queued
        self._clock = clock
        self._queue: deque[FeedEvent] = deque()
        self._reads: dict[tuple[str, bytes, int], list[float]] = {}  # -> [count, last read]
        self._links: dict[bytes, tuple[str, bytes]] = {}  # child -> (bucket, parent), to ship
        self._shipped: OrderedDict[bytes, bytes] = OrderedDict()  # child -> parent, recently shipped
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()
        self._reads_due = time.monotonic() + read_flush_seconds
        self._changes = 0  # events in the queue that are not reads
        self._pending: dict[tuple[str, int], list[int]] = {}  # usage deltas not yet committed
        self._unread: dict[tuple[str, int], list[int]] = {}  # committed since the ledger was last read
        self.head = 0  # the last sequence number this publisher was given
        self.published = 0
        self.batches = 0
        self.failures = 0
        self.dropped = 0
        self.reads_dropped = 0
        self.outage_since: float | None = None
        self.last_error = ""

    # -- producers (event loop) -------------------------------------------------------------

    def add(self, event: FeedEvent) -> None:
        if not event.at:
            event.at = self._clock()
        was_empty = not self._queue
        self._queue.append(event)
        if event.kind not in HINTS:
            self._changes += 1
        self._count_pending([event], 1)
        if was_empty or len(self._queue) >= self.batch_events:
            self._wake.set()

    def _count_pending(self, events: Sequence[FeedEvent], sign: int,
                       into: dict[tuple[str, int], list[int]] | None = None) -> None:
        deltas = self._pending if into is None else into
        for event in events:
            db, dc = event.usage_delta()
            if db or dc:
                slot = deltas.setdefault((event.bucket, event.tier), [0, 0])
                slot[0] += sign * db
                slot[1] += sign * dc

    def read(self, bucket: str, digest: bytes, tier: int, now: float) -> None:
        slot = self._reads.get((bucket, digest, tier))
        if slot is None:
            self._reads[(bucket, digest, tier)] = [1, now]
        else:
            slot[0] += 1
            slot[1] = max(slot[1], now)

    def chained(self, bucket: str, digests: Sequence[bytes]) -> None:
        """A client looked ``digests`` up in this order: ship the links not shipped lately."""
        shipped = self._shipped
        for parent, child in pairwise(digests):
            if child == parent or shipped.get(child) == parent:
                continue
            self._links[child] = (bucket, parent)

    def admit(self) -> str | None:
        """None while new client writes may proceed; else why not (503)."""
        if self._changes < self.max_queued:
            return None
        return (f"the cluster catalog has been unreachable for {self.outage_seconds():.0f} s and "
                f"{self._changes} changes wait to be published; writes resume when it answers")

    def queued(self) -> int:
        return len(self._queue)

    def outage_seconds(self) -> float:
        return 0.0 if self.outage_since is None else max(0.0, self._clock() - self.outage_since)

    def pending_usage(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Usage deltas the shared ledger as last read lacks: events not yet committed, and events
        committed since the last read (the usage view adds them to the rows it read)."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for deltas in (self._pending, self._unread):
            for key, (b, c) in deltas.items():
                ob, oc = out.get(key, (0, 0))
                out[key] = (ob + b, oc + c)
        return {key: value for key, value in out.items() if value != (0, 0)}

    def ledger_read(self) -> None:
        """The shared ledger was just read under ``settled``: it holds every batch committed so far."""
        self._unread.clear()

    def settled(self) -> asyncio.Lock:
        """Held while a batch is being published: a reader of the shared ledger holds it too, so that
        ledger rows and ``pending_usage`` never both count a batch (committed, not yet taken off the
        pending deltas) or both miss it."""
        return self._flushing

    # -- the flusher --------------------------------------------------------------------------

    async def run(self) -> None:
        backoff = 0.1
        while True:
            if not self._queue:
                timeout = max(0.0, self._reads_due - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                        await self._wake.wait()
            self._wake.clear()
            if self._queue and len(self._queue) < self.batch_events and self.flush_seconds > 0:
                await asyncio.sleep(self.flush_seconds)  # let a batch gather
            if time.monotonic() >= self._reads_due:
                self._queue_reads()
            if await self.flush_queued():
                backoff = 0.1
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _queue_reads(self) -> None:
        """Queue the aggregated reads and links (hints for eviction order: dropped when the queue is full)."""
        self._reads_due = time.monotonic() + self.read_flush_seconds
        reads, self._reads = self._reads, {}
        links, self._links = self._links, {}
        if len(self._queue) >= self.max_queued:
            self.reads_dropped += len(reads) + len(links)
            return
        now = self._clock()
        for (bucket, digest, tier), (count, last) in reads.items():
            self._queue.append(FeedEvent(Kind.READ, bucket, digest, tier, at=last, count=int(count)))
        for child, (bucket, parent) in links.items():
            self._queue.append(FeedEvent(Kind.LINKED, bucket, child, 0, at=now, detail=parent))
            self._shipped[child] = parent
            self._shipped.move_to_end(child)
        while len(self._shipped) > _SHIPPED_LINKS:
            self._shipped.popitem(last=False)

    async def flush(self, *, reads: bool = True) -> bool:
        """Publish everything queued now (reads too); False if the catalog did not take it."""
        if reads:
            self._queue_reads()
        return await self.flush_queued()

    async def flush_queued(self) -> bool:
        """Publish the queue in batches, in order. The lock is taken per batch (``settled``), so a
        ledger read waits for one batch, not for a queue that writers keep filling."""
        while self._queue:
            async with self._flushing:
                if not self._queue:
                    break
                batch = [self._queue.popleft() for _ in range(min(self.batch_events, len(self._queue)))]
                try:
                    self.head = await self._db.run(self._write, batch)
                except (DBAPIError, OSError) as exc:
                    if isinstance(exc, (IntegrityError, DataError)):  # about the rows: would fail forever
                        self._changes -= sum(1 for event in batch if event.kind not in HINTS)
                        self._count_pending(batch, -1)
                        self.dropped += len(batch)
                        log.error("cluster feed: dropped %d events the catalog refused: %s", len(batch), exc)
                        continue
                    self._queue.extendleft(reversed(batch))
                    self._failed(exc)
                    return False
                self._changes -= sum(1 for event in batch if event.kind not in HINTS)
                self._count_pending(batch, -1)
                self._count_pending(batch, 1, into=self._unread)
                self.published += len(batch)
                self.batches += 1
                if self.outage_since is not None:
                    log.warning("cluster feed: catalog reachable again after %.1f s; published %d queued events",
                                self.outage_seconds(), len(batch))
                    self.outage_since = None
        return True

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if self.outage_since is None:
            self.outage_since = self._clock()
            log.warning("cluster feed: cannot publish (%s); %d events queued in memory, retrying",
                        self.last_error, len(self._queue))

    def _write(self, batch: Sequence[FeedEvent]) -> int:
        """One transaction: take sequence numbers from the head, insert the events, apply the usage
        deltas, notify. Returns the new head."""
        n = len(batch)
        deltas: dict[tuple[str, int], list[int]] = {}
        for event in batch:
            db, dc = event.usage_delta()
            if db or dc:
                slot = deltas.setdefault((event.bucket, event.tier), [0, 0])
                slot[0] += db
                slot[1] += dc
        if self._db.postgres:
            return self._write_postgres(batch, deltas)
        with self._db.engine.begin() as conn:
            head = int(conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=HEAD.c.seq + n)
                                    .returning(HEAD.c.seq)).scalar_one())
            first = head - n + 1
            conn.execute(insert(EVENTS), [event.row(first + i, self.member) for i, event in enumerate(batch)])
            for (bucket, tier), (db, dc) in sorted(deltas.items()):
                stmt = self._db.upsert(USAGE).values(bucket=bucket, tier=tier, bytes=db, chunks=dc)
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["bucket", "tier"],
                    set_={"bytes": USAGE.c.bytes + stmt.excluded.bytes,
                          "chunks": USAGE.c.chunks + stmt.excluded.chunks},
                ))
        return head

    def _write_postgres(self, batch: Sequence[FeedEvent], deltas: dict[tuple[str, int], list[int]]) -> int:
        """``_write`` on PostgreSQL as one statement (one round trip, prepared by psycopg after a few
        uses): the head update, the events and the usage deltas as arrays, and the NOTIFY. The
        statement-per-step form cost 1.6 ms of the gateway's CPU per batch (BENCHMARKS.md, cluster)."""
        events = [event.row(0, self.member) for event in batch]
        deltas = dict(sorted(deltas.items()))  # rows locked in one order by every publisher
        params = {
            "n": len(batch), "member": self.member,
            "at": [e["at"] for e in events], "bucket": [e["bucket"] for e in events],
            "digest": [e["digest"] for e in events], "kind": [e["kind"] for e in events],
            "tier": [e["tier"] for e in events], "size": [e["size"] for e in events],
            "expires": [e["expires"] for e in events], "count": [e["count"] for e in events],
            "detail": [e["detail"] for e in events],
            "u_bucket": [b for b, _ in deltas], "u_tier": [t for _, t in deltas],
            "u_bytes": [d[0] for d in deltas.values()], "u_chunks": [d[1] for d in deltas.values()],
            "channel": self._db.channel, "token": self._index_token,
        }
        with self._db.engine.begin() as conn:
            return int(conn.exec_driver_sql(_PUBLISH_POSTGRES, params).scalar_one())


_PUBLISH_POSTGRES = """
WITH head AS (
    UPDATE feed_head SET seq = seq + %(n)s WHERE id = 1 RETURNING seq
), events AS (
    INSERT INTO chunk_events (seq, at, member, bucket, digest, kind, tier, size, expires, count, detail)
    SELECT head.seq - %(n)s + e.ord, e.at, %(member)s, e.bucket, e.digest, e.kind, e.tier, e.size, e.expires,
           e.count, e.detail
    FROM head, unnest(%(at)s::float8[], %(bucket)s::text[], %(digest)s::bytea[], %(kind)s::int2[],
                      %(tier)s::int2[], %(size)s::int8[], %(expires)s::float8[], %(count)s::int4[],
                      %(detail)s::bytea[])
         WITH ORDINALITY AS e(at, bucket, digest, kind, tier, size, expires, count, detail, ord)
), usage AS (
    INSERT INTO tier_usage (bucket, tier, bytes, chunks)
    SELECT u.bucket, u.tier, u.bytes, u.chunks  -- FROM head: after the head's row lock, as in _write
    FROM head, unnest(%(u_bucket)s::text[], %(u_tier)s::int2[], %(u_bytes)s::int8[], %(u_chunks)s::int8[])
         AS u(bucket, tier, bytes, chunks)
    ON CONFLICT (bucket, tier) DO UPDATE
        SET bytes = tier_usage.bytes + excluded.bytes, chunks = tier_usage.chunks + excluded.chunks
)
SELECT head.seq, pg_notify(%(channel)s, head.seq::text || ' ' || %(token)s) FROM head
"""


class ClusterEvents:
    """The ``ChunkEvents`` the service and the mover report to: passes everything to the local sink
    (the lifecycle ledgers) and publishes what changed a tier to the feed. Index-only news (a copy
    ``learned`` or found ``vanished``) stays local: whoever changed the tier published it."""

    def __init__(self, publisher: FeedPublisher, local: ChunkEvents, index: ChunkIndex) -> None:
        self._publisher = publisher
        self._local = local
        self._index = index

    def stored(self, bucket: str, digest: bytes, tier: TierId, size: int, expires: float,
               parent: bytes | None, now: float, *, reason: StoredReason = "stored",
               info: ChunkInfo | None = None) -> None:
        self._local.stored(bucket, digest, tier, size, expires, parent, now, reason=reason, info=info)
        kind = STORED_KINDS.get(reason)
        if kind is None:
            return
        if info is None:
            entry = self._index.get(digest)
            if entry is None:
                return  # gone already: the removal that follows says so
            info = ChunkInfo.from_entry(entry)
        self._publisher.add(FeedEvent(kind, bucket, digest, int(tier), size, expires, now,
                                      detail=add_detail(info, parent)))

    def read(self, bucket: str, digest: bytes, tier: TierId, now: float) -> None:
        self._local.read(bucket, digest, tier, now)
        self._publisher.read(bucket, digest, int(tier), now)

    def removed(self, bucket: str, digest: bytes, tier: TierId, *, reason: RemovedReason = "deleted",
                info: ChunkInfo | None = None) -> None:
        self._local.removed(bucket, digest, tier, reason=reason, info=info)
        kind = REMOVED_KINDS.get(reason)
        if kind is None:
            return
        if info is None and (entry := self._index.get(digest)) is not None:
            info = ChunkInfo.from_entry(entry)
        size = 0 if info is None else info.size
        self._publisher.add(FeedEvent(kind, bucket, digest, int(tier), size, detail=removal_detail(info)))

    def chained(self, bucket: str, digests: list[bytes]) -> None:
        self._local.chained(bucket, digests)
        self._publisher.chained(bucket, digests)

    def marked(self, bucket: str, digest: bytes, set_marks: int, clear_marks: int, now: float) -> None:
        self._local.marked(bucket, digest, set_marks, clear_marks, now)
        self._publisher.add(FeedEvent(Kind.MARKED, bucket, digest, 0, at=now, count=set_marks | clear_marks << 8))


# -- subscribing -----------------------------------------------------------------------------------


@dataclass
class _Lag:
    """Recent feed lags (seconds from an event's publication time to its application here)."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, seconds: float) -> None:
        self.samples.append(max(0.0, seconds))

    def percentile(self, q: float) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Resync = Callable[[int, bool], Awaitable[None]]
Seed = Callable[[str], Awaitable[int | None]]
POSITION_PERSIST_SECONDS = 1.0  # a feed position past only this index's own events is written this often
"""``resync(head, new_index)``: bring the index in line with the tiers; ``head`` is the feed head read
before (events after it are applied afterwards), ``new_index`` whether the index never followed this
feed (new, lost, or another catalog's) rather than fell behind it."""


class FeedSubscriber:
    """Applies other gateways' events to the local index in order (see the module docstring)."""

    def __init__(self, db: ClusterDB, index: ChunkIndex, member: str, *, poll_seconds: float = 0.25,
                 batch_events: int = 2000, listener: ChunkEvents | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._index = index
        self.member = member
        self.index_token = member.rpartition(":")[2]
        self._persisted_at = float("-inf")  # when the feed position was last written to the index
        self.poll_seconds = poll_seconds
        self.batch_events = batch_events
        self._listener = listener
        self._clock = clock
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.feed_id = ""
        self.position = 0
        self.head = 0  # the feed head as last read
        self.applied = 0  # events of other gateways applied
        self.resyncs = 0
        self.listening = False
        self.caught_up_at = 0.0
        self.failures = 0
        self.outage_since: float | None = None
        self.last_error = ""
        self.lag = _Lag()
        self._resync: Resync | None = None

    def wake(self) -> None:
        self._wake.set()

    async def start(self, resync: Resync, seed: Seed | None = None) -> None:
        """Find this index's place in the feed. An index that never followed this feed is seeded from a
        snapshot (``seed``: the feed position it was seeded to, None if it could not be) and catches up
        from there, or else resynced with the tiers."""
        self._resync = resync
        self.feed_id = await self._db.run(self._db.feed_id)
        known = self._index.feed_position()
        if known is None and seed is not None and (seeded := await seed(self.feed_id)) is not None:
            self.position = seeded
        elif known is None or known[0] != self.feed_id:
            why = "a new index" if known is None else "an index that followed another catalog's feed"
            log.info("cluster feed: %s; resyncing it with the tiers", why)
            await self.resync(new_index=True)
        else:
            self.position = known[1]

    async def resync(self, *, new_index: bool = False) -> None:
        """Read the head, bring the index in line with the tiers, continue from that head."""
        assert self._resync is not None
        head = await self._db.run(self._db.current_head)
        await self._resync(head, new_index)
        await self._index.set_feed_position(self.feed_id, head)
        self.position = head
        self.resyncs += 1

    async def run(self) -> None:
        """Apply events as they come: on every wake-up (LISTEN) and every ``poll_seconds``."""
        while True:
            try:
                applied = await self.catch_up()
            except (DBAPIError, OSError) as exc:
                self._failed(exc)
                applied = 0
            except Exception as exc:  # never let the subscriber die silently: log, retry at the next poll
                self._failed(exc)
                log.exception("cluster feed: applying events after %d failed; retrying", self.position)
                applied = 0
            if applied >= self.batch_events:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_seconds):  # no task per wait, unlike wait_for
                    await self._wake.wait()
            self._wake.clear()

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if self.outage_since is None:
            self.outage_since = self._clock()
            log.warning("cluster feed: cannot read the feed (%s); the index keeps serving, retrying",
                        self.last_error)

    async def catch_up(self) -> int:
        """Apply one batch of the events after this index's position; returns how many were read."""
        async with self._lock:
            head, rows = await self._db.run(self._fetch, self.position)
            if self.outage_since is not None:
                log.warning("cluster feed: reading again after %.1f s", self._clock() - self.outage_since)
                self.outage_since = None
            self.head = head
            if not rows:
                if head != self.position:
                    # head > position: the events were trimmed; head < position: the feed was reset
                    log.warning("cluster feed: this index is at %d, the feed at %d with nothing in between "
                                "kept; resyncing with the tiers", self.position, head)
                    await self.resync()
                else:
                    self.caught_up_at = self._clock()
                return 0
            if rows[0][0] != self.position + 1:
                log.warning("cluster feed: events %d-%d were trimmed before this index applied them; "
                            "resyncing with the tiers", self.position + 1, rows[0][0] - 1)
                await self.resync()
                return 0
            changes: list[IndexChange] = []
            published: list[float] = []
            for _seq, at, member, bucket, digest, kind, tier, size, expires, count, detail in rows:
                if member.rpartition(":")[2] == self.index_token:
                    continue  # published by a process sharing this index (itself, a sibling worker)
                change = to_change(kind, bucket, bytes(digest), tier, size, expires, at, count,
                                   None if detail is None else bytes(detail))
                if change is None:
                    continue
                changes.append(change)
                if kind not in HINTS:
                    published.append(at)
            last = rows[-1][0]
            now = self._clock()
            if changes or now - self._persisted_at >= POSITION_PERSIST_SECONDS:
                done = await self._index.apply_changes(changes, self.feed_id, last)
                self._persisted_at = now
            else:  # only this index's own events: no index write; the position is persisted later (a
                done = []  # crash before that replays them, and they are skipped again)
            self.position = last
            for at in published:
                self.lag.add(now - at)
            self.applied += len(changes)
            if last >= head:
                self.caught_up_at = now
            self._tell_listener(done, rows)
            return len(rows)

    def _fetch(self, position: int) -> tuple[int, list[tuple[Any, ...]]]:
        """The head (read first: every event up to it is committed), then the events after ``position``."""
        with self._db.engine.connect() as conn:
            head = ClusterDB.head(conn)
            rows = conn.execute(
                select(EVENTS.c.seq, EVENTS.c.at, EVENTS.c.member, EVENTS.c.bucket, EVENTS.c.digest,
                       EVENTS.c.kind, EVENTS.c.tier, EVENTS.c.size, EVENTS.c.expires, EVENTS.c.count,
                       EVENTS.c.detail)
                .where(EVENTS.c.seq > position).order_by(EVENTS.c.seq).limit(self.batch_events)
            ).all()
        return head, [tuple(row) for row in rows]

    def _tell_listener(self, done: list[IndexChange], rows: list[tuple[Any, ...]]) -> None:
        """Keep the local lifecycle state in step with removals and reads other gateways made."""
        listener = self._listener
        if listener is None or not done:
            return
        buckets = {bytes(row[4]): row[3] for row in rows}
        for change in done:
            bucket = buckets.get(change.digest)
            if bucket is None:
                continue
            if change.op == ChangeOp.REMOVE:  # (links carry no tier: only these two name one)
                listener.removed(bucket, change.digest, TierId(change.tier), reason="vanished")
            elif change.op == ChangeOp.READ:
                listener.read(bucket, change.digest, TierId(change.tier), change.at)

    def lag_seconds(self) -> float:
        """How far behind the feed this index is, in seconds (0 when caught up at the last look)."""
        if self.position >= self.head:
            return 0.0
        return max(0.0, self._clock() - self.caught_up_at) if self.caught_up_at else 0.0

    def stats(self) -> dict[str, Any]:
        p50, p99 = self.lag.percentile(0.5), self.lag.percentile(0.99)
        return {
            "position": self.position, "head": self.head, "behind_events": max(0, self.head - self.position),
            "applied": self.applied, "resyncs": self.resyncs, "listening": self.listening,
            "lag_p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "lag_p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "lag_samples": len(self.lag.samples), "read_failures": self.failures,
            "reading": self.outage_since is None, "last_error": self.last_error,
        }


async def listen(db: ClusterDB, subscriber: FeedSubscriber) -> None:
    """Wake the subscriber on every ``NOTIFY`` of the feed channel (PostgreSQL); reconnects forever."""

    def note(payload: str) -> None:
        if payload.rpartition(" ")[2] != subscriber.index_token:
            subscriber.wake()  # events of this index's own processes wait for the poll

    def state(up: bool) -> None:
        subscriber.listening = up
        if up:
            subscriber.wake()  # catch up on what was published while not listening

    await db.listen(db.channel, note, state, what=f"cluster feed (polling every {subscriber.poll_seconds:.2f} s "
                                                  "until it is back)")


# -- retention -------------------------------------------------------------------------------------


def trim_feed(db: ClusterDB, *, now: float, keep_seconds: float, keep_events: int) -> int:
    """Delete events older than ``keep_seconds`` or beyond the newest ``keep_events``; returns how many.

    Cheap on any member: the cut is found by walking the primary key from the oldest event to the
    first young one, and the delete is a range on the primary key.
    """
    with db.engine.begin() as conn:
        head = ClusterDB.head(conn)
        young = conn.execute(select(EVENTS.c.seq).where(EVENTS.c.at >= now - keep_seconds)
                             .order_by(EVENTS.c.seq).limit(1)).scalar_one_or_none()
        cut = head + 1 if young is None else int(young)
        cut = max(cut, head - keep_events + 1)
        result = conn.execute(delete(EVENTS).where(EVENTS.c.seq < cut))
        return int(result.rowcount or 0)
