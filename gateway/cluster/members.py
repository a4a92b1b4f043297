"""Cluster members: one ``cluster_members`` row per gateway process, kept alive by a heartbeat.

Each gateway process registers when it starts (member id ``host:pid:token``, version, URL), refreshes
its row every ``cluster_heartbeat_seconds`` with its feed position, and deletes it when it stops
cleanly. A row whose heartbeat is older than ``cluster_member_timeout_seconds`` is shown as down; one
older than ``cluster_member_forget_seconds`` is deleted by whichever member notices (a killed gateway
leaves its row behind). Membership is bookkeeping for operators (``kvgw cluster status``) and for the
feed's retention, never a vote: who may do what is decided by rows and locks in PostgreSQL
(the lifecycle leader's lease, ``gateway.cluster.leader``).

``cluster_status`` reads everything ``kvgw cluster status`` prints: members with their feed lag, the
feed, the lifecycle leader's lease, usage against capacity per bucket and tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import DBAPIError

from backends.catalog.models import Bucket
from backends.tiers import TierId
from gateway.cluster.db import EVENTS, LEASES, MEMBERS, ClusterDB
from gateway.cluster.usage import read_usage
from gateway.version import kvgw_version

log = logging.getLogger("kvgw.cluster")

LEADER_LEASE = "lifecycle"


def new_member_id(index_token: str | None = None) -> str:
    """``host:pid:index token`` (at most 64 characters): unique among live processes; the worker
    processes of one gateway share the last part, their index's identity (``ChunkIndex.identity``), by
    which the feed tells the events their index holds already."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{(index_token or secrets.token_hex(4))[:16]}"


class Membership:
    """This process's row in ``cluster_members`` (see the module docstring)."""

    def __init__(self, db: ClusterDB, member: str, *, url: str, position: Callable[[], int],
                 heartbeat_seconds: float = 2.0, forget_seconds: float = 3600.0,
                 housekeeping: Callable[[], Awaitable[None]] | None = None,
                 housekeeping_seconds: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self.member = member
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.version = kvgw_version()
        self.url = url
        self._position = position
        self.heartbeat_seconds = heartbeat_seconds
        self.forget_seconds = forget_seconds
        self._housekeeping = housekeeping
        self.housekeeping_seconds = housekeeping_seconds
        self._clock = clock
        self.started_at = clock()
        self.beat_at: float | None = None
        self.failures = 0

    def _beat(self) -> None:
        now = self._clock()
        values = {"host": self.host[:255], "pid": self.pid, "version": self.version[:32], "url": self.url[:255],
                  "started_at": self.started_at, "heartbeat_at": now, "feed_seq": self._position()}
        stmt = self._db.upsert(MEMBERS).values(member=self.member, **values)
        with self._db.engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_update(index_elements=["member"], set_=values))
            conn.execute(delete(MEMBERS).where(MEMBERS.c.heartbeat_at < now - self.forget_seconds))
        self.beat_at = now

    async def beat(self) -> None:
        await self._db.run(self._beat)

    async def run(self) -> None:
        next_housekeeping = time.monotonic() + min(5.0, self.housekeeping_seconds)
        while True:
            try:
                await self.beat()
            except (DBAPIError, OSError) as exc:
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("cluster: heartbeat failed (%s)", type(exc).__name__)
            if self._housekeeping is not None and time.monotonic() >= next_housekeeping:
                next_housekeeping = time.monotonic() + self.housekeeping_seconds
                try:
                    await self._housekeeping()
                except (DBAPIError, OSError) as exc:
                    log.info("cluster: housekeeping skipped (%s)", type(exc).__name__)
            await asyncio.sleep(self.heartbeat_seconds)

    def _leave(self) -> None:
        with self._db.engine.begin() as conn:
            conn.execute(delete(MEMBERS).where(MEMBERS.c.member == self.member))

    async def leave(self) -> None:
        """Remove this member's row (a clean stop); best effort."""
        with contextlib.suppress(DBAPIError, OSError):
            await asyncio.wait_for(self._db.run(self._leave), 5.0)


def cluster_status(db: ClusterDB, *, now: float | None = None, timeout_seconds: float = 15.0) -> dict[str, Any]:
    """Members, feed, leader and usage against capacity, as ``kvgw cluster status`` shows them."""
    now = time.time() if now is None else now
    with db.engine.connect() as conn:
        head = ClusterDB.head(conn)
        oldest = conn.execute(select(func.min(EVENTS.c.seq))).scalar_one_or_none()
        members = conn.execute(select(MEMBERS).order_by(MEMBERS.c.host, MEMBERS.c.pid)).mappings().all()
        lease = conn.execute(select(LEASES).where(LEASES.c.name == LEADER_LEASE)).mappings().first()
        buckets = conn.execute(select(Bucket.name, Bucket.capacity_bytes, Bucket.s3_capacity_bytes)).all()
        out_members = []
        for row in members:
            position = int(row["feed_seq"])
            lag_seconds = 0.0
            if position < head:
                first_missing = conn.execute(select(EVENTS.c.at).where(EVENTS.c.seq > position)
                                             .order_by(EVENTS.c.seq).limit(1)).scalar_one_or_none()
                lag_seconds = 0.0 if first_missing is None else max(0.0, now - float(first_missing))
            age = now - float(row["heartbeat_at"])
            out_members.append({
                "member": row["member"], "host": row["host"], "pid": row["pid"], "version": row["version"],
                "url": row["url"], "started_at": row["started_at"], "heartbeat_age_s": round(age, 1),
                "alive": age <= timeout_seconds, "feed_seq": position, "feed_lag_events": max(0, head - position),
                "feed_lag_s": round(lag_seconds, 3),
            })
    usage, counted = read_usage(db)
    capacity = {(name, int(TierId.FS)): fs for name, fs, _ in buckets}
    capacity |= {(name, int(TierId.S3)): s3 for name, _, s3 in buckets}
    out_usage = []
    for (bucket, tier), (bytes_, chunks) in sorted(usage.items()):
        cap = capacity.get((bucket, tier))
        out_usage.append({"bucket": bucket, "tier": TierId(tier).label, "bytes": bytes_, "chunks": chunks,
                          "capacity_bytes": cap, "fraction": None if not cap else round(bytes_ / cap, 4)})
    leader: dict[str, Any] | None = None
    if lease is not None:
        leader = {"holder": lease["holder"], "epoch": lease["epoch"],
                  "expires_in_s": round(float(lease["expires_at"]) - now, 1),
                  "valid": float(lease["expires_at"]) > now}
    return {
        "feed": {"head": head, "oldest_kept": oldest, "channel": db.channel},
        "members": out_members,
        "leader": leader,
        "usage": out_usage,
        "usage_counted_at": counted,
    }


def format_status(status: dict[str, Any]) -> str:
    """``cluster_status`` as text for a terminal."""
    lines = []
    feed = status["feed"]
    lines.append(f"feed: head {feed['head']}, oldest kept {feed['oldest_kept'] or '-'}")
    leader = status["leader"]
    if leader is None:
        lines.append("leader: none (no lifecycle lease taken)")
    else:
        state = f"expires in {leader['expires_in_s']} s" if leader["valid"] else "EXPIRED"
        lines.append(f"leader: {leader['holder']} (epoch {leader['epoch']}, {state})")
    lines.append(f"members: {len(status['members'])}")
    header = f"  {'host':<24} {'pid':>7} {'version':<10} {'heartbeat':>10} {'feed lag':>18}  member"
    lines.append(header)
    for m in status["members"]:
        beat = f"{m['heartbeat_age_s']} s ago" + ("" if m["alive"] else " DOWN")
        lag = f"{m['feed_lag_events']} ev / {m['feed_lag_s']} s"
        lines.append(f"  {m['host'][:24]:<24} {m['pid']:>7} {m['version'][:10]:<10} {beat:>10} {lag:>18}  "
                     f"{m['member']}")
    lines.append("usage (whole tier):")
    lines.append(f"  {'bucket':<24} {'tier':<4} {'bytes':>16} {'chunks':>10} {'capacity':>16} {'used':>7}")
    for u in status["usage"]:
        cap = "-" if u["capacity_bytes"] is None else str(u["capacity_bytes"])
        used = "-" if u["fraction"] is None else f"{100 * u['fraction']:.1f}%"
        lines.append(f"  {u['bucket'][:24]:<24} {u['tier']:<4} {u['bytes']:>16} {u['chunks']:>10} {cap:>16} {used:>7}")
    return "\n".join(lines)
