"""The cluster's access to the shared catalog database: its own engine and its own worker thread.

The cluster tables (revision 0005: ``chunk_events``, ``feed_head``, ``tier_usage``, ``cluster_members``,
``cluster_leases``) live in the catalog database, but the cluster talks to it through an engine of its
own (a small pool, a connect timeout on PostgreSQL) and one worker thread of its own, so a slow or
unreachable database stalls only the cluster's background work, never the catalog refresh, the
event loop or the threads that do file I/O.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Table, create_engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from backends.catalog.models import CatalogMeta, ChunkEvent, ClusterLease, ClusterMember, FeedHead, TierUsage
from backends.catalog.store import make_engine
from backends.fileio import LOCAL_FILESYSTEMS, filesystem_type

T = TypeVar("T")

log = logging.getLogger("kvgw.cluster")

EVENTS: Table = ChunkEvent.__table__  # type: ignore[assignment]
HEAD: Table = FeedHead.__table__  # type: ignore[assignment]
USAGE: Table = TierUsage.__table__  # type: ignore[assignment]
MEMBERS: Table = ClusterMember.__table__  # type: ignore[assignment]
LEASES: Table = ClusterLease.__table__  # type: ignore[assignment]
META: Table = CatalogMeta.__table__  # type: ignore[assignment]

FEED_ID = "cluster_feed_id"  # catalog_meta: the identity of this catalog's feed (an index records it)
USAGE_COUNTED = "cluster_usage_counted_at"  # catalog_meta: tier_usage was counted from the tiers once
CONNECT_TIMEOUT_SECONDS = 5

_CHANNEL = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _file_mark(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class ClusterDB:
    """An engine on the catalog database for the cluster's background work, and the thread it runs in."""

    def __init__(self, url: str, *, channel: str = "kvgw_feed") -> None:
        if not _CHANNEL.match(channel):
            raise ValueError(f"the feed channel must be a lower-case SQL identifier, not {channel!r}")
        self.url = url
        self.channel = channel
        if url.startswith("postgresql"):
            self.engine: Engine = create_engine(url, pool_pre_ping=True, pool_size=3, max_overflow=2,
                                                connect_args={"connect_timeout": CONNECT_TIMEOUT_SECONDS})
        else:
            self.engine = make_engine(url)
        self.postgres = self.engine.dialect.name == "postgresql"
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgw-cluster")
        self._marked: str | None = None  # change_mark: the database file, once found on a local filesystem
        self._unmarkable = self.postgres  # change_mark: never (PostgreSQL, a network filesystem)

    def change_mark(self) -> tuple[tuple[int, int, int], tuple[int, int, int] | None] | None:
        """SQLite: a stamp of the database's files (the main file and its write-ahead log: inode, size,
        modification time) that moves with every commit of any process, read with two ``stat`` calls on
        the calling thread (cheap enough for the event loop). None on PostgreSQL (it notifies instead)
        and for a database no file at its name holds (in memory, an URI filename) or one on a network
        filesystem (a ``stat`` there may wait for a server: the event loop must not; the caller then
        queries as before). A poller compares two stamps to skip a query while nothing was committed in
        between.

        A commit shows as a new stamp when the filesystem dates it apart from the commit before the
        last stamp was read: a write-ahead log that was restarted keeps its size, so its modification
        time must differ. Linux's multigrain timestamps (6.13 on) give that on ext4, XFS, btrfs and
        tmpfs once a ``stat`` has looked; with coarser ones (a tick of a few milliseconds) a commit
        right after another may go unseen until the next commit, so a caller keeps an unconditional
        read of its own now and then (the lease syncer's every ``sync_seconds``)."""
        if self._unmarkable:
            return None
        if self._marked is None:
            database = self.engine.url.database
            if not database or _file_mark(database) is None:  # in memory, an URI filename, not created yet
                return None
            if filesystem_type(database) not in LOCAL_FILESYSTEMS:
                self._unmarkable = True
                return None
            self._marked = database
        main = _file_mark(self._marked)
        return None if main is None else (main, _file_mark(f"{self._marked}-wal"))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking database call in the cluster's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def listen_dsn(self) -> str | None:
        """A libpq connection string for LISTEN (PostgreSQL only)."""
        if not self.postgres:
            return None
        return self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def listen(self, channel: str, note: Callable[[str], None], state: Callable[[bool], None], *,
                     what: str) -> None:
        """Call ``note(payload)`` for every ``NOTIFY`` on ``channel`` (PostgreSQL; returns at once on
        SQLite), ``state(True)`` once listening, ``state(False)`` when the connection is lost (``what``
        names the listener in the warning). Reconnects with back-off forever; cancel to stop."""
        import psycopg

        dsn = self.listen_dsn()
        if dsn is None:
            return
        backoff = 0.5
        listening = False
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5)
                async with conn:
                    await conn.execute(f"LISTEN {channel}")
                    listening = True
                    state(True)
                    backoff = 0.5
                    async for notification in conn.notifies():
                        note(notification.payload)
            except asyncio.CancelledError:
                state(False)
                raise
            except Exception as exc:  # the listener's poll keeps it going meanwhile
                if listening:
                    log.warning("%s: LISTEN connection lost (%s)", what, type(exc).__name__)
                listening = False
                state(False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    def upsert(self, table: Table) -> Any:
        """The dialect's INSERT that supports ``on_conflict_do_update`` (PostgreSQL and SQLite)."""
        return (postgresql.insert if self.postgres else sqlite.insert)(table)

    def feed_id(self) -> str:
        """This catalog's feed identity, created on first use (race-safe)."""
        import secrets

        with self.engine.begin() as conn:
            found = conn.execute(select(META.c.value).where(META.c.name == FEED_ID)).scalar_one_or_none()
        if found is not None:
            return str(found)
        try:
            with self.engine.begin() as conn:
                conn.execute(META.insert().values(name=FEED_ID, value=secrets.token_hex(8)))
        except IntegrityError:
            pass  # another gateway created it meanwhile
        with self.engine.begin() as conn:
            return str(conn.execute(select(META.c.value).where(META.c.name == FEED_ID)).scalar_one())

    @staticmethod
    def lock_head(conn: Connection) -> int:
        """Take the feed head's row lock for the rest of the transaction (serialising with every
        publisher, on SQLite the database write lock); returns the head."""
        return int(conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=HEAD.c.seq)
                                .returning(HEAD.c.seq)).scalar_one())

    @staticmethod
    def head(conn: Connection) -> int:
        return int(conn.execute(select(HEAD.c.seq).where(HEAD.c.id == 1)).scalar_one())

    def current_head(self) -> int:
        """The feed head now (blocking)."""
        with self.engine.connect() as conn:
            return self.head(conn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.dispose()
