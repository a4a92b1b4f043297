"""Read leases between a lookup and the load that follows: granted in memory, shared in the background.

Engines look a prefix up, then load it; a chunk evicted in between turns a hit into a failed load (for
LMCache a dead engine). A lookup may therefore ask for a lease (``lease_ms``): the chunks it found are
leased, and the lifecycle (capacity eviction, demotion, TTL reclaim) leaves leased chunks alone until
the lease ends or the chunk is loaded through the gateway process that leased it.

**Granting** costs no database round trip: ``LeaseBook.grant_now`` is a plain function the lookup path
calls inline (``gateway.leases.local``: dict updates from C). Each process's syncer writes its grants
to the catalog (``chunk_leases``, through ``gateway.leases.table``) every ``sync_seconds``
(``KVGW_LEASE_SYNC_SECONDS``, 0.5 s), at once when the lifecycle leader claims chunks (``NOTIFY`` on
PostgreSQL; on SQLite a read of ``lease_head`` whenever the database files changed, checked every 50 ms
with ``ClusterDB.change_mark``), and when a lookup must wait (below). A lookup the
memory cannot settle — the process's first, one longer than its announced horizon, one past its share
of a capped bucket, a chunk removed a moment ago — takes ``grant`` (async): one sync, then the same grant.

**The leader never removes a leased chunk.** ``claim`` (the lifecycle's, before each removal batch):

1. marks the victims no written lease holds ``REMOVING`` and logs the claim under a number *c*
   (``lease_log``), notifying every process;
2. waits until every live granting process has acknowledged *c*: a sync whose ``seen >= c``. A process
   reports ``seen`` = the last claim it knew of when the sync was taken, and that sync writes every grant
   it made before it knew (grants made after knowing a claim answer the chunk absent, never lease it);
   a grant written over a claim turns the row back into a read lease;
3. keeps the claims still ``REMOVING`` (``confirm``) and lets the others go (logged, so no process
   keeps answering them absent).

So between a grant and the leader learning of it there is a window (the time to the granting process's
next sync), but the leader never acts inside it: it removes a chunk only after every process that could
have granted on it unseen has written its grants. Processes that cannot acknowledge (killed, paused, cut
off from the catalog) are waited for until their ``quiet_at``: a process grants only while its last
successful sync was sent less than ``FRESHNESS`` sync intervals ago (2 s), and only leases up to the
horizon that sync announced, so past ``synced_at + 2 s + horizon`` (the database's clock) none of its
unwritten leases is in force. Until then the leader removes nothing: a gateway SIGKILLed right after granting
stops eviction for at most that long (2 s + the longest lease it granted, 10 s by default; the claims
are retried every pass and ``lifecycle_waiting`` says why), and then its leases have run out.
``claim`` gives up after ``ACK_SECONDS`` (the pass retries). The same code runs a lone gateway on
SQLite: it is the only process to wait for.

**Caps.** A lease lasts at most the bucket's ``max_lease_ms``. In a bucket with a leased-bytes cap
(``BucketPolicy.leased_bytes_cap``) each process leases within its share, held in ``lease_quotas`` and
rebalanced by its syncs (under a per-bucket lock, the shares of live processes never add up past the
cap), so the cap holds cluster-wide exactly; a process past its share asks for more with one sync, and
is refused when the cap is spoken for (the lookup answers without a lease and says why). A chunk leased
by two processes counts in both shares.

**Loads** end a lease only through the process that granted it (it remembers what it leased; the end is
written by its next sync), so ``--workers N`` workers each grant and end their own leases; each is a
member of ``lease_members``, holds its own shares and acknowledges claims on its own.

Calls run in the leases' own two threads (a slow feed never delays a sync); an unreachable database
refuses leases once the last sync is ``FRESHNESS`` intervals old (the lookup still answers, and says so)
and makes the lifecycle skip its removals (``LeaseUnavailable``), never the reverse.

What the lookup lane calls (plain functions, event loop, never blocking): ``ChunkService.exists_leased_now``
and ``prefix_leased_now`` (the lookup and its lease in one index pass), ``ChunkService.lease_now`` (a
lease for keys another lookup found), or ``LeaseBook.grant_now`` (digests and sizes a lookup has read
already). Each answers None when only the async path can (hand the request over then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import SQLAlchemyError

from gateway.cluster.db import ClusterDB
from gateway.leases.local import (
    REFUSED_OFF,
    REFUSED_UNREACHABLE,
    LeaseGrant,
    LocalLeases,
    SyncResult,
    Wait,
)
from gateway.leases.table import LeaseTable, quiet_window

log = logging.getLogger("kvgw.leases")
T = TypeVar("T")

MAX_LEASE_MS = 600_000  # the most a request may ask for, and a bucket's max_lease_ms may be
CLAIM_SECONDS = 120.0  # a claim a crashed lifecycle left behind lapses after this
REMOVED_MEMORY_SECONDS = 60.0  # how long a removal is remembered for lookups that raced it
TRIM_SECONDS = 30.0  # how often expired rows are deleted
SYNC_SECONDS = 0.5  # a process syncs at least this often by default (and at once when it must)
FRESHNESS = 4  # it grants only within this many sync intervals of its last successful sync
PEEK_SECONDS = 0.05  # SQLite: how often the database is checked for new claims (no NOTIFY there)
ACK_SECONDS = 2.0  # how long a claim waits for the processes' acknowledgements
SILENT_SECONDS = 1.5  # a process that has not synced for this long is not waited for within a claim
WAIT_SECONDS = 2.0  # how long a lookup waits for a sync before it is answered without a lease


class LeaseUnavailable(Exception):
    """The lease table could not be read or written, or a claim could not be acknowledged in time."""


@dataclass(slots=True)
class LeaseStats:
    granted: int = 0
    refused_cap: int = 0
    refused_unavailable: int = 0
    raced_removal: int = 0
    skipped_by_lifecycle: int = 0
    released_by_load: int = 0
    waited: int = 0  # lookups that took the async path (a sync first)
    syncs: int = 0
    sync_failures: int = 0
    claims: int = 0  # claim batches acknowledged
    claims_contested: int = 0  # claims a grant written meanwhile overrode
    claim_timeouts: int = 0
    claim_wait_ms_max: float = 0.0


class LeaseBook:
    """Grant read leases to lookups; claim chunks for the lifecycle. See the module docstring."""

    def __init__(self, db: ClusterDB, member: str, *, sync_seconds: float = SYNC_SECONDS,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``member``: this process's name in ``lease_members`` (the cluster's member id);
        ``sync_seconds``: how often the syncer writes at least (it grants within ``FRESHNESS`` times
        that of its last sync). ``clock`` dates leases (unix seconds; tests inject one); ``monotonic``
        times syncs."""
        if sync_seconds <= 0:
            raise ValueError("lease_sync_seconds must be positive")
        self._db = db
        self.sync_seconds = sync_seconds
        # Lease rows need no durability (a lease lost in a crash merely ends early), so their commits
        # do not wait for the disk: on SQLite an engine of their own with synchronous=NORMAL (WAL: no
        # fsync per commit), on PostgreSQL synchronous_commit off per transaction.
        engine = db.engine if db.postgres else _relaxed_sqlite_engine(db.engine.url)
        self._table = LeaseTable(engine, member=member, channel=lease_channel(db.channel))
        self.local = LocalLeases(clock=clock, monotonic=monotonic, fresh_seconds=FRESHNESS * sync_seconds)
        self._clock = clock
        self._monotonic = monotonic
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgw-leases")
        self._wake: asyncio.Event | None = None
        self._waiters: list[asyncio.Future[SyncResult]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._outage = False
        self.stats = LeaseStats()

    @property
    def engine(self) -> Engine:
        return self._table.engine

    @engine.setter
    def engine(self, engine: Engine) -> None:
        self._table.engine = engine

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._table.engine is not self._db.engine:
            self._table.engine.dispose()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- lookups -------------------------------------------------------------------------------

    def grant_now(self, bucket: str, digests: Sequence[bytes], sizes: Sequence[int], lease_ms: int, *,
                  max_lease_ms: int, cap_bytes: int | None) -> LeaseGrant | None:
        """Lease ``digests`` (the chunks a lookup found, of ``sizes`` bytes; 0 for unknown) for
        ``min(lease_ms, max_lease_ms)`` without waiting, or None when only ``grant`` can answer (see the
        module docstring). All or nothing against the cap. Event loop thread; never blocks, never raises."""
        granted_ms = min(lease_ms, max_lease_ms)
        if granted_ms <= 0:
            return LeaseGrant(refused=REFUSED_OFF)
        if not digests:
            return LeaseGrant(granted_ms=granted_ms)
        out = self.local.grant(bucket, digests, sizes, granted_ms, cap_bytes, recheck=False)
        if isinstance(out, Wait):
            return None
        return self._counted(out)

    async def grant(self, bucket: str, digests: Sequence[bytes], sizes: Sequence[int], lease_ms: int, *,
                    max_lease_ms: int, cap_bytes: int | None) -> LeaseGrant:
        """``grant_now``, or what it waits for first (one sync asking for it); chunks removed a moment
        ago are leased too, for the caller to re-check (``LeaseGrant.recheck``). Never raises: an
        unreachable database refuses."""
        granted_ms = min(lease_ms, max_lease_ms)
        if granted_ms <= 0:
            return LeaseGrant(refused=REFUSED_OFF)
        if not digests:
            return LeaseGrant(granted_ms=granted_ms)
        self.stats.waited += 1
        for _ in range(3):  # each sync settles one reason to wait (a first sync, the horizon, a share)
            out = self.local.grant(bucket, digests, sizes, granted_ms, cap_bytes, recheck=True)
            if not isinstance(out, Wait):
                return self._counted(out)
            self.local.want(out)
            try:
                await asyncio.wait_for(self.sync(), WAIT_SECONDS)
            except (LeaseUnavailable, TimeoutError) as exc:
                log.warning("read lease refused: the lease table did not answer in time: %s", exc)
                return self._counted(LeaseGrant(refused=REFUSED_UNREACHABLE))
        out = self.local.grant(bucket, digests, sizes, granted_ms, cap_bytes, recheck=True)
        return self._counted(self.local.wait_refusal(out) if isinstance(out, Wait) else out)

    def _counted(self, grant: LeaseGrant) -> LeaseGrant:
        stats = self.stats
        if grant.granted_ms:
            stats.granted += grant.leased
            if grant.gone or grant.recheck:
                stats.raced_removal += len(grant.gone) + len(grant.recheck)
        elif grant.refused == REFUSED_UNREACHABLE:
            stats.refused_unavailable += 1
        elif grant.refused is not None and grant.refused != REFUSED_OFF:
            stats.refused_cap += 1
        return grant

    def leased_here(self, digest: bytes, now: float) -> bool:
        """Whether this process granted a read lease on ``digest`` that runs past ``now`` and no load
        ended yet: a chunk whose TTL passed meanwhile is still served to that load (TTL reclaim left it,
        see the lifecycle). Loads through another gateway see the TTL only."""
        return self.local.leased_here(digest, now)

    def loaded(self, bucket: str, chunks: Sequence[tuple[bytes, int]]) -> None:
        """Chunks (digest, size) of ``bucket`` were read through this process: a lease it granted on them
        ends (written by the next sync). Event loop; a dict lookup per digest while leases are held."""
        self.local.loaded(bucket, chunks)

    async def leased_bytes(self, bucket: str) -> int:
        """Bytes under unexpired read leases in ``bucket``, after a sync (admin stats, tests)."""
        await self.sync()
        return await self._run(self._table.leased_bytes, bucket, self._clock())

    async def release_loaded(self) -> int:
        """Write the ends of the leases loads ended (a sync now); how many it ended."""
        result = await self.sync()
        return len(result.released)

    # -- the syncer ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start syncing (the first sync in the background: a catalog that does not answer yet delays
        leases, not the start) and, on PostgreSQL, listening for claims."""
        self._wake = asyncio.Event()
        self._wake.set()  # the first sync at once
        self._tasks.append(asyncio.create_task(self._syncer(), name="kvgw-lease-syncer"))
        if self._db.postgres:
            self._tasks.append(asyncio.create_task(self._db.listen(
                self._table.channel, lambda _: self._poke(), lambda up: self._poke() if up else None,
                what=f"read leases (syncing every {self.sync_seconds:g} s until it is back)"),
                name="kvgw-lease-listen"))

    async def stop(self) -> None:
        """Write what is granted and leave ``lease_members`` (best effort: a process that cannot is
        waited for until its ``quiet_at``, as a killed one)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        try:
            await self._sync_once()
            await self._run(self._table.leave)
        except (SQLAlchemyError, LeaseUnavailable) as exc:
            log.warning("read leases: could not write the last grants before stopping (%s); the lifecycle "
                        "waits for them to end", exc)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def sync(self) -> SyncResult:
        """Wait for a sync taken after this call; its result. Raises ``LeaseUnavailable`` if it failed
        (or there is no syncer: not started)."""
        if self._wake is None:
            raise LeaseUnavailable("the lease syncer is not running")
        future: asyncio.Future[SyncResult] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self._wake.set()
        return await future

    async def _syncer(self) -> None:
        assert self._wake is not None
        wake = self._wake
        postgres = self._db.postgres
        trimmed = last = self._monotonic()
        backoff = 0.05
        peeked: object = None  # SQLite: the database's change mark when lease_head was last read
        while True:
            due = last + self.sync_seconds
            while not wake.is_set() and self._monotonic() < due:
                timeout = max(0.0, due - self._monotonic())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout if postgres else min(timeout, PEEK_SECONDS)):
                        await wake.wait()  # awaited in this task: wait_for made a task per wait
                if not postgres and not wake.is_set() and self.local.known() >= 0:
                    # SQLite: a claim shows as a new head, read only when something was committed since
                    # the last read (an idle gateway read it 20 times a second: 2% of a core)
                    mark = self._db.change_mark()
                    if mark is not None and mark == peeked:
                        continue
                    with contextlib.suppress(SQLAlchemyError):
                        head = await self._run(self._table.peek_head)
                        peeked = mark
                        if head > self.local.known():
                            break
            wake.clear()
            last = self._monotonic()
            try:
                learnt = await self._sync_once()
            except (SQLAlchemyError, LeaseUnavailable):
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            if learnt:
                wake.set()  # acknowledge the claims just learnt at once
            if self._monotonic() - trimmed >= TRIM_SECONDS:
                trimmed = self._monotonic()
                with contextlib.suppress(SQLAlchemyError):
                    await self._run(self._table.trim, self._clock())

    async def _sync_once(self) -> bool:
        """One sync (see ``gateway.leases.local``); whether it learnt of new claims."""
        waiters, self._waiters = self._waiters, []
        batch = self.local.take()
        try:
            result = await self._run(self._table.sync, batch, quiet_window(self.local.fresh_seconds, batch.horizon_ms))
        except SQLAlchemyError as exc:
            self.local.requeue(batch)
            self.stats.sync_failures += 1
            if not self._outage:
                log.warning("read leases: the lease table does not answer (%s); granting goes on for %.1f s "
                            "after the last sync, then lookups are answered without leases", exc,
                            self.local.fresh_seconds)
                self._outage = True
            unavailable = LeaseUnavailable(str(exc))
            for future in waiters:
                if not future.done():
                    future.set_exception(unavailable)
            raise unavailable from exc
        except BaseException:
            self.local.requeue(batch)
            self._waiters[:0] = waiters
            raise
        if self._outage:
            log.warning("read leases: the lease table answers again")
            self._outage = False
        learnt = self.local.apply(batch, result)
        self.stats.syncs += 1
        self.stats.released_by_load += len(result.released | batch.cancelled)
        result.released |= batch.cancelled
        for future in waiters:
            if not future.done():
                future.set_result(result)
        return learnt

    # -- the lifecycle -------------------------------------------------------------------------

    async def claim(self, bucket: str, digests: Sequence[bytes]) -> set[bytes]:
        """Claim ``digests`` for removal; returns those the caller may remove now (the others hold a
        read lease: leave them). Raises ``LeaseUnavailable`` if the database cannot answer or the
        granting processes cannot all acknowledge the claim in time (remove nothing then)."""
        if not digests:
            return set()
        now = self._clock()
        try:
            seq, claimed = await self._run(self._table.claim, bucket, list(digests), now, now + CLAIM_SECONDS)
        except SQLAlchemyError as exc:
            raise LeaseUnavailable(str(exc)) from exc
        if claimed:
            started = self._monotonic()
            self._poke()  # this process acknowledges too
            try:
                await self._acknowledged(seq)
                confirmed = await self._run(self._table.confirm, sorted(claimed))
            except (SQLAlchemyError, LeaseUnavailable) as exc:
                self.stats.claim_timeouts += 1
                await self.settle(kept=sorted(claimed))
                raise exc if isinstance(exc, LeaseUnavailable) else LeaseUnavailable(str(exc)) from exc
            self.stats.claims += 1
            self.stats.claim_wait_ms_max = max(self.stats.claim_wait_ms_max, 1000 * (self._monotonic() - started))
            contested = claimed - confirmed
            if contested:
                self.stats.claims_contested += len(contested)
                await self.settle(kept=sorted(contested))
            claimed = confirmed
        self.stats.skipped_by_lifecycle += len(digests) - len(claimed)
        return claimed

    async def _acknowledged(self, seq: int) -> None:
        """Wait until every live granting process has synced with ``seen >= seq`` (module docstring)."""
        deadline = self._monotonic() + ACK_SECONDS
        delay = 0.001
        while True:
            lagging = await self._run(self._table.lagging, seq)
            if not lagging:
                return
            silent = all(since > SILENT_SECONDS for _, _, since, _ in lagging)
            if silent or self._monotonic() >= deadline:
                quiet = max(quiet_in for _, _, _, quiet_in in lagging)
                names = ", ".join(member for member, _, _, _ in lagging[:3])
                raise LeaseUnavailable(
                    f"{len(lagging)} lease-granting process(es) ({names}) have not acknowledged the claim; "
                    f"{'silent: ' if silent else ''}their unwritten leases end within {quiet:.1f} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    async def settle(self, *, removed: Sequence[bytes] = (), kept: Sequence[bytes] = ()) -> None:
        """End claims: ``removed`` lost their last copy (remembered for racing lookups), ``kept`` did not
        (a failed removal, or a demotion: the chunk is still readable). Best effort: a claim left behind
        lapses after ``CLAIM_SECONDS``."""
        if not removed and not kept:
            return
        now = self._clock()
        try:
            await self._run(self._table.settle, list(removed), list(kept), now, now + REMOVED_MEMORY_SECONDS)
        except SQLAlchemyError as exc:
            log.warning("could not settle %d lifecycle claims (they lapse by themselves): %s",
                        len(removed) + len(kept), exc)

    async def trim(self) -> int:
        """Delete the rows past their end (expired leases, lapsed claims, old removals, the old log)."""
        return await self._run(self._table.trim, self._clock())

    def report(self) -> dict[str, Any]:
        """The ``leases`` section of ``/v1/admin/stats``."""
        return {**asdict(self.stats), **self.local.report()}


def lease_channel(feed_channel: str) -> str:
    """The NOTIFY channel of claims, beside the feed's (a lower-case identifier of at most 63 bytes)."""
    return f"{feed_channel[:56]}_leases"


def _relaxed_sqlite_engine(url: URL) -> Engine:
    engine = create_engine(url, pool_pre_ping=True)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=5000")
        cur.close()

    return engine
