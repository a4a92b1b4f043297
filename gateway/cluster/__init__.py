"""Several gateways acting as one tier: the change feed, the shared usage ledger, members.

The tiers (the shared directory, the S3 bucket) hold the truth about which chunks exist; the catalog
database holds the cluster's shared state (revision 0005); each gateway's LMDB index is a cache of
both. ``Cluster`` wires one gateway process into that:

- ``events``: the ``ChunkEvents`` the service and the tier mover report to (``feed.ClusterEvents``):
  the local lifecycle ledgers, plus the feed publisher for every change to a tier;
- the feed subscriber, which applies other gateways' changes to the local index (``feed``), resyncing
  the index with the tiers when the feed cannot (``resync``), or a new index seeded from the snapshot
  the lifecycle leader shares in the directory (``snapshot``); of the worker processes sharing an index
  (``kvgw serve --workers``) one runs it, the one holding an exclusive ``flock`` on
  ``<index dir>/feed-subscriber.lock`` (the kernel releases it when that process dies, and another
  worker takes over within a second);
- ``usage``: the cluster-wide usage per bucket and tier (``usage.UsageView``);
- this process's ``cluster_members`` row and heartbeat (``members``), which also trims the feed.

The same code runs for one gateway on SQLite (the embedded default): it is then the only member, its
subscriber polls (there is no LISTEN) and skips its own events. The lifecycle leader
(``gateway.cluster.leader``) is separate. ``cluster_enabled = false`` turns all of it off (the events go
to the ledgers alone, usage is the ledgers'): for one gateway that wants no database writes beside its
catalog, and for measuring what coordination costs.

When the catalog database is unreachable, reads keep serving from the index and the tiers, and writes
keep working: their events wait in memory and are published when it answers again, up to
``cluster_max_queued_events``; past that, new writes and deletes are refused with 503 until the queue
drains (``admit_writes``). Other gateways' indexes lag meanwhile (a lookup may fall through, a PUT
confirms with the tier, so nothing is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from backends.base import Tier
from backends.index import ChunkIndex, IndexEntry
from backends.tiers import TierId
from gateway.chunks import ChunkEvents, ChunkInfo
from gateway.cluster.db import ClusterDB
from gateway.cluster.feed import ClusterEvents, FeedPublisher, FeedSubscriber, listen, trim_feed
from gateway.cluster.members import Membership, new_member_id
from gateway.cluster.resync import ResyncReport, resync_index
from gateway.cluster.snapshot import SnapshotError, SnapshotInfo, seed_index, write_snapshot
from gateway.cluster.usage import UsageView, write_usage
from gateway.config import Settings

__all__ = ["Cluster", "ClusterDB", "UsageView"]

log = logging.getLogger("kvgw.cluster")


class Cluster:
    def __init__(self, settings: Settings, catalog_url: str, index: ChunkIndex, tiers: Mapping[TierId, Tier], *,
                 local: ChunkEvents, local_usage: Callable[[str, TierId], int] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.enabled = settings.cluster_enabled
        self.member = new_member_id(index.identity() if self.enabled else None)
        self.db = ClusterDB(catalog_url, channel=settings.cluster_feed_channel)
        self._index = index
        self._tiers = dict(tiers)
        self._local = local
        self._clock = clock
        self.publisher = FeedPublisher(
            self.db, self.member, flush_seconds=settings.cluster_flush_seconds,
            batch_events=settings.cluster_flush_events, read_flush_seconds=settings.cluster_read_flush_seconds,
            max_queued=settings.cluster_max_queued_events, clock=clock,
        )
        self.events: ChunkEvents = ClusterEvents(self.publisher, local, index) if self.enabled else local
        self.subscriber = FeedSubscriber(self.db, index, self.member, poll_seconds=settings.cluster_poll_seconds,
                                         listener=local, clock=clock)
        self.usage = UsageView(self.db, pending=self.publisher.pending_usage, settled=self.publisher.settled,
                               read_back=self.publisher.ledger_read,
                               fallback=local_usage,
                               refresh_seconds=settings.cluster_usage_refresh_seconds, clock=clock)
        url = settings.cluster_url or f"http{'s' if settings.tls_cert else ''}://{settings.host}:{settings.port}"
        self.membership = Membership(
            self.db, self.member, url=url, position=self.index_position,
            heartbeat_seconds=settings.cluster_heartbeat_seconds,
            forget_seconds=settings.cluster_member_forget_seconds, housekeeping=self.trim,
            housekeeping_seconds=settings.cluster_trim_seconds, clock=clock,
        )
        self.last_resync: ResyncReport | None = None
        self.seeded: SnapshotInfo | None = None  # the snapshot this index was seeded from, if it was
        self.last_snapshot: SnapshotInfo | None = None  # the last snapshot this process wrote
        self.resyncing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._lock_fd: int | None = None
        self.subscribing = False  # this process holds the index's subscriber lock

    def index_position(self) -> int:
        """The last feed event applied to the index (by whichever process of this host applies them)."""
        known = self._index.feed_position()
        return 0 if known is None else known[1]

    def admit_writes(self) -> str | None:
        """For ``ChunkService``: None while writes may proceed (see the module docstring)."""
        return self.publisher.admit() if self.enabled else None

    # -- running -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start publishing at once; find the index's place in the feed (resyncing in the background if
        it needs one), then follow the feed. A catalog that cannot be reached is retried in the
        background: the gateway starts anyway."""
        if not self.enabled:
            return
        self._spawn(self.publisher.run(), "kvgw-feed-publisher")
        self._spawn(self.membership.run(), "kvgw-cluster-heartbeat")
        self._spawn(self._refresh_usage(), "kvgw-cluster-usage")
        self._spawn(self._follow(), "kvgw-feed-subscriber")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_death)
        self._tasks.append(task)

    async def _follow(self) -> None:
        await self._take_subscriber_lock()
        self.subscribing = True
        if self.db.postgres:
            self._spawn(listen(self.db, self.subscriber), "kvgw-feed-listen")
        delay = 0.5
        while True:
            try:
                await self.subscriber.start(self._resync, self._seed)
                break
            except Exception as exc:  # the catalog is down at start: keep serving, retry
                log.warning("cluster feed: cannot start following the feed (%s); retrying in %.1f s",
                            type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        await self.subscriber.run()

    async def _take_subscriber_lock(self) -> None:
        """Wait until this process is the one applying the feed to this index (see the module docstring)."""
        fd = os.open(self._index.path / "feed-subscriber.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock_fd = fd
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                await asyncio.sleep(1.0)

    def fs_root(self) -> Path | None:
        """The filesystem tier's directory (where index snapshots are shared), if there is one."""
        fs = self._tiers.get(TierId.FS)
        root = getattr(fs, "root", None)
        return root if isinstance(root, Path) else None

    async def _seed(self, feed_id: str) -> int | None:
        """Seed a new, empty index from the shared snapshot (``gateway.cluster.snapshot``); the feed
        position it holds, or None (no snapshot of this feed, a damaged one, an index not empty): then
        the index is resynced from the tiers. The usage ledger is not recounted on this path (run
        ``kvgw cluster reconcile`` after a crash that lost queued events)."""
        root = self.fs_root()
        if root is None or not self.settings.cluster_snapshot_seconds or self._index.count():
            return None
        started = time.monotonic()
        try:
            info = await asyncio.to_thread(seed_index, self._index, root, feed_id)
        except (SnapshotError, OSError) as exc:
            log.warning("cluster: the shared index snapshot cannot be used (%s); resyncing from the tiers", exc)
            return None
        if info is None:
            return None
        self.seeded = info
        log.info("cluster: index seeded from the shared snapshot in %.1f s: %d chunks at feed position %d "
                 "(written %.0f s ago by %s); catching up from the feed", time.monotonic() - started,
                 info.records, info.seq, self._clock() - info.written_at, info.member)
        return info.seq

    async def write_snapshot(self) -> SnapshotInfo | None:
        """Write this index as the shared snapshot (the lifecycle leader calls it; blocking work in a
        thread). None when there is no shared directory or the index follows no feed yet."""
        root = self.fs_root()
        if root is None:
            return None
        info = await asyncio.to_thread(write_snapshot, self._index, root, member=self.member)
        if info is not None:
            self.last_snapshot = info
        return info

    async def _resync(self, head: int, new_index: bool) -> None:
        """Resync the index with the tiers (``resync``); recount the usage ledger from the same scan when
        the index was new or lost (a crash that lost it may have lost queued events too) or the ledger
        was never counted. A tier that cannot be reached now is resynced later, in the background."""
        report = await self._resync_tiers(self._tiers)
        tiers = [int(t) for t in self._tiers if t not in report.failed]

        def recount() -> bool:
            return bool(tiers) and write_usage(self.db, report.count, tiers, now=self._clock(), since=head,
                                               only_if_uncounted=not new_index)

        if await self.db.run(recount):
            log.info("cluster: usage ledger recounted from the tiers")
            await self.usage.refresh()
        if report.failed:
            self._spawn(self._resync_later({t: self._tiers[t] for t in report.failed}), "kvgw-resync-later")

    async def _resync_tiers(self, tiers: Mapping[TierId, Tier]) -> ResyncReport:
        self.resyncing = True
        try:
            def added(digest: bytes, entry: IndexEntry, bit: int) -> None:
                self._local.stored(entry.bucket, digest, TierId(bit), entry.size, entry.expires, None,
                                   entry.created, reason="learned", info=ChunkInfo.from_entry(entry))

            report = await resync_index(self._index, tiers, added=added, clock=self._clock)
            self.last_resync = report
            log.info("cluster: index resynced with the tiers in %.1f s: %d chunks, %d entries added, %d removed",
                     report.seconds, report.chunks, report.added, report.removed)
            return report
        finally:
            self.resyncing = False

    async def _resync_later(self, tiers: dict[TierId, Tier]) -> None:
        """Resync tiers that were unreachable, once they answer (the feed goes on meanwhile)."""
        delay = 5.0
        while tiers:
            await asyncio.sleep(delay)
            report = await self._resync_tiers(tiers)
            tiers = {t: tier for t, tier in tiers.items() if t in report.failed}
            delay = min(delay * 2, 300.0)

    async def _refresh_usage(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.usage.refresh()
            await asyncio.sleep(self.settings.cluster_usage_refresh_seconds)

    async def trim(self) -> None:
        now = self._clock()
        removed = await self.db.run(lambda: trim_feed(
            self.db, now=now, keep_seconds=self.settings.cluster_feed_retention_seconds,
            keep_events=self.settings.cluster_feed_retention_events))
        if removed:
            log.info("cluster feed: trimmed %d old events", removed)

    async def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued (for at most ``timeout`` seconds), leave, stop the background work."""
        if not self.enabled:
            return
        for task in self._tasks:
            if task.get_name() != "kvgw-feed-publisher":
                task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.publisher.flush(), timeout)
        if self.publisher.queued():
            log.warning("cluster feed: %d events could not be published before stopping; other gateways "
                        "learn of those changes from the tiers (fall-through, resync, reconcile)",
                        self.publisher.queued())
        await self.membership.leave()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the subscriber lock for a sibling worker
            self._lock_fd = None
            self.subscribing = False

    def close(self) -> None:
        self.db.close()

    # -- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The ``cluster`` section of ``/v1/admin/stats``."""
        pub = self.publisher
        if not self.enabled:
            return {"enabled": False, "member": self.member, "usage": self.usage.report()}
        return {
            "enabled": True,
            "member": self.member,
            "database": self.db.engine.dialect.name,
            "usage": self.usage.report(),
            "usage_fresh": self.usage.fresh,
            "feed": {
                **self.subscriber.stats(),
                "subscribing": self.subscribing,  # this process applies the feed to the index
                "position": self.index_position(),
                "published": pub.published, "batches": pub.batches, "queued": pub.queued(),
                "publish_failures": pub.failures, "publishing": pub.outage_since is None,
                "outage_s": round(pub.outage_seconds(), 1), "dropped": pub.dropped, "reads_dropped": pub.reads_dropped,
                "resyncing": self.resyncing,
                "last_resync": None if self.last_resync is None else {
                    "chunks": self.last_resync.chunks, "added": self.last_resync.added,
                    "removed": self.last_resync.removed, "seconds": round(self.last_resync.seconds, 3)},
                "seeded_from": None if self.seeded is None else asdict(self.seeded),  # a shared snapshot
                "last_snapshot": None if self.last_snapshot is None else asdict(self.last_snapshot),
            },
            "heartbeat_age_s": None if self.membership.beat_at is None
            else round(self._clock() - self.membership.beat_at, 1),
        }


def _log_death(task: asyncio.Task[Any]) -> None:
    """A cluster task that ends other than by cancellation is a bug: say so (asyncio would not)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster task %s died", task.get_name(), exc_info=task.exception())
