"""``ClusterDB.change_mark``: how a process on SQLite (no ``NOTIFY``) notices another's commit with two
``stat`` calls instead of a query, and the lease syncer, which reads ``lease_head`` for new claims only
when the mark moved (an idle gateway used to read it 20 times a second)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from backends.catalog.store import make_engine
from gateway.cluster.db import HEAD, ClusterDB
from gateway.leases import book as lease_book
from gateway.leases.book import LeaseBook
from tests.conftest import wait_for_async
from tests.requirements import require_or_skip


@pytest.fixture
def url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture
def other(url: str) -> Iterator[Engine]:
    """A connection of another process's: its commits are what the mark must show."""
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _commit(engine: Engine) -> None:
    """One commit that changes a row, the feed head's (a claim moves the database's files alike)."""
    with engine.begin() as conn:
        conn.execute(update(HEAD).where(HEAD.c.id == 1).values(seq=HEAD.c.seq + 1))


def test_the_mark_moves_with_every_commit_and_only_then(url: str, other: Engine) -> None:
    db = ClusterDB(url)
    try:
        _commit(other)  # the write-ahead log exists from here on
        marks = [db.change_mark()]
        with other.connect() as conn:  # a read commits nothing
            conn.execute(select(HEAD.c.seq)).all()
        assert db.change_mark() == marks[0]
        for _ in range(20):  # back to back, as a busy feed commits
            _commit(other)
            marks.append(db.change_mark())
        assert len(set(marks)) == len(marks), "a commit left the mark where it was"
        assert db.change_mark() == marks[-1]
    finally:
        db.engine.dispose()


def test_a_database_no_file_holds_has_no_mark(pg_url: str) -> None:
    for url in ("sqlite://", pg_url):
        db = ClusterDB(url)
        try:
            assert db.change_mark() is None
        finally:
            db.engine.dispose()


def test_a_database_on_a_network_filesystem_has_no_mark(tmp_path: Path) -> None:
    """No ``stat`` on the event loop where it may wait for a server: a FUSE view (bindfs, as the cluster
    tests give each gateway one) stands for NFS; the same file seen directly has a mark."""
    if shutil.which("bindfs") is None or not Path("/dev/fuse").exists():
        require_or_skip("bindfs (Debian package bindfs) and /dev/fuse are needed for a FUSE view")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "catalog.sqlite").write_bytes(b"")
    view = tmp_path / "view"
    view.mkdir()
    subprocess.run(["bindfs", str(tmp_path / "real"), str(view)], check=True, capture_output=True, timeout=30)
    try:
        for where, marked in ((view, False), (tmp_path / "real", True)):
            db = ClusterDB(f"sqlite:///{where / 'catalog.sqlite'}")
            try:
                assert (db.change_mark() is not None) is marked, where
            finally:
                db.engine.dispose()
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False, capture_output=True, timeout=30)


async def test_the_lease_syncer_reads_the_head_only_after_a_commit(url: str, other: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    db = ClusterDB(url)
    book = LeaseBook(db, "m1", sync_seconds=3600.0)  # no sync of its own while the test runs
    reads: list[int] = []
    peek = book._table.peek_head

    def counted() -> int:
        reads.append(1)
        return peek()

    monkeypatch.setattr(book._table, "peek_head", counted)
    await book.start()
    try:
        await book.sync()  # the first sync: from here the syncer peeks for claims
        await wait_for_async(lambda: len(reads) >= 1, "the syncer reads the head once after its own sync")
        before = len(reads)
        await asyncio.sleep(10 * lease_book.PEEK_SECONDS)  # ten checks with nothing committed
        assert len(reads) == before
        _commit(other)
        await wait_for_async(lambda: len(reads) > before, "the syncer reads the head after the commit")
    finally:
        await book.stop()
        book.close()
        db.engine.dispose()
