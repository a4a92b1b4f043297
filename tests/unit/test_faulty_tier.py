"""FaultyTier does what each injection says, and a failed write leaves nothing behind.

The wrapper's transparency without faults is proven by the tier contract suite
(``tests/integration/test_tier_contract.py``, case ``faulty-memory``); this file proves the faults.
"""

from __future__ import annotations

import asyncio
import errno
import random

import pytest
import xxhash

from backends.base import ChunkMeta
from backends.errors import (
    BackendError,
    ChunkCorrupt,
    ChunkNotFound,
    StorageFull,
    TierUnavailable,
)
from backends.faulty import Fault, FaultyTier
from backends.memory import MemoryStore, MemoryTier
from kvgw_client.keys import chunk_digest

DATA = random.Random(7).randbytes(10_000)


def meta_for(data: bytes, key: str) -> ChunkMeta:
    return ChunkMeta("kvcache", key, len(data), xxhash.xxh3_64_intdigest(data), created=1_700_000_000.0)


async def store(tier: FaultyTier, key: str, data: bytes = DATA) -> bytes:
    digest = chunk_digest("kvcache", key)
    staged = await tier.stage(digest)
    await staged.write(data)
    assert await staged.publish(meta_for(data, key))
    return digest


@pytest.fixture
def backing() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def slept() -> list[float]:
    return []


@pytest.fixture
def tier(backing: MemoryStore, slept: list[float]) -> FaultyTier:
    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    return FaultyTier(MemoryTier(backing), sleep=fake_sleep)


# -- errors: what a real tier raises --------------------------------------------------------------

@pytest.mark.parametrize(("code", "expected"), [
    (errno.ENOSPC, StorageFull),
    (errno.EDQUOT, StorageFull),
    (errno.EFBIG, StorageFull),
    (errno.EIO, TierUnavailable),
    (errno.ESTALE, TierUnavailable),
    (errno.ETIMEDOUT, TierUnavailable),
    (errno.ENOTCONN, TierUnavailable),
    (errno.ENOENT, ChunkNotFound),
    (errno.EACCES, BackendError),
])
async def test_errno_maps_like_the_posix_tier(tier: FaultyTier, code: int, expected: type[BackendError]) -> None:
    digest = await store(tier, "k")
    tier.inject(Fault("read", error=code))
    with pytest.raises(BackendError) as caught:
        await tier.read(digest, 0, 10)
    assert type(caught.value) is expected
    cause = caught.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == code


async def test_timeout_maps_like_the_s3_tier(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    tier.inject(Fault("stat", error=TimeoutError))
    with pytest.raises(TierUnavailable) as caught:
        await tier.stat(digest)
    assert isinstance(caught.value.__cause__, TimeoutError)


async def test_backend_errors_are_raised_as_given(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    given = ChunkCorrupt("bad footer", location="here")
    tier.inject(Fault("stat", error=given, times=1))
    tier.inject(Fault("read", error=ChunkCorrupt))
    with pytest.raises(ChunkCorrupt) as caught:
        await tier.stat(digest)
    assert caught.value is given
    with pytest.raises(ChunkCorrupt):
        await tier.read(digest, 0, 1)


# -- counting --------------------------------------------------------------------------------------

async def test_after_and_times_count_matching_calls(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    fault = tier.inject(Fault("read", error=errno.EIO, after=2, times=2))
    outcomes = []
    for _ in range(6):
        try:
            await tier.read(digest, 0, 4)
            outcomes.append("ok")
        except TierUnavailable:
            outcomes.append("EIO")
    assert outcomes == ["ok", "ok", "EIO", "EIO", "ok", "ok"]
    assert (fault.calls, fault.fired) == (6, 2)
    assert tier.calls["read"] == 6


async def test_without_times_a_fault_fires_until_cleared(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    fault = tier.inject(Fault("stat", error=errno.ESTALE))
    for _ in range(3):
        with pytest.raises(TierUnavailable):
            await tier.stat(digest)
    tier.clear()
    assert (await tier.stat(digest)).key == "k"
    assert fault.fired == 3


async def test_stream_fails_after_n_pieces(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    tier.inject(Fault("stream", error=errno.EIO, after=2, times=1))
    got: list[bytes] = []

    async def read_all() -> None:
        async for piece in tier.stream(digest, 0, len(DATA), 1000):
            got.append(bytes(piece))

    with pytest.raises(TierUnavailable):
        await read_all()
    assert got == [DATA[:1000], DATA[1000:2000]]
    assert b"".join([bytes(p) async for p in tier.stream(digest, 0, len(DATA), 1000)]) == DATA  # times=1: spent


async def test_scan_fails_after_n_entries(tier: FaultyTier) -> None:
    for i in range(4):
        await store(tier, f"k{i}")
    tier.inject(Fault("scan", error=errno.EIO, after=1))
    seen = []

    async def scan_all() -> None:
        async for digest, _ in tier.scan():
            seen.append(digest)

    with pytest.raises(TierUnavailable):
        await scan_all()
    assert len(seen) == 1


# -- matching --------------------------------------------------------------------------------------

async def test_rules_match_by_op_and_digest(tier: FaultyTier) -> None:
    a, b = await store(tier, "a"), await store(tier, "b")
    tier.inject(Fault(("read", "stat"), digest=a, error=errno.EIO))
    with pytest.raises(TierUnavailable):
        await tier.read(a, 0, 1)
    with pytest.raises(TierUnavailable):
        await tier.stat(a)
    assert bytes(await tier.read(b, 0, 3)) == DATA[:3]  # other digest
    assert (await tier.stat(b)).key == "b"
    assert [bytes(p) async for p in tier.stream(a, 0, 3, 10)] == [DATA[:3]]  # other op
    assert [m.key if m else None for m in await tier.stat_many([a, b])] == ["a", "b"]


async def test_stat_many_matches_a_digest_among_those_asked(tier: FaultyTier) -> None:
    a, b = await store(tier, "a"), await store(tier, "b")
    tier.inject(Fault("stat_many", digest=a, error=errno.EIO))
    assert len(await tier.stat_many([b])) == 1
    with pytest.raises(TierUnavailable):
        await tier.stat_many([b, a])


async def test_predicate_selects_calls(tier: FaultyTier) -> None:
    a, b = await store(tier, "a"), await store(tier, "b")
    fault = tier.inject(Fault("delete", error=errno.EIO, when=lambda op, digest: digest == b))
    assert await tier.delete(a) is True
    with pytest.raises(TierUnavailable):
        await tier.delete(b)
    assert (fault.calls, fault.fired) == (1, 1)  # the call about a did not match at all
    assert (await tier.stat(b)).key == "b"


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="pubish"):
        Fault("pubish", error=errno.ENOSPC)


# -- latency and hangs -----------------------------------------------------------------------------

async def test_latency_goes_through_the_injected_sleep(tier: FaultyTier, slept: list[float]) -> None:
    digest = await store(tier, "k")
    assert slept == []  # nothing injected: no sleep
    tier.inject(Fault("stat", delay=0.25, times=1))
    tier.inject(Fault("read", delay=1.5, error=errno.EIO, times=1))
    assert (await tier.stat(digest)).key == "k"  # slowed down, then served
    with pytest.raises(TierUnavailable):
        await tier.read(digest, 0, 1)  # slowed down, then failed
    assert slept == [0.25, 1.5]
    await tier.stat(digest)
    assert slept == [0.25, 1.5]


async def test_hang_blocks_until_released(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    gate = asyncio.Event()
    fault = tier.inject(Fault("read", hang=gate, digest=digest, times=1))
    reader = asyncio.create_task(tier.read(digest, 0, 5))
    await fault.triggered.wait()
    other = await store(tier, "other")  # the tier keeps serving everything else meanwhile
    assert bytes(await tier.read(other, 0, 5)) == DATA[:5]
    assert not reader.done()
    gate.set()
    assert bytes(await reader) == DATA[:5]


async def test_hang_then_error(tier: FaultyTier) -> None:
    digest = await store(tier, "k")
    gate = asyncio.Event()
    fault = tier.inject(Fault("stat", hang=gate, error=errno.ETIMEDOUT))
    caller = asyncio.create_task(tier.stat(digest))
    await fault.triggered.wait()
    assert not caller.done()
    gate.set()
    with pytest.raises(TierUnavailable):
        await caller


async def test_hang_is_cancellable_and_a_cancelled_write_leaves_nothing(tier: FaultyTier,
                                                                        backing: MemoryStore) -> None:
    digest = chunk_digest("kvcache", "slow")
    fault = tier.inject(Fault("publish", hang=asyncio.Event()))
    staged = await tier.stage(digest)
    await staged.write(DATA)
    publisher = asyncio.create_task(staged.publish(meta_for(DATA, "slow")))
    await fault.triggered.wait()
    publisher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publisher
    await staged.discard()  # what a cancelled caller does
    with pytest.raises(ChunkNotFound):
        await tier.stat(digest)
    assert backing.staging == set()


# -- a failed write leaves nothing visible ---------------------------------------------------------

async def test_failed_publish_leaves_nothing_visible(tier: FaultyTier, backing: MemoryStore) -> None:
    kept = await store(tier, "kept")
    before = await tier.usage()
    digest = chunk_digest("kvcache", "full")
    tier.inject(Fault("publish", error=errno.ENOSPC, times=1))
    staged = await tier.stage(digest)
    await staged.write(DATA)
    with pytest.raises(StorageFull):
        await staged.publish(meta_for(DATA, "full"))
    await staged.discard()  # what the service does after a failed publish: harmless
    with pytest.raises(ChunkNotFound):
        await tier.stat(digest)
    assert await tier.stat_many([digest]) == [None]
    assert [d async for d, _ in tier.scan()] == [kept]
    assert await tier.usage() == before
    assert backing.staging == set()  # the staged bytes were cleaned, as a real tier cleans them
    assert await tier.cleanup_staging(0) == 0
    assert await store(tier, "full") == digest  # the fault was spent: the same write now succeeds


async def test_failed_write_leaves_nothing_visible(tier: FaultyTier, backing: MemoryStore) -> None:
    kept = await store(tier, "kept")
    before = await tier.usage()
    digest = chunk_digest("kvcache", "full")
    fault = tier.inject(Fault("write", digest=digest, error=errno.ENOSPC, after=1))
    staged = await tier.stage(digest)
    await staged.write(DATA[:100])
    with pytest.raises(StorageFull):
        await staged.write(DATA[100:])
    with pytest.raises(ChunkNotFound):  # not visible even before the caller discards
        await tier.stat(digest)
    await staged.discard()
    assert fault.fired == 1
    assert await tier.stat_many([digest]) == [None]
    assert [d async for d, _ in tier.scan()] == [kept]
    assert await tier.usage() == before
    assert backing.staging == set()


async def test_failed_stage_creates_nothing(tier: FaultyTier, backing: MemoryStore) -> None:
    tier.inject(Fault("stage", error=errno.EIO))
    with pytest.raises(TierUnavailable):
        await tier.stage(chunk_digest("kvcache", "k"))
    assert backing.staging == set() and backing.chunks == {}


# -- the memory tier's staging ---------------------------------------------------------------------

async def test_cleanup_staging_ages_other_writers_by_the_injected_clock() -> None:
    now = [1000.0]
    shared = MemoryStore()
    mine, theirs = MemoryTier(shared, clock=lambda: now[0]), MemoryTier(shared, clock=lambda: now[0])
    own = await mine.stage(chunk_digest("kvcache", "own"))
    other = await theirs.stage(chunk_digest("kvcache", "other"))
    await other.write(b"x")
    assert await mine.cleanup_staging(60) == 0  # theirs is fresh
    now[0] += 61
    assert await mine.cleanup_staging(60) == 1  # theirs is idle: removed; mine never
    assert shared.staging == {own}
    with pytest.raises(BackendError):
        await other.publish(meta_for(b"x", "other"))  # its writer finds it gone
    await other.discard()
    orphan = await theirs.stage(chunk_digest("kvcache", "orphan"))
    await theirs.close()  # its writer is dead: its writes go whatever their age
    assert await mine.cleanup_staging(3600) == 1
    assert orphan not in shared.staging
