"""The change feed in one process on SQLite (the embedded default): sequence numbers gap-free and in
commit order with concurrent publishers, usage deltas in the same transaction, the subscriber's
ordered catch-up from its persisted position, own events skipped, resync when trimmed behind."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from backends.index import ChunkIndex
from backends.tiers import TierId
from gateway.chunks import ChunkInfo, NoEvents
from gateway.cluster.db import EVENTS, ClusterDB
from gateway.cluster.feed import (
    ClusterEvents,
    FeedEvent,
    FeedPublisher,
    FeedSubscriber,
    Kind,
    add_detail,
    trim_feed,
)
from gateway.cluster.resync import TierCount
from gateway.cluster.usage import UsageView, read_usage, write_usage
from kvgw_client.keys import chunk_digest


@pytest.fixture
def db(sqlite_url: str) -> ClusterDB:
    return ClusterDB(sqlite_url)


def stored(key: str, size: int = 100, created: float = 1000.0, tier: TierId = TierId.FS) -> FeedEvent:
    digest = chunk_digest("b", key)
    info = ChunkInfo("b", key, size, hash(key) & 0xFFFF, created, 0.0, tier)
    return FeedEvent(Kind.STORED, "b", digest, int(tier), size, 0.0, created, detail=add_detail(info, None))


def removed(key: str, size: int = 100, kind: Kind = Kind.DELETED) -> FeedEvent:
    return FeedEvent(kind, "b", chunk_digest("b", key), int(TierId.FS), size, at=2000.0)


async def test_concurrent_publishers_get_gap_free_commit_ordered_numbers(db: ClusterDB) -> None:
    publishers = [FeedPublisher(db, f"m{i}", batch_events=7) for i in range(4)]

    def publish(pub: FeedPublisher, n: int) -> None:
        for start in range(0, n, 7):
            pub._write([stored(f"{pub.member}-{i}") for i in range(start, min(n, start + 7))])

    threads = [threading.Thread(target=publish, args=(pub, 70)) for pub in publishers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with db.engine.connect() as conn:
        rows = conn.execute(select(EVENTS.c.seq, EVENTS.c.member, EVENTS.c.digest).order_by(EVENTS.c.seq)).all()
        assert ClusterDB.head(conn) == 280
    assert [r.seq for r in rows] == list(range(1, 281))
    for pub in publishers:  # each publisher's events keep its order
        mine = [bytes(r.digest) for r in rows if r.member == pub.member]
        assert mine == [chunk_digest("b", f"{pub.member}-{i}") for i in range(70)]
    view = UsageView(db)
    await view.refresh()
    assert view.usage("b", TierId.FS) == 280 * 100 and view.chunks("b", TierId.FS) == 280


async def test_subscriber_applies_in_order_skips_its_own_and_resumes_after_restart(db: ClusterDB,
                                                                                   tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "index")
    resyncs: list[int] = []

    async def resync(head: int, new_index: bool) -> None:
        resyncs.append(1)

    other = FeedPublisher(db, "other")
    mine = FeedPublisher(db, "me")
    sub = FeedSubscriber(db, index, "me")
    await sub.start(resync)
    assert resyncs == [1]  # a new index resyncs with the tiers first
    other._write([stored("a"), stored("b"), stored("c", tier=TierId.FS)])
    other._write([removed("b"), FeedEvent(Kind.READ, "b", chunk_digest("b", "a"), 1, at=5000.0, count=3)])
    mine._write([stored("mine")])  # this gateway's own event: its index has it already, skipped
    assert await sub.catch_up() == 6
    assert sub.position == 6 and sub.applied == 5
    a, b, c, m = index.get_many([chunk_digest("b", k) for k in ("a", "b", "c", "mine")])
    assert a is not None and a.key == "a" and a.hits == 3 and a.last_access == 5000.0
    assert b is None and c is not None and m is None
    assert index.feed_position() == (sub.feed_id, 6)

    # a restart continues from the position recorded in the index, without a resync
    other._write([removed("a", kind=Kind.EVICTED), stored("d")])
    again = FeedSubscriber(db, index, "me-after-restart")
    await again.start(resync)
    assert resyncs == [1] and again.position == 6
    assert await again.catch_up() == 2
    assert index.get(chunk_digest("b", "a")) is None and index.get(chunk_digest("b", "d")) is not None
    index.close()


async def test_a_subscriber_behind_what_the_feed_keeps_resyncs(db: ClusterDB, tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "index")
    resyncs: list[int] = []

    async def resync(head: int, new_index: bool) -> None:
        resyncs.append(1)

    pub = FeedPublisher(db, "other")
    sub = FeedSubscriber(db, index, "me")
    await sub.start(resync)
    pub._write([stored(f"k{i}") for i in range(10)])
    assert trim_feed(db, now=10_000.0, keep_seconds=1e9, keep_events=4) == 6
    await sub.catch_up()
    assert resyncs == [1, 1] and sub.position == 10  # resynced, continuing from the head it read first
    pub._write([stored("after")])
    assert await sub.catch_up() == 1 and index.get(chunk_digest("b", "after")) is not None
    # everything older than the retention time goes too, and a caught-up subscriber does not mind
    assert trim_feed(db, now=10_000.0, keep_seconds=1.0, keep_events=100) == 5
    assert await sub.catch_up() == 0 and resyncs == [1, 1]
    index.close()


async def test_events_queue_while_the_database_fails_and_publish_when_it_answers(db: ClusterDB,
                                                                                tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "index")
    pub = FeedPublisher(db, "me", max_queued=3)
    sink = ClusterEvents(pub, NoEvents(), index)
    good_url = db.engine.url
    db.engine.dispose()
    broken = ClusterDB(f"sqlite:///{tmp_path / 'missing' / 'nowhere.sqlite'}")
    pub._db = broken
    for key in ("x", "y", "z"):
        info = ChunkInfo("b", key, 10, 1, 1.0, 0.0)
        sink.stored("b", chunk_digest("b", key), TierId.FS, 10, 0.0, None, 1.0, info=info)
    sink.stored("b", chunk_digest("b", "seen"), TierId.FS, 10, 0.0, None, 1.0, reason="learned")  # index-only
    assert pub.queued() == 3
    assert not await pub.flush()
    assert pub.queued() == 3 and pub.outage_since is not None
    assert pub.admit() is not None  # the queue is full: new client writes are refused (503)
    view = UsageView(db, pending=pub.pending_usage)
    assert view.report() == {"b": {"fs_bytes": 30, "fs_chunks": 3}}  # own unpublished writes count
    pub._db = ClusterDB(good_url.render_as_string(hide_password=False))
    assert await pub.flush()
    assert pub.queued() == 0 and pub.admit() is None and pub.outage_since is None and pub.head == 3
    broken.close()
    index.close()


async def test_the_flusher_batches_without_a_round_trip_per_event(db: ClusterDB) -> None:
    pub = FeedPublisher(db, "me", flush_seconds=0.01)
    task = asyncio.create_task(pub.run())
    try:
        for i in range(50):
            pub.add(stored(f"k{i}"))
        assert pub.published == 0  # nothing written on the caller's path
        for _ in range(200):
            if pub.published == 50:
                break
            await asyncio.sleep(0.01)
        assert pub.published == 50 and pub.batches <= 3
    finally:
        task.cancel()


def test_a_recount_from_the_tiers_keeps_the_changes_made_while_it_read_them(db: ClusterDB) -> None:
    pub = FeedPublisher(db, "m")
    pub._write([stored("old")])
    since = db.current_head()  # read before the scan starts
    count = TierCount()  # the scan read "old", "early" (stored before the scan got there) and "gone"
    for _ in ("old", "early", "gone"):
        count.add("b", int(TierId.FS), 100)
    count.passed(int(TierId.FS), b"\xff" * 17, 1500.0)  # it had read everything by t=1500
    # while the scan ran: "early" stored before it was read (the scan saw it); after it had passed,
    # "new" stored and "gone" deleted (the scan did not see those)
    pub._write([stored("early", created=1000.0), stored("new", created=2000.0), removed("gone")])
    assert write_usage(db, count, [int(TierId.FS)], now=3000.0, since=since)
    assert read_usage(db) == ({("b", int(TierId.FS)): (300, 3)}, 3000.0)
    # the first count of a catalog happens once; later automatic ones defer to it
    assert not write_usage(db, TierCount(), [int(TierId.FS)], now=4000.0, since=None, only_if_uncounted=True)


async def test_reads_and_prefix_chains_learnt_on_one_gateway_reach_the_others(db: ClusterDB, tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "index")

    async def resync(head: int, new_index: bool) -> None:
        return None

    pub = FeedPublisher(db, "other")
    sub = FeedSubscriber(db, index, "me:1:mine")
    await sub.start(resync)
    pub._write([stored("p0"), stored("p1"), stored("p2")])
    chain = [chunk_digest("b", k) for k in ("p0", "p1", "p2")]
    pub.chained("b", chain)  # the other gateway answered a prefix call for p0, p1, p2
    pub.read("b", chain[2], int(TierId.FS), 7000.0)
    pub.read("b", chain[2], int(TierId.FS), 7001.0)
    assert await pub.flush()
    assert pub.head == 6  # three stores, two links and one aggregated read
    pub.chained("b", chain)  # shipped lately: not again
    assert await pub.flush() and pub.head == 6
    await sub.catch_up()
    assert index.parent_of(chain[1]) == chain[0] and index.parent_of(chain[2]) == chain[1]
    last = index.get(chain[2])
    assert last is not None and last.hits == 2 and last.last_access == 7001.0
    index.close()


async def test_a_ledger_read_during_a_commit_counts_the_batch_once(db: ClusterDB) -> None:
    """The round-2 CI failure: the background ledger read landed after a batch committed and before the
    publisher took it off its pending deltas, so the leader saw it twice and evicted twice as much.
    Here the commit is held open after it is durable, and a ledger read is started meanwhile: whatever
    the read does, the view never counts the batch twice, and counts it once when both are done."""
    publisher = FeedPublisher(db, "m", batch_events=100)
    view = UsageView(db, pending=publisher.pending_usage, settled=publisher.settled, read_back=publisher.ledger_read)
    committed, release = threading.Event(), threading.Event()
    write = publisher._write

    def write_then_hold(batch: list[FeedEvent]) -> int:
        head = write(batch)
        committed.set()
        release.wait(30)
        return head

    publisher._write = write_then_hold  # type: ignore[method-assign]
    for i in range(3):
        publisher.add(stored(f"k{i}", size=1000))
    flushing = asyncio.create_task(publisher.flush_queued())
    assert await asyncio.to_thread(committed.wait, 30)
    reading = asyncio.create_task(view.refresh())
    await asyncio.wait([reading], timeout=1.0)  # an unguarded read finishes here, with the batch pending too
    during = view.usage("b", TierId.FS)
    release.set()
    assert await flushing
    await reading
    assert during == 3000
    assert view.usage("b", TierId.FS) == 3000 and view.chunks("b", TierId.FS) == 3
    # published after the last read, before the next: still counted once (this gateway's own writes
    # never drop out of its view between a commit and the next read)
    publisher._write = write  # type: ignore[method-assign]
    publisher.add(stored("k3", size=1000))
    assert await publisher.flush_queued()
    assert view.usage("b", TierId.FS) == 4000
    await view.refresh()
    assert view.usage("b", TierId.FS) == 4000 and view.chunks("b", TierId.FS) == 4


async def test_a_link_from_another_gateway_reaches_a_subscriber_with_a_listener(db: ClusterDB,
                                                                                tmp_path: Path) -> None:
    """The round-2 CI failure behind a stalled lifecycle: a prefix link (no tier) applied by a subscriber
    that tells a listener raised, and the subscriber stopped reading the feed. Links and reads of other
    gateways now reach the index, reads reach the listener, and the subscriber goes on."""
    index = ChunkIndex(tmp_path / "index")
    heard: list[tuple[str, bytes, int]] = []

    class Listener(NoEvents):
        def read(self, bucket: str, digest: bytes, tier: TierId, now: float) -> None:
            heard.append((bucket, digest, int(tier)))

    async def resync(head: int, new_index: bool) -> None:
        return None

    other = FeedPublisher(db, "other")
    sub = FeedSubscriber(db, index, "me", listener=Listener())
    await sub.start(resync)
    parent, child = chunk_digest("b", "p"), chunk_digest("b", "c")
    other._write([stored("p"), stored("c")])
    other._write([FeedEvent(Kind.LINKED, "b", child, 0, at=10.0, detail=parent),
                  FeedEvent(Kind.READ, "b", child, int(TierId.FS), at=11.0, count=1)])
    assert await sub.catch_up() == 4
    assert index.parent_of(child) == parent
    assert heard == [("b", child, int(TierId.FS))]
    other._write([stored("later")])
    assert await sub.catch_up() == 1 and index.get(chunk_digest("b", "later")) is not None
    index.close()
