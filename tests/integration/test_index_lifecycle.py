"""The index's derived databases, which let the lifecycle run without per-chunk memory: usage counters,
TTL order, chain leaves, sampling, ghosts of evicted chunks, observations; kept in step by every kind
of write, and built once for an index written before them."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from backends.index import (
    MARK_SHARED,
    OBS_FORGOTTEN,
    OBS_READ,
    OBS_RETURNED,
    ChangeOp,
    ChunkIndex,
    Ghost,
    IndexChange,
    IndexEntry,
)
from backends.tiers import TierId
from kvgw_client.keys import chunk_digest

FS, S3 = int(TierId.FS), int(TierId.S3)


def entry(key: str, size: int = 10, expires: float = 0.0, bucket: str = "kvcache", tiers: int = FS,
          created: float = 1000.0) -> IndexEntry:
    return IndexEntry(bucket, key, size, 0xABC, created, expires, created, 0, tiers)


def d(key: str, bucket: str = "kvcache") -> bytes:
    return chunk_digest(bucket, key)


def recount(index: ChunkIndex) -> dict[tuple[str, int], tuple[int, int]]:
    """Usage computed from the entries themselves: what the counters must say."""
    totals: dict[tuple[str, int], list[int]] = {}
    after = None
    while page := index.scan(after, limit=1000):
        for _, e in page:
            for bit in (FS, S3):
                if e.tiers & bit:
                    slot = totals.setdefault((e.bucket, bit), [0, 0])
                    slot[0] += e.size
                    slot[1] += 1
        after = page[-1][0]
    return {k: (v[0], v[1]) for k, v in totals.items()}


async def test_usage_counters_follow_every_kind_of_write(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put(d("a"), entry("a", 100))
        await index.put(d("b"), entry("b", 50, tiers=FS | S3))
        await index.put(d("a"), entry("a", 100))  # re-indexing the same chunk counts it once
        await index.put(d("x", "other"), entry("x", 7, bucket="other"))
        assert index.usage("kvcache", FS) == (150, 2)
        assert index.usage("kvcache", S3) == (50, 1)
        await index.update_tiers(d("a"), add=S3, remove=FS)
        assert index.usage("kvcache", FS) == (50, 1) and index.usage("kvcache", S3) == (150, 2)
        await index.update_tiers(d("b"), remove=FS | S3)  # the last bit: the entry goes
        assert index.get(d("b")) is None
        await index.put_many([(d("c"), entry("c", 5)), (d("a"), entry("a", 100))])  # a: back to fs only
        await index.apply_changes([
            IndexChange(ChangeOp.ADD, d("f"), FS, entry("f", 30, created=2000.0)),
            IndexChange(ChangeOp.ADD, d("c"), S3, entry("c", 5)),
            IndexChange(ChangeOp.REMOVE, d("x", "other"), FS),
        ], "feed", 3)
        assert index.usage_all() == recount(index)
        assert index.usage("other", FS) == (0, 0)
        await index.delete(d("a"))
        assert index.usage_all() == recount(index)
        await index.clear()
        assert index.usage_all() == {}
    finally:
        index.close()


async def test_expiry_order_is_kept_in_step(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put(d("late"), entry("late", expires=3000.0))
        await index.put(d("soon"), entry("soon", expires=1500.0))
        await index.put(d("never"), entry("never"))
        await index.put(d("gone"), entry("gone", expires=1200.0))
        await index.delete(d("gone"))
        assert index.due(2000.0, 10) == [(1500.0, d("soon"))]
        assert index.due(5000.0, 10) == [(1500.0, d("soon")), (3000.0, d("late"))]
        assert index.due(5000.0, 1) == [(1500.0, d("soon"))]
        await index.put(d("soon"), entry("soon", expires=4000.0))  # re-written with another expiry
        assert index.due(5000.0, 10) == [(3000.0, d("late")), (4000.0, d("soon"))]
        await index.update_tiers(d("late"), remove=FS)
        assert index.due(5000.0, 10) == [(4000.0, d("soon"))]
    finally:
        index.close()


async def test_leaves_per_tier_and_learnt_chains(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put(d("a"), entry("a"))
        await index.put(d("b"), entry("b"), d("a"))
        await index.put(d("c"), entry("c", tiers=S3), d("b"))  # b's child holds a copy in S3 only
        assert index.candidate(d("a"), FS) == (entry("a"), False)
        assert index.candidate(d("b"), FS) == (entry("b"), True)  # a leaf in fs: c is not there
        assert index.candidate(d("c"), FS) is None
        assert index.children_in(d("a"), FS) == [d("b")] and index.children_in(d("b"), FS) == []
        await index.update_tiers(d("c"), add=FS)
        assert index.candidate(d("b"), FS) == (entry("b"), False)
        await index.delete(d("c"))
        assert index.candidate(d("b"), FS) == (entry("b"), True)
        # learnt from a lookup's order: x <- y; then a repeated key relinks as the pairs in order do
        for k in "xy":
            await index.put(d(k), entry(k))
        future = index.link_chain([d("x"), d("y")])
        assert future is not None
        future.result(10)
        assert index.parent_of(d("y")) == d("x") and not index.candidate(d("x"), FS)[1]  # type: ignore[index]
        assert index.link_chain([d("x"), d("y")]) is None  # known: no write
        future = index.link_chain([d("a"), d("y"), d("b"), d("y")])
        assert future is not None
        future.result(10)
        assert index.parent_of(d("y")) == d("b")
        assert index.candidate(d("x"), FS) == (entry("x"), True)  # y moved away: x is a leaf again
        future = index.link_chain([d("x"), d("absent")])
        if future is not None:
            future.result(10)
        assert index.parent_of(d("absent")) is None  # links of absent chunks are not kept
    finally:
        index.close()


async def test_sampling_sees_only_the_bucket_and_tier_and_covers_it(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put_many([(d(f"k{i}"), entry(f"k{i}")) for i in range(200)])
        await index.put_many([(d(f"s{i}"), entry(f"s{i}", tiers=S3)) for i in range(50)])
        await index.put_many([(d(f"o{i}", "other"), entry(f"o{i}", bucket="other")) for i in range(100)])
        await index.put(d("dead"), entry("dead", expires=1500.0))
        seen: set[bytes] = set()
        for step in range(512):  # starts swept evenly over the key space: deterministic coverage
            got = index.sample("kvcache", FS, 8, 2000.0, (step << 119).to_bytes(16, "big"))
            assert len(got) == 8
            for digest, e, leaf in got:
                assert e.bucket == "kvcache" and e.tiers & FS and leaf and e.key.startswith("k")
                seen.add(digest)
        assert len(seen) == 200  # every chunk can be drawn (the expired one never is)
        assert len(index.sample("kvcache", FS, 8, 2000.0, b"\xff" * 16)) == 8  # wraps around
        assert index.sample("nothing", FS, 8, 2000.0, os.urandom(16)) == []
        assert len(index.sample("kvcache", FS, 8, 2000.0, os.urandom(16), scan_limit=3)) <= 3
    finally:
        index.close()


async def test_ghosts_mark_returning_chunks_and_are_bounded(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put_many([(d(f"k{i}"), entry(f"k{i}")) for i in range(10)])
        index.observations.clear()
        await index.delete(d("k0"))
        await index.remember([(d("k0"), Ghost("kvcache", FS, 10, 1500.0, 2))], keep=2.0)
        assert index.ghost_count() == 1
        assert index.sample_ghosts(5, os.urandom(16)) == [(d("k0"), Ghost("kvcache", FS, 10, 1500.0, 2))]
        await index.put(d("k0"), entry("k0", created=1800.0))
        got = index.get(d("k0"))
        assert got is not None and got.returned and index.ghost_count() == 0
        assert list(index.observations) == [(OBS_RETURNED, "kvcache", FS, 10, 1500.0, 2, 1800.0, 1, 0)]
        # at most keep x indexed chunks are remembered; the rest are forgotten at random, observed
        index.observations.clear()
        ghosts = [(d(f"g{i}"), Ghost("kvcache", FS, 10, 1000.0 + i, 0)) for i in range(40)]
        await index.remember(ghosts, keep=2.0)
        assert index.ghost_count() == 20
        assert [o.kind for o in index.observations] == [OBS_FORGOTTEN] * 20
        await index.remember([(d("k1"), Ghost("kvcache", FS, 10, 1.0, 0))], keep=2.0)  # indexed: not a ghost
        assert index.get(d("k1")) is not None and index.ghost_count() <= 20
    finally:
        index.close()


async def test_reads_leave_observations_of_the_entry_before_the_read(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        await index.put(d("a"), entry("a", 64))
        index.observations.clear()
        index.touch(d("a"), 1100.0)
        index.touch(d("a"), 1200.0)
        await index.flush()
        assert list(index.observations) == [(OBS_READ, "kvcache", FS, 64, 1000.0, 0, 1200.0, 2, 0)]
        await index.apply_changes([IndexChange(ChangeOp.READ, d("a"), FS, count=3, at=1300.0)], "feed", 1)
        assert index.observations[-1] == (OBS_READ, "kvcache", FS, 64, 1200.0, 2, 1300.0, 3, 0)
        got = index.get(d("a"))
        assert got is not None and (got.last_access, got.hits) == (1300.0, 5)
    finally:
        index.close()


async def test_an_index_from_before_the_derived_databases_is_brought_up_to_date(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    await index.put(d("a"), entry("a", 100, expires=5000.0))
    await index.put(d("b"), entry("b", 50), d("a"))
    index.close()
    env = lmdb.open(str(tmp_path / "idx"), max_dbs=16)  # as the previous version left it
    with env.begin(write=True) as txn:
        for name in (b"kids", b"expiry", b"usage", b"ghosts"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.delete(b"layout", db=env.open_db(b"meta", txn=txn))
    env.close()
    index = ChunkIndex(tmp_path / "idx")
    try:
        assert index.usage("kvcache", FS) == (150, 2)
        assert index.due(6000.0, 10) == [(5000.0, d("a"))]
        assert index.candidate(d("a"), FS) == (entry("a", 100, expires=5000.0), False)
    finally:
        index.close()


async def test_ghosts_of_layout_2_have_no_marks_and_are_forgotten_on_upgrade(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    await index.put(d("a"), entry("a", 100))
    index.close()
    env = lmdb.open(str(tmp_path / "idx"), max_dbs=16)  # layout 2 wrote ghosts without a marks byte
    with env.begin(write=True) as txn:
        old = struct.pack("<dQIB", 1.0, 10, 0, FS) + b"kvcache"
        txn.put(d("gone"), old, db=env.open_db(b"ghosts", txn=txn))
        txn.put(b"layout", b"2", db=env.open_db(b"meta", txn=txn))
    env.close()
    index = ChunkIndex(tmp_path / "idx")
    try:
        assert index.ghost_count() == 0
        assert index.usage("kvcache", FS) == (100, 1)  # the rest is kept as it was, not rebuilt
        await index.remember([(d("g"), Ghost("kvcache", FS, 10, 1.0, 0, MARK_SHARED))], keep=2.0)
        assert index.sample_ghosts(5, os.urandom(16)) == [(d("g"), Ghost("kvcache", FS, 10, 1.0, 0, MARK_SHARED))]
    finally:
        index.close()
