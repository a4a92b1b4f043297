"""S3 down or hung, in process (issue 12, items 1-4): the service's lookup rules, the mover's "never drop
the last reachable copy" rule and the lifecycle engine's wait, with both tiers as memory tiers behind
fault-injecting wrappers, over a real LMDB index and catalog, on an injected clock.

"Down" is every S3 operation failing with ``TierUnavailable``; "hung" is every S3 operation blocking on
an event the test never sets, so an answer that arrives at all arrived before the hung call returned.
The ``asyncio.timeout`` guards only turn a regression (waiting for ever) into a failure; nothing here
measures time. The same scenarios against real S3 servers: ``tests/integration/test_s3_outage.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from backends.base import ChunkMeta
from backends.catalog.store import BucketPolicy, Catalog
from backends.errors import TierUnavailable
from backends.faulty import OPS, Fault, FaultyTier
from backends.index import ChunkIndex
from backends.memory import MemoryStore, MemoryTier
from backends.s3_settings import S3TierSettings
from backends.tiers import TierId
from gateway.access import ANONYMOUS_ROOT, Directory
from gateway.config import Settings
from gateway.errors import ServiceUnavailable
from gateway.lifecycle.engine import LifecycleEngine
from gateway.lifecycle.ledgers import Ledgers
from gateway.mover import TierMover
from gateway.runtime import bootstrap, open_catalog
from gateway.service import ChunkService
from kvgw_client.keys import chunk_digest

NOW = 1_700_000_000.0
GUARD = 20.0  # seconds: only so that a regression fails instead of hanging the suite


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    service: ChunkService
    mover: TierMover
    engine: LifecycleEngine
    index: ChunkIndex
    fs: FaultyTier
    s3: FaultyTier
    fs_store: MemoryStore
    s3_store: MemoryStore
    catalog: Catalog
    directory: Directory
    clock: Clock

    async def bucket(self, name: str, **policy: object) -> BucketPolicy:
        self.catalog.create_bucket(BucketPolicy(name, 64 << 20, **policy))  # type: ignore[arg-type]
        self.directory.load()
        return await self.service.bucket(name)

    def s3_down(self) -> Fault:
        return self.s3.inject(Fault(tuple(OPS), error=TierUnavailable))

    def s3_hung(self) -> tuple[Fault, asyncio.Event]:
        """Every S3 call blocks until ``gate`` is set (tests assert before that), then fails."""
        gate = asyncio.Event()
        return self.s3.inject(Fault(tuple(OPS), hang=gate, error=TierUnavailable)), gate


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    for name in [n for n in os.environ if n.startswith("KVGW_")]:  # only what this test says counts
        monkeypatch.delenv(name)
    # The S3 settings only carry the request-path timeouts here (their defaults; connect_timeout, which
    # the real S3 tier's first call may add, kept small): the S3 tier itself is a memory tier behind
    # FaultyTier, which honours no budget, so the service's own deadline is what ends a hung call.
    settings = Settings(data_dir=tmp_path / "data", fsync=False, verify_reads=True,
                        s3=S3TierSettings(bucket="kvgw-outage-test", connect_timeout=0.01))
    catalog = open_catalog(settings)
    bootstrap(settings, catalog)
    directory = Directory(catalog, anonymous=ANONYMOUS_ROOT, refresh_seconds=3600)
    directory.load()
    index = ChunkIndex(tmp_path / "index")
    clock = Clock()
    fs_store, s3_store = MemoryStore(), MemoryStore()
    fs = FaultyTier(MemoryTier(fs_store, name="fs"))
    s3 = FaultyTier(MemoryTier(s3_store, name="s3"))
    tiers = {TierId.FS: fs, TierId.S3: s3}
    ledgers = Ledgers(directory, index)
    mover = TierMover(index, tiers, events=ledgers, clock=clock)
    service = ChunkService(settings, directory, index, tiers, mover=mover, events=ledgers, clock=clock)
    engine = LifecycleEngine(index, directory, mover, ledgers, clock=clock, interval=3600.0)
    try:
        yield Rig(service, mover, engine, index, fs, s3, fs_store, s3_store, catalog, directory, clock)
    finally:
        s3.clear()
        await service.close()
        await index.flush()
        index.close()
        catalog.close()


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


async def body_of(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 4096):
        yield data[i : i + 4096]


async def put(rig: Rig, bucket: BucketPolicy, key: str, data: bytes) -> bool:
    """What the PUT handlers do: the pre-write lookup, then the write if the key is free."""
    if await rig.service.lookup_for_write(bucket, key) is not None:
        return False
    result = await rig.service.put(bucket, key, body_of(data), length=len(data),
                                   checksum=xxhash.xxh3_64_intdigest(data))
    return result.created


async def get(rig: Rig, bucket: BucketPolicy, key: str) -> bytes:
    body = await rig.service.open(bucket, key)
    try:
        return b"".join([bytes(piece) async for piece in body])
    finally:
        await body.close()


async def in_s3_only(rig: Rig, bucket: BucketPolicy, key: str, data: bytes) -> None:
    """A chunk whose only copy is in S3 (written, then demoted while S3 was up)."""
    assert await put(rig, bucket, key, data)
    digest = chunk_digest(bucket.name, key)
    entry = rig.index.get(digest)
    assert entry is not None
    await rig.mover.demote(digest, entry)
    assert rig.index.get(digest) is not None and rig.index.get(digest).tiers == TierId.S3  # type: ignore[union-attr]


async def s3_holds(rig: Rig, bucket: str, key: str, data: bytes, *, expires: float = 0.0) -> None:
    """Bytes under the key in S3 that this gateway's index never saw (another gateway wrote them)."""
    digest = chunk_digest(bucket, key)
    staged = await rig.s3.inner.stage(digest)
    await staged.write(data)
    meta = ChunkMeta(bucket, key, len(data), xxhash.xxh3_64_intdigest(data), NOW - 100, expires)
    assert await staged.publish(meta)


# -- item 1: writes to an fs-tier bucket do not need S3 ------------------------------------------


@pytest.mark.parametrize("outage", ["down", "hung"])
async def test_put_of_a_new_key_needs_no_s3(rig: Rig, outage: str) -> None:
    bucket = await rig.service.bucket("kvcache")
    fault = rig.s3_down() if outage == "down" else rig.s3_hung()[0]
    async with asyncio.timeout(GUARD):
        assert await put(rig, bucket, "new", blob(3000)) is True
        assert await put(rig, bucket, "new", blob(3000, seed=1)) is False  # write-once, decided by the fs tier
        assert await get(rig, bucket, "new") == blob(3000)
    assert fault.fired >= 1  # S3 was asked (a miss falls through to it) and could not answer
    entry = rig.index.get(chunk_digest("kvcache", "new"))
    assert entry is not None and entry.tiers == TierId.FS


async def test_put_to_an_s3_tier_bucket_still_needs_s3(rig: Rig) -> None:
    bucket = await rig.bucket("remote", write_tier="s3")
    rig.s3_down()
    with pytest.raises(ServiceUnavailable):
        await rig.service.lookup_for_write(bucket, "new")  # the write tier itself cannot answer


async def test_put_over_an_s3_only_chunk_while_s3_is_down_keeps_the_indexed_chunk(rig: Rig) -> None:
    """The index says S3 holds the key and S3 cannot be asked: the write reports the indexed chunk
    (write-once), it does not store a second one."""
    bucket = await rig.service.bucket("kvcache")
    await in_s3_only(rig, bucket, "cold", blob(2000))
    rig.s3_down()
    existing = await rig.service.lookup_for_write(bucket, "cold")
    assert existing is not None and existing.checksum == xxhash.xxh3_64_intdigest(blob(2000))
    assert chunk_digest("kvcache", "cold") not in rig.fs_store.chunks


@pytest.mark.parametrize("move", ["demote", "replicate"])
async def test_a_write_made_while_s3_was_down_yields_to_the_chunk_s3_already_held(rig: Rig, move: str) -> None:
    """Reconciliation (``gateway.mover``): S3 held a live chunk under the key that this index never saw;
    the write during the outage was decided by the fs tier alone. When the fs copy reaches S3, the
    chunk S3 already held is the first write and stays; the index adopts it and the fs copy goes."""
    bucket = await rig.bucket("shared", write_through=move == "replicate")
    first, second = blob(2000, seed=1), blob(2500, seed=2)
    await s3_holds(rig, "shared", "k", first)
    fault = rig.s3_down()
    assert await put(rig, bucket, "k", second) is True
    assert await get(rig, bucket, "k") == second  # provisional: what this gateway could decide alone
    rig.s3.clear()
    digest = chunk_digest("shared", "k")
    if move == "demote":
        entry = rig.index.get(digest)
        assert entry is not None
        await rig.mover.demote(digest, entry)
    else:
        assert await rig.mover.replicate(digest) is True
    assert fault.fired >= 1
    entry = rig.index.get(digest)
    assert entry is not None
    assert (entry.tiers, entry.size, entry.checksum) == (TierId.S3, len(first), xxhash.xxh3_64_intdigest(first))
    assert digest not in rig.fs_store.chunks
    assert rig.s3_store.chunks[digest].data == first  # never overwritten
    assert await get(rig, bucket, "k") == first
    assert rig.index.pending_count() == 0


async def test_an_expired_s3_leftover_is_replaced_by_the_fs_copy(rig: Rig) -> None:
    bucket = await rig.service.bucket("kvcache")
    await s3_holds(rig, "kvcache", "k", blob(100, seed=1), expires=NOW - 1)
    assert await put(rig, bucket, "k", blob(200, seed=2)) is True  # S3's copy is expired: absent
    digest = chunk_digest("kvcache", "k")
    entry = rig.index.get(digest)
    assert entry is not None
    await rig.mover.demote(digest, entry)
    assert rig.s3_store.chunks[digest].data == blob(200, seed=2)
    assert await get(rig, bucket, "k") == blob(200, seed=2)


# -- item 2: a hung S3 does not stall the request path ---------------------------------------


async def test_lookups_answer_while_s3_hangs(rig: Rig) -> None:
    bucket = await rig.service.bucket("kvcache")
    assert await put(rig, bucket, "known", blob(1000))
    fault, gate = rig.s3_hung()
    async with asyncio.timeout(GUARD):
        assert await rig.service.exists(bucket, ["known", "unknown"]) == [True, False]  # non-strict: absent
        assert await rig.service.prefix(bucket, ["known", "unknown"]) == 1
        with pytest.raises(ServiceUnavailable):  # strict (HEAD, GET): S3 might hold it
            await rig.service.lookup(bucket, "unknown")
        found = await rig.service.open_many(bucket, ["known", "unknown"])
        assert [info is not None for info in found] == [True, False]
    assert fault.fired >= 4 and not gate.is_set()  # every answer came while S3 was hanging


async def test_an_s3_only_read_while_s3_is_down_is_unavailable_and_keeps_the_chunk(rig: Rig) -> None:
    bucket = await rig.service.bucket("kvcache")
    await in_s3_only(rig, bucket, "cold", blob(2000))
    rig.s3_down()
    with pytest.raises(ServiceUnavailable):
        await get(rig, bucket, "cold")
    rig.s3.clear()
    assert await get(rig, bucket, "cold") == blob(2000)


# -- item 4: never drop the last reachable copy ------------------------------------------------


async def replicated(rig: Rig, bucket: BucketPolicy, keys: list[str], size: int = 1000) -> None:
    """Chunks written to the fs tier of a write-through bucket, and copied to S3 (as the engine does)."""
    for i, key in enumerate(keys):
        rig.clock.now += 1
        assert await put(rig, bucket, key, blob(size, seed=i))
    for digest, _, _ in rig.index.pending():
        assert await rig.mover.replicate(digest)
    for key in keys:
        entry = rig.index.get(chunk_digest(bucket.name, key))
        assert entry is not None and entry.tiers == TierId.FS | TierId.S3


@pytest.mark.parametrize("outage", ["down", "hung"])
async def test_demote_never_drops_the_fs_copy_while_s3_cannot_confirm_its_copy(rig: Rig, outage: str) -> None:
    bucket = await rig.bucket("wt", write_through=True)
    await replicated(rig, bucket, ["a"])
    digest = chunk_digest("wt", "a")
    entry = rig.index.get(digest)
    assert entry is not None
    if outage == "down":
        rig.s3_down()
        with pytest.raises(TierUnavailable):
            await rig.mover.demote(digest, entry)
    else:
        fault, _ = rig.s3_hung()
        demotion = asyncio.ensure_future(rig.mover.demote(digest, entry))
        async with asyncio.timeout(GUARD):
            await fault.triggered.wait()  # the demotion is waiting on S3...
        assert digest in rig.fs_store.chunks  # ...and has not deleted anything meanwhile
        demotion.cancel()
        with pytest.raises(asyncio.CancelledError):
            await demotion
    assert digest in rig.fs_store.chunks
    assert rig.index.get(digest) == entry


async def test_drop_of_a_copy_whose_twin_is_unreachable_changes_nothing(rig: Rig) -> None:
    bucket = await rig.bucket("wt", write_through=True)
    await replicated(rig, bucket, ["a"])
    digest = chunk_digest("wt", "a")
    entry = rig.index.get(digest)
    assert entry is not None
    rig.s3_down()
    with pytest.raises(TierUnavailable):
        await rig.mover.drop(digest, entry, TierId.FS)
    assert digest in rig.fs_store.chunks and rig.index.get(digest) == entry
    assert await get(rig, bucket, "a") == blob(1000)


async def test_drop_whose_twin_vanished_drops_the_chunk_as_a_last_copy(rig: Rig) -> None:
    """The index said S3 held a copy, S3 answers that it does not: the fs copy was the last one, so
    dropping it removes the chunk (bytes, then the entry), never leaving an entry that points nowhere."""
    bucket = await rig.bucket("wt", write_through=True)
    await replicated(rig, bucket, ["a"])
    digest = chunk_digest("wt", "a")
    entry = rig.index.get(digest)
    assert entry is not None
    del rig.s3_store.chunks[digest]
    await rig.mover.drop(digest, entry, TierId.FS)
    assert digest not in rig.fs_store.chunks and rig.index.get(digest) is None


@pytest.mark.parametrize("outage", ["down", "hung"])
async def test_engine_over_the_watermark_waits_for_s3_and_says_why(rig: Rig, outage: str) -> None:
    """Every chunk has an S3 copy (write-through), S3 is unreachable and the fs tier is over its
    watermark: eviction would demote, so it waits; nothing is deleted, every chunk stays readable,
    and the engine says why usage stays over the watermark."""
    bucket = await rig.bucket("full", write_through=True, capacity_bytes=10_000, eviction_policy="lru")
    keys = [f"c{i}" for i in range(10)]
    await replicated(rig, bucket, keys, size=1000)  # 10,000 bytes in a 10,000-byte bucket: over 0.9
    if outage == "down":
        rig.s3_down()
        report = await rig.engine.run_pass()
    else:
        fault, gate = rig.s3_hung()
        passing = asyncio.ensure_future(rig.engine.run_pass())
        async with asyncio.timeout(GUARD):
            await fault.triggered.wait()
        assert all(chunk_digest("full", k) in rig.fs_store.chunks for k in keys)  # waiting, not deleting
        rig.s3_down()
        gate.set()  # the hung calls now fail, and S3 stays unreachable
        report = await passing
    assert report.demoted == 0 and report.evicted == 0 and report.waiting_for_s3
    assert all(chunk_digest("full", k) in rig.fs_store.chunks for k in keys)
    assert "S3 unreachable" in rig.engine.waiting["full"]
    async with asyncio.timeout(GUARD):
        assert [await get(rig, bucket, k) for k in keys] == [blob(1000, seed=i) for i in range(10)]
    rig.s3.clear()  # S3 back: the next pass demotes and the reason goes
    rig.clock.now += 3600
    report = await rig.engine.run_pass()
    assert report.demoted >= 2 and "full" not in rig.engine.waiting
