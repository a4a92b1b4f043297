"""Read leases between a lookup and the load that follows.

Engines look a prefix up, then load it; a chunk evicted in between turns a hit into a failed load (for
LMCache a dead engine). A lookup may therefore ask for a lease (``lease_ms``): the chunks it found are
leased, and the lifecycle (capacity eviction, demotion, TTL reclaim) leaves leased chunks alone until
the lease ends or the chunk is loaded through the gateway that leased it.

The leases live in the catalog database (table ``chunk_leases``, revision 0006), one row per chunk,
so a lease taken through one gateway holds against a lifecycle leader on another, and every worker
process of a host sees the same leases. A row is in one of three states:

- ``READ``: leased by lookups until ``expires_at`` (several lookups extend one row, the latest end wins);
- ``REMOVING``: the lifecycle claimed the chunk and is removing a copy of it;
- ``REMOVED``: the lifecycle removed the chunk's last copy lately (kept ``REMOVED_MEMORY_SECONDS``).

Mutual exclusion comes from the row: the lifecycle's claim turns a row into ``REMOVING`` only where no
unexpired ``READ`` lease holds it, and a lookup's grant turns a row into ``READ`` only where no removal
is under way. A lookup that found the chunk just before the lifecycle removed it finds a ``REMOVED``
row: it takes the lease and the caller re-checks that the chunk still exists (``LeaseGrant.recheck``;
it may have been written again); a chunk being removed is answered as absent (``LeaseGrant.gone``).

Leases cannot starve eviction: a lease lasts at most the bucket's ``max_lease_ms``, and the bytes leased
at once in a bucket are capped (``BucketPolicy.leased_bytes_cap``): past the cap a lookup is answered
without a lease and says why. A load ends a lease only through the gateway process that granted it
(it remembers what it leased; elsewhere the lease simply runs out).

Costs: a lookup without ``lease_ms`` pays nothing; with one, one database transaction. The lifecycle
pays one statement per victim batch to claim and one to settle. Calls run in the cluster's database
threads (``ClusterDB.run``); an unreachable database refuses the lease (the lookup still answers, and
says so) and makes the lifecycle skip its pass's removals (``LeaseUnavailable``), never the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, create_engine, delete, event, func, select, update
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from backends.catalog.models import ChunkLease
from gateway.cluster.db import ClusterDB

log = logging.getLogger("kvgw.leases")

LEASES: Table = ChunkLease.__table__  # type: ignore[assignment]

READ, REMOVING, REMOVED = 0, 1, 2
MAX_LEASE_MS = 600_000  # the most a request may ask for, and a bucket's max_lease_ms may be
CLAIM_SECONDS = 120.0  # a claim a crashed lifecycle left behind lapses after this
REMOVED_MEMORY_SECONDS = 60.0  # how long a removal is remembered for lookups that raced it
TRIM_SECONDS = 30.0  # how often expired rows are deleted
RELEASE_SECONDS = 0.5  # how soon a load through this process ends its lease
LOADED_REMEMBERED = 100_000  # digests this process leased lately, for "a load ends the lease"


class LeaseUnavailable(Exception):
    """The lease table could not be read or written (the catalog database is unreachable)."""


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The answer to a lease request, for the caller to apply to its lookup's answer.

    ``gone``: found by the lookup but being removed now: answer them as absent. ``recheck``: removed a
    moment ago and leased now: answer them as present only if a tier still holds them. ``refused``: why
    no lease was taken (the lookup answers without one); None when ``granted_ms`` > 0 or none was asked.
    """

    granted_ms: int = 0
    leased: int = 0
    leased_bytes: int = 0
    gone: frozenset[bytes] = frozenset()
    recheck: frozenset[bytes] = frozenset()
    refused: str | None = None

    def doc(self) -> dict[str, Any]:
        """The ``lease`` member of a lookup's JSON answer."""
        out: dict[str, Any] = {"granted_ms": self.granted_ms, "chunks": self.leased, "bytes": self.leased_bytes}
        if self.refused is not None:
            out["refused"] = self.refused
        return out


@dataclass(slots=True)
class LeaseStats:
    granted: int = 0
    refused_cap: int = 0
    refused_unavailable: int = 0
    raced_removal: int = 0
    skipped_by_lifecycle: int = 0
    released_by_load: int = 0


class LeaseBook:
    """Grant read leases to lookups; claim chunks for the lifecycle. See the module docstring."""

    def __init__(self, db: ClusterDB, *, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        # Lease rows need no durability (a lease lost in a crash merely ends early), so their commits
        # do not wait for the disk: on SQLite an engine of their own with synchronous=NORMAL (WAL: no
        # fsync per commit), on PostgreSQL synchronous_commit off per transaction (see _begin).
        self.engine = db.engine if db.postgres else _relaxed_sqlite_engine(db.engine.url)
        self._statements = _Statements(db)
        self._clock = clock
        self._mine: OrderedDict[bytes, float] = OrderedDict()  # leased through this process -> until
        self._loaded: set[bytes] = set()  # of those, loaded since: released by the next trim
        self.stats = LeaseStats()

    def close(self) -> None:
        if self.engine is not self._db.engine:
            self.engine.dispose()

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Connection]:
        """A transaction on SQLite; on PostgreSQL autocommit, each statement its own transaction (the
        grant and the claim are one statement each: one round trip, see ``_Statements``)."""
        if self._db.postgres:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    # -- lookups -------------------------------------------------------------------------------

    async def grant(self, bucket: str, chunks: Sequence[tuple[bytes, int]], lease_ms: int, *,
                    max_lease_ms: int, cap_bytes: int | None) -> LeaseGrant:
        """Lease ``chunks`` ((digest, size) the lookup found) for ``min(lease_ms, max_lease_ms)``.

        All or nothing against the cap: a lookup whose chunks would take the bucket's leased bytes past
        ``cap_bytes`` gets no lease (``refused``). Never raises: an unreachable database refuses."""
        granted_ms = min(lease_ms, max_lease_ms)
        if granted_ms <= 0:
            return LeaseGrant(refused="leases are off for this bucket (max_lease_ms = 0)")
        if not chunks:
            return LeaseGrant(granted_ms=granted_ms)
        now = self._clock()
        until = now + granted_ms / 1000
        try:
            grant = await self._db.run(self._grant, bucket, dict(chunks), now, until, granted_ms, cap_bytes)
        except SQLAlchemyError as exc:
            self.stats.refused_unavailable += 1
            log.warning("read lease refused: the catalog database did not answer: %s", exc)
            return LeaseGrant(refused="the lease table is unreachable; answered without a lease")
        if grant.granted_ms:
            self.stats.granted += grant.leased
            self._remember(chunks, until)
        else:
            self.stats.refused_cap += 1
        self.stats.raced_removal += len(grant.gone) + len(grant.recheck)
        return grant

    def _grant(self, bucket: str, sizes: dict[bytes, int], now: float, until: float, granted_ms: int,
               cap_bytes: int | None) -> LeaseGrant:
        digests = list(sizes)
        with self._begin() as conn:
            held, taken = self._statements.grant(conn, bucket, sizes, now, until, cap_bytes)
            if taken is None:
                return LeaseGrant(refused=f"the bucket's leased bytes would pass its cap ({held} leased, "
                                          f"{sum(sizes.values())} asked, cap {cap_bytes}); answered without a lease")
            rest = [d for d in digests if d not in taken]
            rechecked: set[bytes] = set()
            if rest:  # removed lately: take the lease, and the caller checks the chunk is there again
                rechecked = set(conn.execute(
                    update(LEASES).where(LEASES.c.digest.in_(rest), LEASES.c.kind == REMOVED)
                    .values(kind=READ, bucket=bucket, expires_at=until).returning(LEASES.c.digest)).scalars())
                for d in rechecked:
                    conn.execute(update(LEASES).where(LEASES.c.digest == d).values(bytes=sizes[d]))
        gone = frozenset(d for d in rest if d not in rechecked)
        leased = [d for d in digests if d not in gone]
        return LeaseGrant(granted_ms=granted_ms, leased=len(leased), leased_bytes=sum(sizes[d] for d in leased),
                          gone=gone, recheck=frozenset(rechecked))

    def _remember(self, chunks: Iterable[tuple[bytes, int]], until: float) -> None:
        for digest, _ in chunks:
            self._mine[digest] = until
            self._mine.move_to_end(digest)
        while len(self._mine) > LOADED_REMEMBERED:
            self._mine.popitem(last=False)

    def leased_here(self, digest: bytes, now: float) -> bool:
        """Whether this process granted a read lease on ``digest`` that runs past ``now`` and no load
        ended yet: a chunk whose TTL passed meanwhile is still served to that load (TTL reclaim left it,
        see the lifecycle). Loads through another gateway see the TTL only."""
        return self._mine.get(digest, 0.0) > now

    def loaded(self, digests: Iterable[bytes]) -> None:
        """Chunks were read through this process: a lease it granted on them ends (within
        ``RELEASE_SECONDS``). Event loop only; costs a dict lookup per digest while leases exist."""
        mine = self._mine
        if not mine:
            return
        for digest in digests:
            if mine.pop(digest, None) is not None:
                self._loaded.add(digest)

    async def leased_bytes(self, bucket: str) -> int:
        """Bytes under unexpired read leases in ``bucket`` (admin stats, tests)."""
        return await self._db.run(self._leased_bytes_now, bucket)

    def _leased_bytes_now(self, bucket: str) -> int:
        with self.engine.connect() as conn:
            return self._statements.leased_bytes(conn, bucket, self._clock(), [])

    # -- the lifecycle -------------------------------------------------------------------------

    async def claim(self, bucket: str, digests: Sequence[bytes]) -> set[bytes]:
        """Claim ``digests`` for removal; returns those claimed (the others hold an unexpired read lease:
        leave them). Raises ``LeaseUnavailable`` if the database cannot answer (remove nothing then)."""
        if not digests:
            return set()
        try:
            claimed: set[bytes] = await self._db.run(self._claim, bucket, list(digests), self._clock())
        except SQLAlchemyError as exc:
            raise LeaseUnavailable(str(exc)) from exc
        self.stats.skipped_by_lifecycle += len(digests) - len(claimed)
        return claimed

    def _claim(self, bucket: str, digests: list[bytes], now: float) -> set[bytes]:
        with self._begin() as conn:
            return self._statements.claim(conn, bucket, digests, now, now + CLAIM_SECONDS)

    async def settle(self, *, removed: Sequence[bytes] = (), kept: Sequence[bytes] = ()) -> None:
        """End claims: ``removed`` lost their last copy (remembered for racing lookups), ``kept`` did not
        (a failed removal, or a demotion: the chunk is still readable). Best effort: a claim left behind
        lapses after ``CLAIM_SECONDS``."""
        if not removed and not kept:
            return
        try:
            await self._db.run(self._settle, list(removed), list(kept), self._clock())
        except SQLAlchemyError as exc:
            log.warning("could not settle %d lifecycle claims (they lapse by themselves): %s",
                        len(removed) + len(kept), exc)

    def _settle(self, removed: list[bytes], kept: list[bytes], now: float) -> None:
        with self._begin() as conn:
            if removed:
                conn.execute(update(LEASES).where(LEASES.c.digest.in_(removed), LEASES.c.kind == REMOVING)
                             .values(kind=REMOVED, expires_at=now + REMOVED_MEMORY_SECONDS))
            if kept:
                conn.execute(delete(LEASES).where(LEASES.c.digest.in_(kept), LEASES.c.kind == REMOVING))

    # -- housekeeping --------------------------------------------------------------------------

    async def run(self) -> None:
        """Every ``RELEASE_SECONDS`` end the leases loads ended; every ``TRIM_SECONDS`` delete rows past
        their end. Database errors wait for the next round."""
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(RELEASE_SECONDS)
            with contextlib.suppress(SQLAlchemyError):
                if self._loaded:
                    await self.release_loaded()
                if time.monotonic() - trimmed >= TRIM_SECONDS:
                    trimmed = time.monotonic()
                    await self.trim()

    async def release_loaded(self) -> int:
        """End the read leases of the chunks loaded through this process since the last call."""
        loaded, self._loaded = list(self._loaded), set()
        try:
            released: int = await self._db.run(self._release, loaded)
        except SQLAlchemyError:
            self._loaded.update(loaded)
            raise
        self.stats.released_by_load += released
        return released

    def _release(self, loaded: list[bytes]) -> int:
        released = 0
        with self._begin() as conn:
            for start in range(0, len(loaded), 1000):
                released += conn.execute(delete(LEASES).where(
                    LEASES.c.digest.in_(loaded[start:start + 1000]), LEASES.c.kind == READ)).rowcount
        return released

    async def trim(self) -> int:
        """Delete the rows past their end (expired leases, lapsed claims, old removals)."""
        return await self._db.run(self._trim, self._clock())

    def _trim(self, now: float) -> int:
        with self._begin() as conn:
            return int(conn.execute(delete(LEASES).where(LEASES.c.expires_at <= now)).rowcount)


class _Statements:
    """The two upserts, each one statement for any number of chunks: on PostgreSQL a text statement over
    arrays (``unnest``), on SQLite SQLAlchemy's "insertmanyvalues" over a list of rows (the driver's
    ``?`` parameters need no parsing). A statement built with the rows in it is compiled anew on every
    call: 6 ms of CPU for 64 keys. Rows whose lease already lapsed are deleted first
    (``delete_lapsed``), so the conflict conditions need no clock. The other statements likewise take
    their digests as one array on PostgreSQL."""

    def __init__(self, db: ClusterDB) -> None:
        self._postgres = db.postgres
        read = db.upsert(LEASES)
        # a lookup's lease: extends a read lease (the latest end wins), never takes a chunk being removed
        self._grant = read.on_conflict_do_update(
            index_elements=[LEASES.c.digest],
            set_={"bucket": read.excluded.bucket, "bytes": read.excluded.bytes,
                  "expires_at": func.max(LEASES.c.expires_at, read.excluded.expires_at)},
            where=LEASES.c.kind == READ,
        ).returning(LEASES.c.digest)
        claim = db.upsert(LEASES)
        # the lifecycle's claim: takes any row but a read lease that runs
        self._claim = claim.on_conflict_do_update(
            index_elements=[LEASES.c.digest],
            set_={"kind": REMOVING, "bytes": 0, "expires_at": claim.excluded.expires_at},
            where=LEASES.c.kind != READ,
        ).returning(LEASES.c.digest)

    def delete_lapsed(self, conn: Connection, digests: list[bytes], now: float) -> None:
        """Delete the rows of ``digests`` past their end (a lapsed lease or claim holds nothing)."""
        if self._postgres:
            conn.exec_driver_sql(_DELETE_LAPSED_POSTGRES, {"digest": digests, "now": now})
        else:
            conn.execute(delete(LEASES).where(LEASES.c.digest.in_(digests), LEASES.c.expires_at <= now))

    def leased_bytes(self, conn: Connection, bucket: str, now: float, exclude: list[bytes]) -> int:
        """Bytes under unexpired read leases in ``bucket``, but those of ``exclude``."""
        if self._postgres:
            params = {"bucket": bucket, "now": now, "digest": exclude}
            return int(conn.exec_driver_sql(_LEASED_BYTES_POSTGRES, params).scalar_one())
        query = select(func.coalesce(func.sum(LEASES.c.bytes), 0)).where(
            LEASES.c.bucket == bucket, LEASES.c.kind == READ, LEASES.c.expires_at > now,
            LEASES.c.digest.not_in(exclude))
        return int(conn.execute(query).scalar_one())

    def grant(self, conn: Connection, bucket: str, sizes: dict[bytes, int], now: float, until: float,
              cap_bytes: int | None) -> tuple[int, set[bytes] | None]:
        """Upsert read leases unless they would take the bucket past ``cap_bytes``: the bytes leased
        before, and the digests leased (None: refused by the cap; the others: being removed, or lately).
        On PostgreSQL one statement, its own transaction; on SQLite in the caller's transaction."""
        digests = list(sizes)
        if self._postgres:
            params = {"bucket": bucket, "now": now, "until": until, "digest": digests, "bytes": list(sizes.values()),
                      "wanted": sum(sizes.values()), "cap": cap_bytes}
            held, taken, admitted, _ = conn.exec_driver_sql(_GRANT_POSTGRES, params).one()
            return int(held), set(map(bytes, taken)) if admitted else None
        held = self.leased_bytes(conn, bucket, now, digests) if cap_bytes is not None else 0
        if cap_bytes is not None and held + sum(sizes.values()) > cap_bytes:
            return held, None
        self.delete_lapsed(conn, digests, now)
        rows = [{"digest": d, "bucket": bucket, "kind": READ, "bytes": b, "expires_at": until}
                for d, b in sizes.items()]
        return held, set(conn.execute(self._grant, rows).scalars())

    def claim(self, conn: Connection, bucket: str, digests: list[bytes], now: float, until: float) -> set[bytes]:
        """Upsert removal claims; the digests claimed (the others hold a read lease that runs)."""
        if self._postgres:
            params = {"bucket": bucket, "now": now, "until": until, "digest": digests}
            return set(map(bytes, conn.exec_driver_sql(_CLAIM_POSTGRES, params).scalars()))
        self.delete_lapsed(conn, digests, now)
        rows = [{"digest": d, "bucket": bucket, "kind": REMOVING, "bytes": 0, "expires_at": until} for d in digests]
        return set(conn.execute(self._claim, rows).scalars())


_DELETE_LAPSED_POSTGRES = "DELETE FROM chunk_leases WHERE digest = ANY(%(digest)s::bytea[]) AND expires_at <= %(now)s"

_LEASED_BYTES_POSTGRES = f"""
SELECT coalesce(sum(bytes), 0) FROM chunk_leases
WHERE bucket = %(bucket)s AND kind = {READ} AND expires_at > %(now)s AND NOT digest = ANY(%(digest)s::bytea[])
"""

# One statement each, so one round trip in autocommit mode: the lapsed rows are taken over in the
# conflict clause, the cap is checked in the same snapshot, and commits do not wait for the disk.
_GRANT_POSTGRES = f"""
WITH held AS (
    SELECT coalesce(sum(bytes), 0) AS bytes FROM chunk_leases
    WHERE bucket = %(bucket)s AND kind = {READ} AND expires_at > %(now)s AND NOT digest = ANY(%(digest)s::bytea[])
), admitted AS (
    SELECT %(cap)s::int8 IS NULL OR held.bytes + %(wanted)s <= %(cap)s::int8 AS ok FROM held
), leased AS (
    INSERT INTO chunk_leases (digest, bucket, kind, bytes, expires_at)
    SELECT r.digest, %(bucket)s, {READ}, r.bytes, %(until)s
    FROM admitted, unnest(%(digest)s::bytea[], %(bytes)s::int8[]) AS r(digest, bytes)
    WHERE admitted.ok
    ON CONFLICT (digest) DO UPDATE
        SET kind = {READ}, bucket = excluded.bucket, bytes = excluded.bytes,
            expires_at = CASE WHEN chunk_leases.expires_at <= %(now)s THEN excluded.expires_at
                              ELSE greatest(chunk_leases.expires_at, excluded.expires_at) END
        WHERE chunk_leases.kind = {READ} OR chunk_leases.expires_at <= %(now)s
    RETURNING digest
)
SELECT held.bytes, array(SELECT digest FROM leased), admitted.ok, set_config('synchronous_commit', 'off', true)
FROM held, admitted
"""

_CLAIM_POSTGRES = f"""
WITH claimed AS (
    INSERT INTO chunk_leases (digest, bucket, kind, bytes, expires_at)
    SELECT r.digest, %(bucket)s, {REMOVING}, 0, %(until)s FROM unnest(%(digest)s::bytea[]) AS r(digest)
    ON CONFLICT (digest) DO UPDATE SET kind = {REMOVING}, bytes = 0, expires_at = excluded.expires_at
        WHERE chunk_leases.kind <> {READ} OR chunk_leases.expires_at <= %(now)s
    RETURNING digest
)
SELECT digest FROM claimed, (SELECT set_config('synchronous_commit', 'off', true)) AS relaxed
"""


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
