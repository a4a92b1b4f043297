"""The shared usage ledger: bytes and chunks per (bucket, tier) for the whole tier, all gateways together.

Table ``tier_usage`` (revision 0005). Every gateway's feed publisher applies the usage deltas of its
events in the transaction that publishes them (``gateway.cluster.feed``), so the ledger is exact across
restarts and gateways as long as events are not lost; ``write_usage`` recounts it from a scan of the
tiers (``gateway.cluster.resync``): after a gateway's index was lost or is new (a crash that lost the
index may have lost queued events too), the first time a catalog's feed is used (an existing deployment
that predates the ledger), and on ``kvgw cluster reconcile``. A recount stays exact while the tiers
change: the events published during the scan are added for the chunks the scan had already passed
when they happened, and left out for the others (which the scan saw in their new state).

Read API, for the lifecycle leader and the admin endpoints (``UsageView``)::

    view.usage(bucket, tier) -> int      bytes the tier holds for the bucket, cluster-wide
    view.chunks(bucket, tier) -> int     chunks likewise
    view.report() -> {bucket: {"fs_bytes", "fs_chunks", "s3_bytes", "s3_chunks"}}
    view.fresh -> bool                   the shared ledger was read within a few refresh intervals
    await view.refresh()                 read the ledger now (the cluster refreshes it every
                                         ``cluster_usage_refresh_seconds`` in the background)

``tier`` is a ``TierId``. These calls never touch the database: they answer from the last read of the
ledger plus this gateway's own events that are queued but not yet published (so a gateway sees its own
writes at once). Before the ledger could be read even once (the catalog unreachable since start), they
answer from the local fallback given to the view (this gateway's lifecycle ledgers): a
per-gateway view, the best there is without the catalog.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from backends.tiers import TierId
from gateway.cluster.db import EVENTS, META, USAGE, USAGE_COUNTED, ClusterDB
from gateway.cluster.feed import ADDS, REMOVALS
from gateway.cluster.resync import TierCount

log = logging.getLogger("kvgw.cluster")

Pending = Callable[[], dict[tuple[str, int], tuple[int, int]]]
Settled = Callable[[], contextlib.AbstractAsyncContextManager[Any]]
Fallback = Callable[[str, TierId], int]


class UsageView:
    """Cluster-wide usage per (bucket, tier), cached; see the module docstring for the API."""

    def __init__(self, db: ClusterDB, *, pending: Pending | None = None, settled: Settled | None = None,
                 read_back: Callable[[], None] | None = None, fallback: Fallback | None = None,
                 refresh_seconds: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        """``pending``: this gateway's usage deltas the ledger as last read lacks (not yet published, or
        published since); ``settled``: a lock its publisher holds while a batch is in flight (the ledger
        is read under it, so the two add up exactly); ``read_back``: called under that lock once the
        ledger was read (the publisher forgets what it published before)."""
        self._db = db
        self._pending = pending
        self._settled = settled
        self._read_back = read_back
        self._fallback = fallback
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._rows: dict[tuple[str, int], tuple[int, int]] = {}
        self.read_at: float | None = None  # when the shared ledger was last read
        self.counted_at: float | None = None  # when it was last recounted from the tiers

    # -- reads (no I/O) ------------------------------------------------------------------------

    def _current(self, bucket: str, tier: int) -> tuple[int, int]:
        bytes_, chunks = self._rows.get((bucket, tier), (0, 0))
        if self._pending is not None:
            db, dc = self._pending().get((bucket, tier), (0, 0))
            bytes_, chunks = bytes_ + db, chunks + dc
        return max(0, bytes_), max(0, chunks)

    def usage(self, bucket: str, tier: TierId) -> int:
        if self.read_at is None and self._fallback is not None:
            return self._fallback(bucket, tier)
        return self._current(bucket, int(tier))[0]

    def chunks(self, bucket: str, tier: TierId) -> int:
        return self._current(bucket, int(tier))[1]

    @property
    def fresh(self) -> bool:
        return self.read_at is not None and self._clock() - self.read_at <= 5 * max(self.refresh_seconds, 1.0)

    def report(self) -> dict[str, dict[str, int]]:
        keys = set(self._rows)
        if self._pending is not None:
            keys |= set(self._pending())
        out: dict[str, dict[str, int]] = {}
        for bucket, tier in sorted(keys):
            label = TierId(tier).label
            bytes_, chunks = self._current(bucket, tier)
            out.setdefault(bucket, {})[f"{label}_bytes"] = bytes_
            out[bucket][f"{label}_chunks"] = chunks
        return out

    # -- refresh -------------------------------------------------------------------------------

    async def refresh(self) -> None:
        async with self._settled() if self._settled is not None else contextlib.nullcontext():
            self._rows, self.counted_at = await self._db.run(read_usage, self._db)
            if self._read_back is not None:
                self._read_back()
        self.read_at = self._clock()


def read_usage(db: ClusterDB) -> tuple[dict[tuple[str, int], tuple[int, int]], float | None]:
    """Every (bucket, tier) row of the ledger, and when it was last counted from the tiers."""
    with db.engine.connect() as conn:
        rows = conn.execute(select(USAGE.c.bucket, USAGE.c.tier, USAGE.c.bytes, USAGE.c.chunks)).all()
        counted = conn.execute(select(META.c.value).where(META.c.name == USAGE_COUNTED)).scalar_one_or_none()
    return ({(r.bucket, int(r.tier)): (int(r.bytes), int(r.chunks)) for r in rows},
            None if counted is None else float(counted))


def usage_counted(db: ClusterDB) -> bool:
    """Whether the ledger was ever counted from the tiers (else it only holds deltas since the feed began)."""
    return read_usage(db)[1] is not None


def write_usage(db: ClusterDB, count: TierCount, tiers: Iterable[int], *, now: float, since: int | None,
                only_if_uncounted: bool = False) -> bool:
    """Replace the ledger's rows of ``tiers`` with a scan's ``count``, corrected by the events published
    after feed head ``since`` (read before the scan began; None: no correction).

    The last events are read and the rows written under the feed head's lock, so no publisher's delta
    lands in between. ``only_if_uncounted``: do nothing if the ledger was counted before (another
    gateway did it first). Returns whether it wrote.
    """
    tiers = sorted(set(tiers))
    totals = {key: list(value) for key, value in count.totals.items()}
    seen = since
    if seen is not None:
        with db.engine.connect() as conn:
            seen = _correct(conn, count, totals, seen)
    with db.engine.begin() as conn:
        ClusterDB.lock_head(conn)
        counted = conn.execute(select(META.c.value).where(META.c.name == USAGE_COUNTED)).scalar_one_or_none()
        if only_if_uncounted and counted is not None:
            return False
        if seen is not None:
            _correct(conn, count, totals, seen)
        conn.execute(delete(USAGE).where(USAGE.c.tier.in_(tiers)))
        rows = [{"bucket": bucket, "tier": tier, "bytes": max(0, b), "chunks": max(0, c), "rebuilt_at": now}
                for (bucket, tier), (b, c) in sorted(totals.items()) if tier in tiers]
        if rows:
            conn.execute(USAGE.insert(), rows)
        if counted is None:
            try:
                with conn.begin_nested():
                    conn.execute(META.insert().values(name=USAGE_COUNTED, value=repr(now)))
            except IntegrityError:
                pass
        else:
            conn.execute(META.update().where(META.c.name == USAGE_COUNTED).values(value=repr(now)))
    return True


def _correct(conn: Connection, count: TierCount, totals: dict[tuple[str, int], list[int]], since: int) -> int:
    """Add to ``totals`` the deltas of the events after ``since`` that the scan missed; returns the last
    sequence number read."""
    last = since
    while True:
        rows = conn.execute(
            select(EVENTS.c.seq, EVENTS.c.at, EVENTS.c.bucket, EVENTS.c.digest, EVENTS.c.kind, EVENTS.c.tier,
                   EVENTS.c.size).where(EVENTS.c.seq > last).order_by(EVENTS.c.seq).limit(10_000)
        ).all()
        for seq, at, bucket, digest, kind, tier, size in rows:
            last = seq
            sign = 1 if kind in ADDS else -1 if kind in REMOVALS else 0
            if sign and count.missed(tier, bytes(digest), at):
                slot = totals.setdefault((bucket, tier), [0, 0])
                slot[0] += sign * size
                slot[1] += sign
        if len(rows) < 10_000:
            return int(last)


def usage_rows(db: ClusterDB) -> list[dict[str, Any]]:
    """The ledger as rows (bucket, tier label, bytes, chunks), for status output."""
    rows, _ = read_usage(db)
    return [{"bucket": bucket, "tier": TierId(tier).label, "bytes": b, "chunks": c}
            for (bucket, tier), (b, c) in sorted(rows.items())]
