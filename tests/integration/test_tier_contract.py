"""One contract, every tier: the behaviour ``gateway.service`` relies on, run over the POSIX tier on a
temporary directory, the S3 tier against real S3 servers (moto over HTTP, or ``KVGW_TEST_S3_ENDPOINT``;
and Ceph RGW, ``tests/rgw``), the memory tier, and the fault-injecting wrapper over the memory tier with
no fault injected (the wrapper must be transparent).

A tier case also knows how to reach its storage behind the tier's back (a second instance on the same
storage, raw damage to a chunk), which is what crash and scrub behaviour needs.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from backends.base import ChunkMeta, Tier
from backends.errors import ChunkCorrupt, ChunkNotFound
from backends.faulty import FaultyTier
from backends.memory import MemoryStore, MemoryTier
from backends.posix import PosixTier
from backends.s3 import S3Tier
from kvgw_client.keys import chunk_digest
from tests import s3server
from tests.rgw.fixtures import S3_SERVERS, s3_endpoint_of
from tests.s3server import S3Endpoint

# The fixtures, until tests/conftest.py re-exports them (then these lines only cost a moto process).
s3_endpoint = s3server.s3_endpoint
s3_bucket = s3server.s3_bucket

PART = 5 << 20  # the S3 tier's part size here (S3's minimum), so multipart is exercised cheaply


@dataclass
class TierCase:
    tier: Tier
    reopen: Callable[[], Awaitable[Tier]]  # another instance on the same storage: "another gateway"
    damage: Callable[[bytes], None]  # overwrite a chunk's footer behind the tier's back


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def meta_for(data: bytes, key: str) -> ChunkMeta:
    return ChunkMeta(bucket="kvcache", key=key, size=len(data), checksum=xxhash.xxh3_64_intdigest(data),
                     created=round(time.time(), 3))


async def store(tier: Tier, data: bytes, key: str, piece: int = 1_000_003) -> tuple[bytes, bool]:
    """Stage, write in odd-sized pieces (crossing part boundaries anywhere), publish."""
    digest = chunk_digest("kvcache", key)
    staged = await tier.stage(digest)
    for i in range(0, len(data), piece):
        await staged.write(data[i : i + piece])
    return digest, await staged.publish(meta_for(data, key))


async def read_all(tier: Tier, digest: bytes, size: int) -> bytes:
    return bytes(await tier.read(digest, 0, size))


async def scanned(tier: Tier) -> dict[bytes, ChunkMeta | None]:
    return {digest: meta async for digest, meta in tier.scan()}


@pytest.fixture(params=["posix", "posix-direct", "posix-on-nfs", *S3_SERVERS, "memory", "faulty-memory"])
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TierCase]:
    opened: list[Tier] = []
    dropped: list[Callable[[], None]] = []  # after the tiers are closed
    if request.param in ("posix", "posix-direct", "posix-on-nfs"):
        root = tmp_path / "tier"
        direct = request.param == "posix-direct"  # chunk data written around the page cache
        if request.param == "posix-on-nfs":  # the tier as it runs on a network filesystem (no inline probes)
            request.getfixturevalue("monkeypatch").setattr("backends.posix.filesystem_type", lambda path: "nfs4")

        async def reopen_posix() -> Tier:
            tier = PosixTier(root, fsync=False, direct_writes=direct)
            opened.append(tier)
            return tier

        def damage_file(digest: bytes) -> None:
            path = Path(PosixTier(root, fsync=False).path_for(digest))
            path.write_bytes(path.read_bytes()[:-3])

        yield TierCase(await reopen_posix(), reopen_posix, damage_file)
    elif request.param in ("memory", "faulty-memory"):
        store = MemoryStore()
        wrapped = request.param == "faulty-memory"

        async def reopen_memory() -> Tier:
            tier: Tier = MemoryTier(store)
            if wrapped:
                tier = FaultyTier(tier)
            opened.append(tier)
            return tier

        yield TierCase(await reopen_memory(), reopen_memory, store.damage)
    else:
        endpoint: S3Endpoint = s3_endpoint_of(request, request.param)
        bucket = endpoint.create_bucket()
        dropped.append(lambda: endpoint.drop_bucket(bucket))
        settings = endpoint.settings(bucket, part_size=PART)

        async def reopen_s3() -> Tier:
            tier = S3Tier(settings)
            opened.append(tier)
            return tier

        def damage_object(digest: bytes) -> None:
            admin = endpoint.admin()
            key = f"{settings.prefix}{digest.hex()}"
            body = admin.get_object(Bucket=bucket, Key=key)["Body"].read()
            admin.put_object(Bucket=bucket, Key=key, Body=body[:-3])

        yield TierCase(await reopen_s3(), reopen_s3, damage_object)
    for tier in opened:
        await tier.close()
    for drop in dropped:
        drop()


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, 3 * PART + 5])
async def test_round_trip(case: TierCase, size: int) -> None:
    data = blob(size, seed=size)
    digest, created = await store(case.tier, data, f"round-trip-{size}")
    assert created
    meta = await case.tier.stat(digest)
    assert (meta.bucket, meta.key, meta.size, meta.checksum) == (
        "kvcache", f"round-trip-{size}", size, xxhash.xxh3_64_intdigest(data)
    )
    assert await read_all(case.tier, digest, size) == data
    assert b"".join([p async for p in case.tier.stream(digest, 0, size, 1 << 20)]) == data
    assert (await scanned(case.tier))[digest] == meta


async def test_meta_round_trips_exactly(case: TierCase) -> None:
    data = blob(1000)
    meta = ChunkMeta(bucket="b1", key="model@1@0@00ab@bf16/é", size=len(data),
                     checksum=xxhash.xxh3_64_intdigest(data), created=1700000000.25, expires=1700003600.5,
                     parent="model@1@0@00aa@bf16", attrs=(("content-type", "application/x-kv"),))
    digest = chunk_digest("b1", meta.key)
    staged = await case.tier.stage(digest)
    await staged.write(data)
    assert await staged.publish(meta)
    assert await case.tier.stat(digest) == meta
    assert await case.tier.stat_many([digest]) == [meta]


@pytest.mark.parametrize("size", [1000, 2 * PART + 7])
async def test_second_publish_returns_false_and_keeps_the_bytes(case: TierCase, size: int) -> None:
    first, second = blob(size, seed=1), blob(size, seed=2)
    digest, created = await store(case.tier, first, "once")
    assert created
    meta = await case.tier.stat(digest)
    assert (await store(case.tier, second, "once"))[1] is False
    assert await read_all(case.tier, digest, size) == first
    assert await case.tier.stat(digest) == meta
    other = await case.reopen()  # another gateway on the same storage also loses
    assert (await store(other, second, "once"))[1] is False
    assert await read_all(case.tier, digest, size) == first


@pytest.mark.parametrize("size", [50_000, PART + 1])
async def test_concurrent_publishers_exactly_one_wins(case: TierCase, size: int) -> None:
    writers = 6
    datas = [blob(size, seed=100 + i) for i in range(writers)]
    digest = chunk_digest("kvcache", "contended")
    staged = [await case.tier.stage(digest) for _ in range(writers)]
    for s, data in zip(staged, datas, strict=True):
        await s.write(data)
    results = await asyncio.gather(
        *(s.publish(meta_for(d, "contended")) for s, d in zip(staged, datas, strict=True))
    )
    assert results.count(True) == 1, results
    winner = datas[results.index(True)]
    assert await read_all(case.tier, digest, size) == winner
    assert (await case.tier.stat(digest)).checksum == xxhash.xxh3_64_intdigest(winner)


@pytest.mark.parametrize("size", [10, 2 * PART + 1])
async def test_discard_leaves_nothing_visible(case: TierCase, size: int) -> None:
    digest = chunk_digest("kvcache", "discarded")
    staged = await case.tier.stage(digest)
    await staged.write(blob(size))
    await staged.discard()
    await staged.discard()  # twice is fine
    with pytest.raises(ChunkNotFound):
        await case.tier.stat(digest)
    assert await case.tier.stat_many([digest]) == [None]
    assert await scanned(case.tier) == {}
    assert await case.tier.usage() == 0
    assert await case.tier.cleanup_staging(0) == 0  # nothing was left behind either


async def test_read_and_stream_ranges(case: TierCase) -> None:
    size = PART + 4321  # a multipart object on S3: ranges cross the part boundary
    data = blob(size, seed=9)
    digest, _ = await store(case.tier, data, "ranges")
    for offset, length in [(0, 1), (5, 100), (PART - 10, 20), (size - 1, 1), (size - 4321, 4321), (0, size),
                           (123, 0)]:
        assert bytes(await case.tier.read(digest, offset, length)) == data[offset : offset + length]
    for offset, length, window in [(0, size, 1 << 20), (7, 100, 1), (PART - 3, 4000, 4096), (size - 9, 9, 64),
                                   (10, 0, 5)]:
        pieces = [p async for p in case.tier.stream(digest, offset, length, window)]
        assert all(0 < len(p) <= window for p in pieces)
        assert b"".join(pieces) == data[offset : offset + length]


@pytest.mark.parametrize("size", [10, (1 << 20) + 1])  # hashed where read, and (over 1 MiB) off the loop
async def test_a_checked_read_returns_the_bytes_only_when_their_checksum_matches(case: TierCase, size: int) -> None:
    data = blob(size, seed=11)
    digest, _ = await store(case.tier, data, f"checked-{size}")
    right = xxhash.xxh3_64_intdigest(data)
    assert bytes(await case.tier.read(digest, 0, size, checksum=right)) == data
    with pytest.raises(ChunkCorrupt):
        await case.tier.read(digest, 0, size, checksum=right ^ 1)
    with pytest.raises(ChunkCorrupt):  # a range is checked as the bytes it is
        await case.tier.read(digest, 0, size - 1, checksum=right)


async def test_absent_chunk(case: TierCase) -> None:
    digest = chunk_digest("kvcache", "never-written")
    with pytest.raises(ChunkNotFound):
        await case.tier.stat(digest)
    with pytest.raises(ChunkNotFound):
        await case.tier.read(digest, 0, 10)
    with pytest.raises(ChunkNotFound):
        await case.tier.read(digest, 0, 0)
    with pytest.raises(ChunkNotFound):
        _ = [p async for p in case.tier.stream(digest, 0, 10, 4)]
    assert await case.tier.delete(digest) is False
    assert await case.tier.quarantine(digest) is False


async def test_stat_many_in_order_with_none_for_absent(case: TierCase) -> None:
    metas = {}
    for i in range(5):
        data = blob(1000 + i, seed=i)
        digest, _ = await store(case.tier, data, f"many-{i}")
        metas[digest] = await case.tier.stat(digest)
    absent = chunk_digest("kvcache", "absent")
    present = list(metas)
    asked = [present[0], absent, present[3], present[0], *present[1:], absent]
    assert await case.tier.stat_many(asked) == [metas.get(d) for d in asked]
    assert await case.tier.stat_many([]) == []


async def test_absent_now_never_says_absent_for_a_chunk_that_is_there(case: TierCase) -> None:
    """``absent_now`` may always say "cannot tell" (False), never "absent" for a published chunk; the
    tiers that answer on the event loop (a local filesystem, memory) do tell an absent chunk."""
    digest, _ = await store(case.tier, blob(2000), "present-now")
    absent = [chunk_digest("kvcache", "absent-now"), chunk_digest("kvcache", "absent-too")]
    assert not case.tier.absent_now([digest])
    assert not case.tier.absent_now([absent[0], digest])
    answers_at_once = isinstance(case.tier, MemoryTier) or (isinstance(case.tier, PosixTier)
                                                           and case.tier._probe_inline)
    assert case.tier.absent_now(absent) is answers_at_once
    await case.tier.delete(digest)
    assert case.tier.absent_now([digest]) is answers_at_once


async def test_damaged_chunk_is_none_for_lookups(case: TierCase) -> None:
    digest, _ = await store(case.tier, blob(5000), "damaged")
    case.damage(digest)
    assert await case.tier.stat_many([digest]) == [None]
    assert (await scanned(case.tier)) == {digest: None}


async def test_delete(case: TierCase) -> None:
    data = blob(3000)
    digest, _ = await store(case.tier, data, "deleted")
    assert await case.tier.delete(digest) is True
    with pytest.raises(ChunkNotFound):
        await case.tier.stat(digest)
    with pytest.raises(ChunkNotFound):
        await case.tier.read(digest, 0, 10)
    assert await case.tier.delete(digest) is False
    assert (await store(case.tier, data, "deleted"))[1] is True  # the digest is free again


async def test_quarantine(case: TierCase) -> None:
    data = blob(3000)
    digest, _ = await store(case.tier, data, "bad")
    keep, _ = await store(case.tier, data, "good")
    assert await case.tier.quarantine(digest) is True
    with pytest.raises(ChunkNotFound):
        await case.tier.stat(digest)
    assert list(await scanned(case.tier)) == [keep]
    assert await case.tier.quarantine(digest) is False
    assert (await store(case.tier, data, "bad"))[1] is True


async def test_scan_finds_every_chunk_with_its_meta(case: TierCase) -> None:
    expected = {}
    for i, size in enumerate([0, 1, 777, PART + 3, 20_000]):
        digest, _ = await store(case.tier, blob(size, seed=i), f"scan-{i}")
        expected[digest] = await case.tier.stat(digest)
    pending = await case.tier.stage(chunk_digest("kvcache", "unpublished"))
    await pending.write(blob(PART + 5))  # in progress: must not be listed
    try:
        found = [(digest, meta) async for digest, meta in case.tier.scan()]
    finally:
        await pending.discard()
    assert dict(found) == expected
    assert [d for d, _ in found] == sorted(expected)  # ascending digest, like the index
    assert await case.tier.usage() >= sum(m.size for m in expected.values())


async def test_cleanup_staging_removes_dead_writers_only(case: TierCase) -> None:
    crashed = case.tier
    # PosixTier names staging files <host>.<pid>.<n> with n counting from 0 per instance, so two
    # instances in one process must not stage their first write at the same time: advance this one.
    await store(crashed, b"warm-up", "warm-up")
    abandoned = await crashed.stage(chunk_digest("kvcache", "abandoned"))
    await abandoned.write(blob(PART + 100))  # never published nor discarded: the writer "crashed"
    survivor = await case.reopen()  # the restarted gateway
    live_digest = chunk_digest("kvcache", "live")
    live = await survivor.stage(live_digest)
    await live.write(blob(PART + 200, seed=3))
    await asyncio.sleep(0.05)
    assert await survivor.cleanup_staging(0) >= 1
    assert await survivor.cleanup_staging(0) == 0
    assert await live.publish(meta_for(blob(PART + 200, seed=3), "live"))  # its own write survived
    assert await read_all(survivor, live_digest, PART + 200) == blob(PART + 200, seed=3)
    await abandoned.discard()  # the dead writer's handle is harmless afterwards
    assert set(await scanned(case.tier)) == {live_digest, chunk_digest("kvcache", "warm-up")}


async def test_usage_counts_published_chunks(case: TierCase) -> None:
    assert await case.tier.usage() == 0
    await store(case.tier, blob(10_000), "u1")
    first = await case.tier.usage()
    assert first >= 10_000
    await store(case.tier, blob(PART + 1), "u2")
    assert await case.tier.usage() >= first + PART + 1
