"""The catalog's side of read leases: the statements every process and the lifecycle leader run.

Tables (revisions 0006 and 0009): ``chunk_leases`` (one row per chunk in a lease state: ``READ`` until
``expires_at``, ``REMOVING`` while the lifecycle removes a copy, ``REMOVED`` lately), ``lease_log`` and
``lease_head`` (the claims and their outcomes, numbered in commit order: a claim or settle takes its
number from ``lease_head``'s one row, whose row lock orders them), ``lease_members`` (what each
granting process acknowledged) and ``lease_quotas`` (each process's share of a bucket's cap).

- ``sync`` (each process, in the background): write the grants it made in memory (a grant overrides
  a claim: the claim then fails its confirmation), the releases loads made, and its ``lease_members``
  row (``seen``, ``synced_at``, ``quiet_at``, dated by the database's clock); read the lease_log entries
  after its position (or the whole claims view, the first time and after a gap the trim left).
- ``claim`` (the leader): turn chunks no unexpired ``READ`` row holds into ``REMOVING`` and log them
  under a new number; ``lagging`` lists the live processes that have not acknowledged it yet;
  ``confirm`` keeps the claims no grant overrode meanwhile; ``settle`` ends claims (``REMOVED``, or
  let go) and logs that.
- ``rebalance``: a process's share of a capped bucket, under a per-bucket lock.

On PostgreSQL each hot statement is one round trip in autocommit mode with ``synchronous_commit`` off
(a lease row lost in a crash merely ends early); claims send ``NOTIFY`` on the lease channel so every
process syncs at once. On SQLite (one host) each call is one transaction that starts with a write, so
it holds the database's write lock before it reads. All calls are blocking (the syncer's threads).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Table, case, delete, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from backends.catalog.models import ChunkLease, LeaseHead, LeaseLog, LeaseMember, LeaseQuota
from gateway.leases.local import READ, RELEASED, REMOVED, REMOVING, Batch, SyncResult

LEASES: Table = ChunkLease.__table__  # type: ignore[assignment]
LOG: Table = LeaseLog.__table__  # type: ignore[assignment]
HEAD: Table = LeaseHead.__table__  # type: ignore[assignment]
MEMBERS: Table = LeaseMember.__table__  # type: ignore[assignment]
QUOTAS: Table = LeaseQuota.__table__  # type: ignore[assignment]

LOG_KEEP_SECONDS = 300.0  # lease_log entries kept (a process further behind reads the whole view)
MEMBER_FORGET_SECONDS = 60.0  # a member row past its quiet_at by this much is deleted
_CHUNK = 500  # digests per IN list on SQLite


class LeaseTable:
    """The lease statements for one process (``member``) on one engine (see the module docstring)."""

    def __init__(self, engine: Engine, *, member: str, channel: str) -> None:
        self.engine = engine
        self.member = member
        self.channel = channel

    @property
    def postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextlib.contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    @contextlib.contextmanager
    def _write_transaction(self) -> Iterator[Connection]:
        """SQLite: a transaction holding the write lock from its first statement (the head's row)."""
        with self.engine.begin() as conn:
            conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=HEAD.c.seq))
            yield conn

    # -- every process -------------------------------------------------------------------------

    def sync(self, batch: Batch, quiet_seconds: float) -> SyncResult:
        """Write ``batch`` and this process's member row (``quiet_at`` = the database's now +
        ``quiet_seconds``); read what the lease_log holds after ``batch.seen``."""
        if self.postgres:
            params = {
                "digests": batch.digests, "sizes": batch.sizes, "untils": batch.untils, "bucket_of": batch.bucket_of,
                "buckets": batch.buckets, "r_digest": batch.releases, "member": self.member, "seen": batch.seen,
                "quiet": quiet_seconds, "known": batch.seen if batch.seen >= 0 else 2**62, "now": batch.now,
            }
            with self._autocommit() as conn:
                rows = conn.exec_driver_sql(_SYNC_POSTGRES, params).all()
            head = trimmed = 0
            released: set[bytes] = set()
            log: list[tuple[int, bytes, int, float]] = []
            for part, seq, cut, digest, state, expires in rows:
                if part == 0:
                    head, trimmed = int(seq), int(cut)
                elif part == 1:
                    released.add(bytes(digest))
                else:
                    log.append((int(seq), bytes(digest), int(state), float(expires)))
            log.sort(key=lambda entry: entry[0])
            view = None
            if batch.seen < 0 or batch.seen < trimmed:
                head, view = self._view()
                log = []
            quotas = self._rebalance(batch) if batch.quotas else {}
            return SyncResult(head, log, view, released, quotas)
        now = time.time()  # SQLite is one host's: its clock is the database's
        grants = batch.grants
        with self._write_transaction() as conn:
            if grants:
                rows_in = [{"digest": d, "bucket": b, "kind": READ, "bytes": n, "expires_at": until}
                           for d, (b, n, until) in grants.items()]
                conn.execute(self._grant_sqlite(), rows_in)
            released = set()
            for start in range(0, len(batch.releases), _CHUNK):
                released.update(conn.execute(delete(LEASES).where(
                    LEASES.c.digest.in_(batch.releases[start : start + _CHUNK]), LEASES.c.kind == READ)
                    .returning(LEASES.c.digest)).scalars())
            upsert = sqlite.insert(MEMBERS).values(member=self.member, seen=batch.seen, synced_at=now,
                                                   quiet_at=now + quiet_seconds)
            conn.execute(upsert.on_conflict_do_update(index_elements=[MEMBERS.c.member], set_={
                "seen": upsert.excluded.seen, "synced_at": upsert.excluded.synced_at,
                "quiet_at": upsert.excluded.quiet_at}))
            head, trimmed = conn.execute(select(HEAD.c.seq, HEAD.c.trimmed).where(HEAD.c.id == 1)).one()
            view = None
            log = []
            if batch.seen < 0 or batch.seen < trimmed:
                view = self._view_rows(conn, now)
            else:
                log = [(int(s), bytes(d), int(st), float(e)) for s, d, st, e in conn.execute(
                    select(LOG.c.seq, LOG.c.digest, LOG.c.state, LOG.c.expires_at)
                    .where(LOG.c.seq > batch.seen).order_by(LOG.c.seq))]
            quotas = self._rebalance_in(conn, batch, now) if batch.quotas else {}
        return SyncResult(int(head), log, view, released, quotas)

    @staticmethod
    def _grant_sqlite() -> Any:
        """A grant overrides whatever the row holds: a lease extends (the latest end wins), a claim or a
        removal gives way (the leader's confirmation then fails, or a lookup leases a chunk written again)."""
        ins = sqlite.insert(LEASES)
        return ins.on_conflict_do_update(index_elements=[LEASES.c.digest], set_={
            "kind": READ, "bucket": ins.excluded.bucket, "bytes": ins.excluded.bytes,
            "expires_at": case((LEASES.c.kind == READ, func.max(LEASES.c.expires_at, ins.excluded.expires_at)),
                               else_=ins.excluded.expires_at)})

    def _view(self) -> tuple[int, list[tuple[bytes, int, float]]]:
        """The head and the claims in force, in one snapshot (PostgreSQL)."""
        with self._autocommit() as conn:
            rows = conn.exec_driver_sql(_VIEW_POSTGRES).all()
        head = int(rows[0][0]) if rows else 0
        return head, [(bytes(d), int(k), float(e)) for _, d, k, e in rows if d is not None]

    @staticmethod
    def _view_rows(conn: Connection, now: float) -> list[tuple[bytes, int, float]]:
        rows = conn.execute(select(LEASES.c.digest, LEASES.c.kind, LEASES.c.expires_at).where(
            LEASES.c.kind.in_((REMOVING, REMOVED)), LEASES.c.expires_at > now))
        return [(bytes(d), int(k), float(e)) for d, k, e in rows]

    def _rebalance(self, batch: Batch) -> dict[str, int | None]:
        """PostgreSQL: one transaction, a transaction-level advisory lock per bucket (in name order)."""
        with self.engine.begin() as conn:
            now = float(conn.exec_driver_sql("SELECT extract(epoch from statement_timestamp())").scalar_one())
            for bucket in sorted(batch.quotas):
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                             {"key": f"kvgw-lease-quota:{bucket}"})
            return self._rebalance_in(conn, batch, now)

    def _rebalance_in(self, conn: Connection, batch: Batch, now: float) -> dict[str, int | None]:
        """Each asked bucket's new share for this process: what it holds plus what it asked beyond that
        or an equal part of what nobody holds (one part kept back for a newcomer), whichever is more,
        but never more than the cap less the other live processes' shares; given back (None) when it
        holds nothing and asks nothing."""
        out: dict[str, int | None] = {}
        for bucket in sorted(batch.quotas):
            ask = batch.quotas[bucket]
            if ask.used == 0 and ask.demand == 0:
                conn.execute(delete(QUOTAS).where(QUOTAS.c.bucket == bucket, QUOTAS.c.member == self.member))
                out[bucket] = None
                continue
            others = conn.execute(
                select(QUOTAS.c.bytes, QUOTAS.c.used).join(MEMBERS, MEMBERS.c.member == QUOTAS.c.member)
                .where(QUOTAS.c.bucket == bucket, QUOTAS.c.member != self.member, MEMBERS.c.quiet_at > now)).all()
            held = sum(int(row[0]) for row in others)
            free = max(0, ask.cap - sum(int(row[1]) for row in others) - ask.used)
            share = max(0, min(ask.used + max(ask.demand, free // (len(others) + 2)), ask.cap - held))
            upsert = (postgresql.insert if self.postgres else sqlite.insert)(QUOTAS).values(
                bucket=bucket, member=self.member, bytes=share, used=ask.used)
            conn.execute(upsert.on_conflict_do_update(index_elements=[QUOTAS.c.bucket, QUOTAS.c.member], set_={
                "bytes": upsert.excluded.bytes, "used": upsert.excluded.used}))
            out[bucket] = share
        return out

    def peek_head(self) -> int:
        """The lease_log head (SQLite's stand-in for NOTIFY: cheap enough to poll)."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(HEAD.c.seq).where(HEAD.c.id == 1)).scalar_one())

    def leave(self) -> None:
        """This process stops granting (after a sync wrote all it granted): its row and shares go."""
        with self.engine.begin() as conn:
            conn.execute(delete(QUOTAS).where(QUOTAS.c.member == self.member))
            conn.execute(delete(MEMBERS).where(MEMBERS.c.member == self.member))

    # -- the lifecycle leader ------------------------------------------------------------------

    def claim(self, bucket: str, digests: list[bytes], now: float, until: float) -> tuple[int, set[bytes]]:
        """Claim ``digests`` for removal until ``until`` where no unexpired read lease holds them; the
        lease_log number of the claim and the digests claimed."""
        if self.postgres:
            params = {"bucket": bucket, "now": now, "until": until, "digest": digests, "channel": self.channel}
            with self._autocommit() as conn:
                seq, claimed, _, _ = conn.exec_driver_sql(_CLAIM_POSTGRES, params).one()
            return int(seq), set(map(bytes, claimed))
        with self._write_transaction() as conn:
            seq = self._next_seq(conn)
            conn.execute(delete(LEASES).where(LEASES.c.digest.in_(digests), LEASES.c.expires_at <= now))
            ins = sqlite.insert(LEASES)
            stmt = ins.on_conflict_do_update(index_elements=[LEASES.c.digest], set_={
                "kind": REMOVING, "bytes": 0, "expires_at": ins.excluded.expires_at}, where=LEASES.c.kind != READ,
            ).returning(LEASES.c.digest)
            rows = [{"digest": d, "bucket": bucket, "kind": REMOVING, "bytes": 0, "expires_at": until} for d in digests]
            claimed = set(conn.execute(stmt, rows).scalars())
            self._log(conn, seq, [(d, REMOVING, until) for d in claimed], time.time())
        return seq, claimed

    def lagging(self, seq: int) -> list[tuple[str, int, float, float]]:
        """The live processes that have not acknowledged claim ``seq``: (member, seen, seconds since
        their last sync, seconds until their quiet_at), by the database's clock."""
        if self.postgres:
            with self._autocommit() as conn:
                rows: list[tuple[Any, ...]] = [tuple(r) for r in conn.exec_driver_sql(_LAGGING_POSTGRES, {"seq": seq})]
        else:
            now = time.time()
            with self.engine.connect() as conn:
                rows = [(m, s, now - at, quiet - now) for m, s, at, quiet in conn.execute(
                    select(MEMBERS.c.member, MEMBERS.c.seen, MEMBERS.c.synced_at, MEMBERS.c.quiet_at)
                    .where(MEMBERS.c.seen < seq, MEMBERS.c.quiet_at > now))]
        return [(str(m), int(s), float(silent), float(quiet)) for m, s, silent, quiet in rows]

    def confirm(self, digests: list[bytes]) -> set[bytes]:
        """Of the claimed ``digests``, those still claimed (no grant overrode the claim)."""
        with self.engine.connect() as conn:
            if self.postgres:
                rows = conn.exec_driver_sql(_CONFIRM_POSTGRES, {"digest": digests}).scalars()
                return set(map(bytes, rows))
            found: set[bytes] = set()
            for start in range(0, len(digests), _CHUNK):
                found.update(conn.execute(select(LEASES.c.digest).where(
                    LEASES.c.digest.in_(digests[start : start + _CHUNK]), LEASES.c.kind == REMOVING)).scalars())
            return found

    def settle(self, removed: list[bytes], kept: list[bytes], now: float, memory_until: float) -> None:
        """End claims: ``removed`` lost their last copy (remembered until ``memory_until`` for lookups
        that raced the removal), ``kept`` did not or were never taken (their rows, if still claims, go).
        Both are logged; letting go notifies (the processes answer those chunks absent until they learn)."""
        if self.postgres:
            params = {"removed": removed, "kept": kept, "memory": memory_until, "now": now,
                      "channel": self.channel if kept else ""}
            with self._autocommit() as conn:
                conn.exec_driver_sql(_SETTLE_POSTGRES, params)
            return
        with self._write_transaction() as conn:
            seq = self._next_seq(conn)
            if removed:
                conn.execute(update(LEASES).where(LEASES.c.digest.in_(removed), LEASES.c.kind == REMOVING)
                             .values(kind=REMOVED, expires_at=memory_until))
            if kept:
                conn.execute(delete(LEASES).where(LEASES.c.digest.in_(kept), LEASES.c.kind == REMOVING))
            self._log(conn, seq, [(d, REMOVED, memory_until) for d in removed] + [(d, RELEASED, now) for d in kept],
                      time.time())

    @staticmethod
    def _next_seq(conn: Connection) -> int:
        return int(conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=HEAD.c.seq + 1)
                                .returning(HEAD.c.seq)).scalar_one())

    @staticmethod
    def _log(conn: Connection, seq: int, entries: Sequence[tuple[bytes, int, float]], at: float) -> None:
        """Log ``entries`` (digest, state, expires_at) under ``seq``, one per digest (the last wins)."""
        rows = {d: {"seq": seq, "digest": d, "state": s, "expires_at": e, "at": at} for d, s, e in entries}
        if rows:
            conn.execute(insert(LOG), list(rows.values()))

    # -- both ----------------------------------------------------------------------------------

    def leased_bytes(self, bucket: str, now: float) -> int:
        """Bytes under unexpired read leases in ``bucket``, as written so far."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(LEASES.c.bytes), 0)).where(
                LEASES.c.bucket == bucket, LEASES.c.kind == READ, LEASES.c.expires_at > now)).scalar_one())

    def trim(self, now: float) -> int:
        """Delete lease rows past their end, lease_log entries older than ``LOG_KEEP_SECONDS`` (a
        prefix of the numbers: ``lease_head.trimmed`` says where it ends) and members long quiet."""
        db_now = time.time() if not self.postgres else None
        with self.engine.begin() as conn:
            if db_now is None:
                db_now = float(conn.exec_driver_sql("SELECT extract(epoch from statement_timestamp())").scalar_one())
            removed = int(conn.execute(delete(LEASES).where(LEASES.c.expires_at <= now)).rowcount or 0)
            cut = conn.execute(select(func.max(LOG.c.seq)).where(LOG.c.at < db_now - LOG_KEEP_SECONDS)).scalar()
            if cut is not None:
                conn.execute(delete(LOG).where(LOG.c.seq <= cut))
                conn.execute(update(HEAD).where(HEAD.c.id == 1, HEAD.c.trimmed < cut).values(trimmed=cut))
            conn.execute(delete(MEMBERS).where(MEMBERS.c.quiet_at < db_now - MEMBER_FORGET_SECONDS))
            conn.execute(delete(QUOTAS).where(~QUOTAS.c.member.in_(select(MEMBERS.c.member))))
        return removed


def quiet_window(fresh_seconds: float, horizon_ms: int) -> float:
    """Seconds from a sync to the moment none of the leases its process may grant without another
    sync is still in force: grants stop ``fresh_seconds`` after the sync was sent, and last at most the
    announced horizon."""
    return fresh_seconds + horizon_ms / 1000


_NOW = "extract(epoch from statement_timestamp())"

# One statement, one round trip: grants (overriding claims), releases, the member row, then the head,
# the rows the releases deleted and the lease_log entries after the position, in one snapshot. The
# grants come as columns in binary (``%(x)b``: psycopg's text arrays escape each element through a
# regular expression, 3.3 µs a row; binary 0.5 µs; the digests as one bytea, nothing per row).
_SYNC_POSTGRES = f"""
WITH granted AS (
    INSERT INTO chunk_leases (digest, bucket, kind, bytes, expires_at)
    SELECT g.digest, (%(buckets)b::text[])[g.b], {READ}, g.bytes, g.until
    FROM (SELECT substring(%(digests)b::bytea FROM (u.i::int - 1) * 16 + 1 FOR 16) AS digest, u.bytes, u.until, u.b
          FROM unnest(%(sizes)b::int8[], %(untils)b::float8[], %(bucket_of)b::int4[])
               WITH ORDINALITY AS u(bytes, until, b, i)) AS g
    WHERE g.until > %(now)s AND g.digest <> ALL(%(r_digest)b::bytea[])
    ON CONFLICT (digest) DO UPDATE
        SET kind = {READ}, bucket = excluded.bucket, bytes = excluded.bytes,
            expires_at = CASE WHEN chunk_leases.kind = {READ}
                              THEN greatest(chunk_leases.expires_at, excluded.expires_at)
                              ELSE excluded.expires_at END
    RETURNING 1
), released AS (
    DELETE FROM chunk_leases WHERE digest = ANY(%(r_digest)b::bytea[]) AND kind = {READ} RETURNING digest
), me AS (
    INSERT INTO lease_members (member, seen, synced_at, quiet_at)
    VALUES (%(member)s, %(seen)s, {_NOW}, {_NOW} + %(quiet)s)
    ON CONFLICT (member) DO UPDATE
        SET seen = excluded.seen, synced_at = excluded.synced_at, quiet_at = excluded.quiet_at
    RETURNING set_config('synchronous_commit', 'off', true)
)
SELECT 0, h.seq, h.trimmed, NULL::bytea, NULL::int2, NULL::float8 FROM lease_head h, me
UNION ALL
SELECT 1, 0, 0, r.digest, NULL, NULL FROM released r
UNION ALL
SELECT 2, l.seq, 0, l.digest, l.state, l.expires_at FROM lease_log l WHERE l.seq > %(known)s
"""

_VIEW_POSTGRES = f"""
SELECT h.seq, NULL::bytea, NULL::int2, NULL::float8 FROM lease_head h
UNION ALL
SELECT NULL, c.digest, c.kind, c.expires_at FROM chunk_leases c
WHERE c.kind IN ({REMOVING}, {REMOVED}) AND c.expires_at > {_NOW}
"""

_CLAIM_POSTGRES = f"""
WITH head AS (
    UPDATE lease_head SET seq = seq + 1 WHERE id = 1 RETURNING seq
), claimed AS (
    INSERT INTO chunk_leases (digest, bucket, kind, bytes, expires_at)
    SELECT r.digest, %(bucket)s, {REMOVING}, 0, %(until)s FROM head, unnest(%(digest)s::bytea[]) AS r(digest)
    ON CONFLICT (digest) DO UPDATE SET kind = {REMOVING}, bytes = 0, expires_at = excluded.expires_at
        WHERE chunk_leases.kind <> {READ} OR chunk_leases.expires_at <= %(now)s
    RETURNING digest
), logged AS (
    INSERT INTO lease_log (seq, digest, state, expires_at, at)
    SELECT head.seq, claimed.digest, {REMOVING}, %(until)s, {_NOW} FROM head, claimed
)
SELECT head.seq, array(SELECT digest FROM claimed), pg_notify(%(channel)s, head.seq::text),
       set_config('synchronous_commit', 'off', true)
FROM head
"""

_LAGGING_POSTGRES = f"""
SELECT member, seen, {_NOW} - synced_at, quiet_at - {_NOW} FROM lease_members
WHERE seen < %(seq)s AND quiet_at > {_NOW}
"""

_CONFIRM_POSTGRES = f"SELECT digest FROM chunk_leases WHERE digest = ANY(%(digest)s::bytea[]) AND kind = {REMOVING}"

_SETTLE_POSTGRES = f"""
WITH head AS (
    UPDATE lease_head SET seq = seq + 1 WHERE id = 1 RETURNING seq
), removed AS (
    UPDATE chunk_leases SET kind = {REMOVED}, expires_at = %(memory)s
    WHERE digest = ANY(%(removed)s::bytea[]) AND kind = {REMOVING}
), kept AS (
    DELETE FROM chunk_leases WHERE digest = ANY(%(kept)s::bytea[]) AND kind = {REMOVING}
), logged AS (
    INSERT INTO lease_log (seq, digest, state, expires_at, at)
    SELECT head.seq, d, {REMOVED}, %(memory)s, {_NOW} FROM head, unnest(%(removed)s::bytea[]) AS d
    UNION ALL
    SELECT head.seq, d, {RELEASED}, %(now)s, {_NOW} FROM head, unnest(%(kept)s::bytea[]) AS d
)
SELECT head.seq, CASE WHEN %(channel)s <> '' THEN pg_notify(%(channel)s, head.seq::text) END,
       set_config('synchronous_commit', 'off', true)
FROM head
"""

