"""The lifecycle leader: one gateway process at a time runs eviction and TTL reclaim for the whole tier.

Leadership is a lease row in the catalog (``cluster_leases``, name ``lifecycle``: holder, epoch,
expires_at), taken and renewed by one conditional statement that SQLite and PostgreSQL both run
atomically, so the same code serves the embedded default (one gateway, SQLite: it takes the lease at
start, the only member) and a cluster on PostgreSQL. No consensus of our own: the database's row lock
decides.

- take: ``INSERT ... ON CONFLICT (name) DO NOTHING`` (epoch 1) when no row exists;
- renew or take over: one ``UPDATE ... WHERE name = :name AND (expires_at <= now OR (holder = :me AND
  epoch = :epoch))`` that sets ``holder = :me``, ``expires_at = now + lease`` and keeps the epoch for a
  renewal in time, else adds one. On PostgreSQL two challengers of an expired row serialise on the row
  lock and the second re-evaluates the condition on the first one's new version (no longer expired),
  so exactly one wins; SQLite runs one writer at a time. A row lease rather than an advisory lock: it
  works on SQLite too, its holder and epoch are visible to ``kvgw cluster status``, and it needs no
  session held open (an advisory lock dies with its connection, and a pooled connection can outlive or
  be lost independently of the process that thinks it holds the lock).
- release (clean stop): ``expires_at = now``, so another takes over at its next attempt.

Time. ``expires_at`` is written and compared with the database's own clock (``statement_timestamp()``
on PostgreSQL, ``julianday('now')`` on SQLite), never a host's, so clocks that disagree between hosts
cannot let two holders overlap. The holder measures its own term with its monotonic clock from the
moment it *sent* the renewal: the database set the expiry at least ``lease_seconds`` after that, so
``valid_for()`` runs out before anyone else can take the row. Every process attempts every
``lease_seconds / 3``: the holder renews, the others take over once the row expired; a holder killed
without a word is replaced within ``lease_seconds`` + one attempt interval (default 5 s + 1.7 s).

Fencing. Before each destructive batch the lifecycle engine asks ``valid_for()`` and acts only with
at least ``fence_margin`` seconds of term left (``gateway.lifecycle.engine``); a holder whose renewals
fail (the database unreachable, the process paused) therefore stops acting before the lease can
expire, and a new epoch is visible to everyone.

Tests inject both clocks: ``clock`` (the holder's monotonic clock) and ``wall`` (the database's clock,
otherwise read in SQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

log = logging.getLogger("kvgw.cluster")

LIFECYCLE_LEASE = "lifecycle"

_NOW_SQL = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    holder: str
    epoch: int
    expires_at: float  # the database's clock (unix seconds)


class LeaseStore:
    """Named leases in ``cluster_leases`` (see the module docstring). Blocking calls."""

    def __init__(self, engine: Engine, *, wall: Callable[[], float] | None = None) -> None:
        """``wall``: a clock to use instead of the database's (tests)."""
        self._engine = engine
        self._wall = wall
        if wall is not None:
            now, until = "CAST(:now AS DOUBLE PRECISION)", "CAST(:until AS DOUBLE PRECISION)"
        else:
            dialect = engine.dialect.name
            if dialect not in _NOW_SQL:
                raise ValueError(f"leases need SQLite or PostgreSQL, not {dialect}")
            now = _NOW_SQL[dialect]
            until = f"({now} + CAST(:seconds AS DOUBLE PRECISION))"
        self._insert = text(
            "INSERT INTO cluster_leases (name, holder, epoch, expires_at) "
            f"VALUES (:name, :holder, 1, {until}) ON CONFLICT (name) DO NOTHING")
        self._update = text(
            "UPDATE cluster_leases SET "
            f"epoch = CASE WHEN holder = :holder AND epoch = :epoch AND expires_at > {now} "
            "THEN epoch ELSE epoch + 1 END, "
            f"holder = :holder, expires_at = {until} "
            f"WHERE name = :name AND (expires_at <= {now} OR (holder = :holder AND epoch = :epoch))")
        self._release = text(
            f"UPDATE cluster_leases SET expires_at = {now} "
            "WHERE name = :name AND holder = :holder AND epoch = :epoch")
        self._read = text(f"SELECT holder, epoch, expires_at, {now} AS now FROM cluster_leases WHERE name = :name")

    def _params(self, seconds: float = 0.0, **values: Any) -> dict[str, Any]:
        if self._wall is not None:
            now = self._wall()
            values.update(now=now, until=now + seconds)
        else:
            values["seconds"] = seconds
        return values

    def acquire(self, name: str, holder: str, epoch: int | None, seconds: float) -> Lease | None:
        """Take, renew (``epoch``: the term ``holder`` believes it holds) or take over the lease for
        ``seconds``; the lease if ``holder`` holds it now, None if another does."""
        params = self._params(seconds, name=name, holder=holder, epoch=epoch)
        with self._engine.begin() as conn:
            won = conn.execute(self._insert, params).rowcount == 1
            if not won:
                won = conn.execute(self._update, params).rowcount == 1
            if not won:
                return None
            row = conn.execute(self._read, params).one()
        return Lease(name, row.holder, int(row.epoch), float(row.expires_at))

    def release(self, name: str, holder: str, epoch: int) -> bool:
        """Give the lease up now (if ``holder`` still holds term ``epoch``)."""
        with self._engine.begin() as conn:
            return conn.execute(self._release, self._params(name=name, holder=holder, epoch=epoch)).rowcount == 1

    def read(self, name: str) -> tuple[Lease | None, float]:
        """The lease as it stands, and the database's clock."""
        params = self._params(name=name)
        with self._engine.connect() as conn:
            row = conn.execute(self._read, params).first()
        if row is None:
            return None, params.get("now", time.time())
        return Lease(name, row.holder, int(row.epoch), float(row.expires_at)), float(row.now)


class Leadership:
    """This process's claim to a lease: it holds and renews it, or waits to take it over.

    ``valid_for()`` is what callers fence on: seconds of the current term left (<= 0: not the leader).
    """

    def __init__(self, store: LeaseStore, member: str, *, name: str = LIFECYCLE_LEASE, lease_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self._store = store
        self.member = member
        self.name = name
        self.lease_seconds = lease_seconds
        self.attempt_every = lease_seconds / 3
        self._clock = clock
        self.epoch: int | None = None  # the term held (None: not the leader)
        self._valid_until = float("-inf")
        self.terms = 0  # terms won by this process
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    def valid_for(self) -> float:
        """Seconds of leadership left, by this process's monotonic clock (<= 0: not the leader)."""
        return self._valid_until - self._clock() if self.epoch is not None else 0.0

    def is_leader(self) -> bool:
        return self.valid_for() > 0

    async def attempt(self) -> bool:
        """One take / renew / take-over attempt; whether this process leads now."""
        sent = self._clock()
        try:
            lease = await asyncio.to_thread(self._store.acquire, self.name, self.member, self.epoch,
                                            self.lease_seconds)
        except Exception as exc:  # the database unreachable: the term runs out by itself
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("lifecycle lease: cannot reach the catalog (%s); %s", type(exc).__name__,
                            f"leading for {self.valid_for():.1f} s more" if self.is_leader() else "not leading")
            return self.is_leader()
        if lease is None:
            if self.epoch is not None:
                log.warning("lifecycle lease: lost term %d (another gateway took over)", self.epoch)
            self.epoch = None
            self._valid_until = float("-inf")
            return False
        if lease.epoch != self.epoch:
            self.terms += 1
            log.info("lifecycle lease: %s leads the lifecycle (term %d)", self.member, lease.epoch)
        self.epoch = lease.epoch
        self._valid_until = sent + self.lease_seconds
        return True

    async def start(self) -> None:
        """Attempt once now (a lone gateway leads from its first pass), then every ``attempt_every``."""
        await self.attempt()
        self._task = asyncio.create_task(self._run(), name="kvgw-lifecycle-lease")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.attempt_every)
            await self.attempt()

    async def stop(self) -> None:
        """Stop attempting and give the lease up, so another gateway takes over at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        epoch, self.epoch = self.epoch, None
        self._valid_until = float("-inf")
        if epoch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(self._store.release, self.name, self.member, epoch), 5.0)

    def status(self) -> dict[str, Any]:
        return {"member": self.member, "leader": self.is_leader(), "term": self.epoch,
                "valid_for_s": round(max(0.0, self.valid_for()), 2), "terms_won": self.terms,
                "lease_failures": self.failures}


class SoleLeader:
    """Leadership of a gateway that coordinates with no one (``cluster_enabled = false``): always."""

    member = "local"
    epoch = 0

    def valid_for(self) -> float:
        return float("inf")

    def is_leader(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"member": self.member, "leader": True, "term": None, "valid_for_s": None, "terms_won": 0,
                "lease_failures": 0}
