"""The change stream kvgw offers its clients: which chunks of a bucket appeared and disappeared, per key
prefix, resumable with a cursor; read from the cluster feed (``gateway.cluster.feed``).

Engines that share a bucket use it to learn what the others stored and what kvgw's lifecycle removed
(vLLM's kvgw tier turns it into KV events for routers: ``kvgw_client.vllm``). It is a view of the feed,
not a second log: the cursor is the feed's own sequence number, so a client that remembers the last
cursor it was given continues exactly after it, from any gateway of the cluster, after a restart of
either side, for as long as the feed keeps the events (``cluster_feed_retention_seconds`` /
``_events``). A cursor older than the oldest event kept answers ``reset: true`` and continues from the
oldest one: the client missed changes and should treat what it knows as stale.

What a change is, at the level a client sees (one chunk under one key, whatever tiers hold copies):

* ``stored``: a client wrote the chunk (``Kind.STORED``: a native or S3 PUT); copies made between
  tiers (promotions, write-through, demotion into S3) are not changes;
* ``removed``: a copy was removed (deleted, evicted, expired, demoted out of the filesystem,
  quarantined) and no tier holds the chunk any more, as this gateway's index says when the page is
  read. A copy evicted from the filesystem while S3 still holds the chunk is not a change. A chunk
  removed and stored again before the page is read shows its removal as nothing and its new store as
  ``stored``; every store is reported, so a client counts "stored" idempotently.

Pages never run ahead of this gateway's index: rows other gateways published are served only once
the index has applied them (its feed position), so the index's word on a removal is never older than
the removal. Rows this gateway's own processes published are in the index before they are in the
feed and are served at once. A removal row carries the key from revision-compatible detail bytes
(``feed.removal_detail``); one published without (its remover did not know the chunk) is skipped.

Reads go through the cluster's database thread (``ClusterDB.run``), a bounded scan each: at most
``scan_limit`` feed rows per page, whatever the bucket or prefix filter keeps, so a client far behind
on a busy feed pages forward without any one request holding the database long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from backends.index import ChunkIndex
from gateway.cluster.db import EVENTS, ClusterDB
from gateway.cluster.feed import REMOVALS, Kind, detail_key
from kvgw_client.keys import chunk_digest

MAX_CHANGES = 1000
"""The most changes one page carries (a client asks for fewer with ``limit``)."""
SCAN_LIMIT = 5000
"""The most feed rows one page reads, matching or not."""


@dataclass(frozen=True, slots=True)
class Change:
    seq: int
    op: str  # "stored" | "removed"
    key: str
    at: float  # unix seconds, when the gateway that made it published it
    size: int

    def doc(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "key": self.key, "at": self.at, "size": self.size}


@dataclass(frozen=True, slots=True)
class ChangePage:
    changes: list[Change]
    cursor: int  # continue with ``after=cursor``: every feed row up to it was considered
    head: int  # the feed's head when the page was read (cursor < head: more to read)
    reset: bool  # the cursor asked for was older than the oldest kept event: changes were missed

    def doc(self) -> dict[str, Any]:
        return {"changes": [c.doc() for c in self.changes], "cursor": self.cursor, "head": self.head,
                "reset": self.reset}


class ChangeStream:
    """Pages of a bucket's changes under a key prefix (module docstring). Thread: every method but
    ``page`` runs in the cluster's database thread; ``page`` awaits it."""

    def __init__(self, db: ClusterDB, index: ChunkIndex, index_token: str, *,
                 position: Callable[[], int] | None = None, scan_limit: int = SCAN_LIMIT) -> None:
        """``index_token``: the identity of this host's index (member ids of its processes end with it);
        ``position``: the last feed row the index applied (default: as the index records it)."""
        self._db = db
        self._index = index
        self._token = index_token
        self._position = position or self._index_position
        self.scan_limit = scan_limit

    def _index_position(self) -> int:
        known = self._index.feed_position()
        return 0 if known is None else known[1]

    async def page(self, bucket: str, prefix: str, after: int | None, limit: int = MAX_CHANGES) -> ChangePage:
        """Changes of ``bucket`` under ``prefix`` after feed row ``after`` (None: from now on, an empty
        page whose cursor is the head), at most ``limit``."""
        return await self._db.run(self._read, bucket, prefix, after, max(1, min(limit, MAX_CHANGES)))

    def _read(self, bucket: str, prefix: str, after: int | None, limit: int) -> ChangePage:
        position = self._position()
        with self._db.engine.connect() as conn:
            head = ClusterDB.head(conn)
            if after is None or after > head:  # from now on (a cursor of another catalog: the same)
                return ChangePage([], head, head, reset=after is not None)
            oldest = conn.execute(select(func.min(EVENTS.c.seq))).scalar_one_or_none()
            reset = oldest is not None and after < int(oldest) - 1
            if oldest is None and after < head:
                reset = True  # every event up to the head was trimmed
            start = int(oldest) - 1 if reset and oldest is not None else after
            rows = conn.execute(
                select(EVENTS.c.seq, EVENTS.c.at, EVENTS.c.member, EVENTS.c.bucket, EVENTS.c.digest,
                       EVENTS.c.kind, EVENTS.c.size, EVENTS.c.detail)
                .where(EVENTS.c.seq > start).order_by(EVENTS.c.seq).limit(self.scan_limit)
            ).all()
        cursor = head if reset and not rows else start
        changes: list[Change] = []
        for seq, at, member, row_bucket, digest, kind, size, detail in rows:
            if seq > position and member.rpartition(":")[2] != self._token:
                break  # another gateway's row the index has not applied yet: wait for it
            if len(changes) >= limit:
                break
            cursor = int(seq)
            if row_bucket != bucket or not (kind == Kind.STORED or kind in REMOVALS):
                continue
            key = detail_key(int(kind), None if detail is None else bytes(detail))
            if key is None or not key.startswith(prefix):
                continue
            if kind == Kind.STORED:
                changes.append(Change(int(seq), "stored", key, float(at), int(size)))
            elif self._gone(bucket, key, bytes(digest)):
                changes.append(Change(int(seq), "removed", key, float(at), int(size)))
        return ChangePage(changes, cursor, head, reset)

    def _gone(self, bucket: str, key: str, digest: bytes) -> bool:
        """No tier holds the chunk, as the index says now."""
        if digest != chunk_digest(bucket, key):
            return False  # a row that does not match its own key: not ours to interpret
        entry = self._index.get(digest)
        return entry is None or not entry.tiers
