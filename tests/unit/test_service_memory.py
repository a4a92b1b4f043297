"""The real ChunkService, in process, over a real LMDB index and catalog and a memory tier behind a
fault-injecting wrapper: write-once, failure translation and "nothing visible after a failed write",
in milliseconds and without a server or a disk tier; the filesystem tier in a temporary directory only
where a PUT takes part of its body from a threaded receive (a worker thread), which that tier alone allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import xxhash

from backends.base import Tier
from backends.catalog.store import BucketPolicy
from backends.faulty import Fault, FaultyTier
from backends.index import ChunkIndex
from backends.memory import MemoryStore, MemoryTier
from backends.posix import FOLIO_BYTES, PosixTier
from backends.tiers import TierId
from gateway.access import ANONYMOUS_ROOT, Directory
from gateway.chunks import ThreadedOutcome
from gateway.config import Settings
from gateway.errors import BadDigest, InsufficientStorage, InvalidRequest, NoSuchChunk, ServiceUnavailable
from gateway.runtime import bootstrap, open_catalog
from gateway.service import ChunkService
from kvgw_client.keys import chunk_digest

NOW = 1_700_000_000.0
WHOLE_READ_MAX = 64 * 1024  # chunks above this are verified and served by streaming


@dataclass
class Rig:
    service: ChunkService
    tier: FaultyTier
    store: MemoryStore
    index: ChunkIndex
    bucket: BucketPolicy


@contextlib.asynccontextmanager
async def service_over(tmp_path: Path, tier: Tier) -> AsyncIterator[tuple[ChunkService, ChunkIndex, BucketPolicy]]:
    """The real service over ``tier`` (its filesystem tier), a real index and catalog in ``tmp_path``."""
    settings = Settings(data_dir=tmp_path / "data", fsync=False, verify_reads=True,
                        whole_read_max_bytes=WHOLE_READ_MAX, read_window_bytes=16 * 1024)
    catalog = open_catalog(settings)
    bootstrap(settings, catalog)
    directory = Directory(catalog, anonymous=ANONYMOUS_ROOT, refresh_seconds=3600)
    directory.load()
    index = ChunkIndex(tmp_path / "index")
    service = ChunkService(settings, directory, index, {TierId.FS: tier}, clock=lambda: NOW)
    try:
        yield service, index, await service.bucket(settings.default_bucket)
    finally:
        await service.close()
        await index.flush()
        index.close()
        catalog.close()


@pytest.fixture(autouse=True)
def _only_this_tests_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVGW_")]:  # only what this test says counts
        monkeypatch.delenv(name)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    store = MemoryStore()
    tier = FaultyTier(MemoryTier(store, name="fs"))
    async with service_over(tmp_path, tier) as (service, index, bucket):
        yield Rig(service, tier, store, index, bucket)


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


async def body_of(data: bytes, piece: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(data), piece):
        yield data[i : i + piece]


async def put(rig: Rig, key: str, data: bytes) -> bool:
    result = await rig.service.put(rig.bucket, key, body_of(data), length=len(data),
                                   checksum=xxhash.xxh3_64_intdigest(data))
    return result.created


async def get(rig: Rig, key: str) -> bytes:
    body = await rig.service.open(rig.bucket, key)
    try:
        return b"".join([bytes(piece) async for piece in body])
    finally:
        await body.close()


@pytest.mark.parametrize("size", [1000, WHOLE_READ_MAX + 12345])  # read whole, and verified + streamed
async def test_put_then_get_round_trips(rig: Rig, size: int) -> None:
    data = blob(size, seed=size)
    assert await put(rig, "k", data) is True
    info = await rig.service.lookup(rig.bucket, "k")
    assert info is not None and (info.size, info.checksum) == (size, xxhash.xxh3_64_intdigest(data))
    assert await get(rig, "k") == data
    assert rig.store.chunks[chunk_digest(rig.bucket.name, "k")].data == data


async def test_second_put_reports_the_existing_chunk(rig: Rig) -> None:
    first, second = blob(2000, seed=1), blob(2000, seed=2)
    assert await put(rig, "once", first) is True
    result = await rig.service.put(rig.bucket, "once", body_of(second), length=len(second))
    assert result.created is False
    assert result.info.checksum == xxhash.xxh3_64_intdigest(first)
    assert await get(rig, "once") == first
    assert rig.store.staging == set()


@pytest.mark.parametrize("op", ["publish", "write"])
async def test_storage_full_is_insufficient_storage_and_stores_nothing(rig: Rig, op: str) -> None:
    fault = rig.tier.inject(Fault(op, error=errno.ENOSPC, times=1))
    with pytest.raises(InsufficientStorage):
        await put(rig, "full", blob(50_000))
    assert fault.fired == 1
    assert await rig.service.lookup(rig.bucket, "full") is None  # strict: the tier was asked, and has none
    assert rig.index.get(chunk_digest(rig.bucket.name, "full")) is None
    assert rig.store.chunks == {} and rig.store.staging == set()
    assert await rig.tier.usage() == 0
    assert await put(rig, "full", blob(50_000)) is True  # space again: the same write succeeds


@pytest.mark.parametrize(("size", "op"), [(1000, "read"), (WHOLE_READ_MAX + 1, "stream")])
async def test_read_eio_is_service_unavailable_and_keeps_the_chunk(rig: Rig, size: int, op: str) -> None:
    data = blob(size, seed=3)
    assert await put(rig, "flaky", data) is True
    digest = chunk_digest(rig.bucket.name, "flaky")
    fault = rig.tier.inject(Fault(op, digest=digest, error=errno.EIO))
    with pytest.raises(ServiceUnavailable):
        await get(rig, "flaky")
    assert fault.fired == 1
    # a transient tier failure is not damage: nothing quarantined, the index still points at the copy
    assert rig.store.quarantined == []
    entry = rig.index.get(digest)
    assert entry is not None and entry.tiers & TierId.FS
    rig.tier.clear()
    assert await get(rig, "flaky") == data


async def test_unreachable_tier_on_index_miss_is_service_unavailable(rig: Rig) -> None:
    rig.tier.inject(Fault("stat_many", error=errno.ESTALE))
    with pytest.raises(ServiceUnavailable):
        await rig.service.lookup(rig.bucket, "never-written")
    assert await rig.service.lookup(rig.bucket, "never-written", strict=False) is None


async def test_damaged_bytes_are_quarantined_never_served(rig: Rig) -> None:
    data = blob(1000, seed=4)
    assert await put(rig, "rotten", data) is True
    digest = chunk_digest(rig.bucket.name, "rotten")
    stored = rig.store.chunks[digest]
    rig.store.chunks[digest] = replace(stored, data=bytes([stored.data[0] ^ 1]) + stored.data[1:])
    with pytest.raises(NoSuchChunk):
        await get(rig, "rotten")
    assert [d for d, _ in rig.store.quarantined] == [digest]
    assert rig.store.chunks == {}
    assert await rig.service.lookup(rig.bucket, "rotten") is None


async def test_chunk_is_invisible_until_publish_completes(rig: Rig) -> None:
    gate = asyncio.Event()
    fault = rig.tier.inject(Fault("publish", hang=gate))
    writer = asyncio.create_task(put(rig, "slow", blob(3000)))
    await fault.triggered.wait()  # every byte is staged; the publish is stuck
    assert await rig.service.lookup(rig.bucket, "slow") is None
    assert await rig.service.exists(rig.bucket, ["slow"]) == [False]
    gate.set()
    assert await writer is True
    assert await get(rig, "slow") == blob(3000)


# -- threaded receives (gateway.chunks.ThreadedBody): leading pieces hashed and written in a worker thread --


class HalfThreaded:
    """A ``ThreadedBody`` that hands the first ``threaded`` bytes over from a worker thread, one reused
    buffer per piece (as the body intake does); the rest is left to the body's async iterator."""

    def __init__(self, data: bytes, threaded: int, piece: int) -> None:
        self.data, self.threaded, self.piece = data, threaded, piece
        self.calls = 0

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        self.calls += 1

        def run() -> None:
            buffer = bytearray(self.piece)
            for at in range(0, self.threaded, self.piece):
                piece = self.data[at:min(at + self.piece, self.threaded)]
                buffer[:len(piece)] = piece
                consume(memoryview(buffer)[:len(piece)])

        await asyncio.to_thread(run)
        return "slow" if self.threaded < len(self.data) else "complete"


@pytest.mark.parametrize("threaded", [0, FOLIO_BYTES, 3 * FOLIO_BYTES + 100], ids=["none", "part", "all"])
async def test_a_put_takes_the_pieces_a_threaded_receive_hands_it_then_the_rest(tmp_path: Path, threaded: int) -> None:
    data = blob(3 * FOLIO_BYTES + 100, seed=3)
    async with service_over(tmp_path, PosixTier(tmp_path / "fs", fsync=False)) as (service, _, bucket):
        source = HalfThreaded(data, threaded, FOLIO_BYTES)
        result = await service.put(bucket, "direct", body_of(data[threaded:], FOLIO_BYTES), length=len(data),
                                   checksum=xxhash.xxh3_64_intdigest(data), threaded=source)
        assert result.created and source.calls == 1
        body = await service.open(bucket, "direct")
        try:
            assert b"".join([bytes(piece) async for piece in body]) == data
        finally:
            await body.close()


async def test_a_threaded_receive_is_held_to_the_body_s_length_and_checksum(tmp_path: Path) -> None:
    data = blob(FOLIO_BYTES + 10, seed=4)
    async with service_over(tmp_path, PosixTier(tmp_path / "fs", fsync=False)) as (service, _, bucket):
        with pytest.raises(BadDigest):
            await service.put(bucket, "wrong", body_of(b""), length=len(data),
                              checksum=xxhash.xxh3_64_intdigest(data) ^ 1,
                              threaded=HalfThreaded(data, len(data), FOLIO_BYTES))
        with pytest.raises(InvalidRequest):
            await service.put(bucket, "long", body_of(b""), length=len(data) - 1,
                              threaded=HalfThreaded(data, len(data), FOLIO_BYTES))
        assert await service.lookup(bucket, "wrong") is None and await service.lookup(bucket, "long") is None
        assert not list((tmp_path / "fs").rglob("*.part"))  # nothing staged is left behind


async def test_a_tier_that_cannot_take_bytes_from_a_thread_gets_the_whole_body_from_the_loop(rig: Rig) -> None:
    data = blob(FOLIO_BYTES + 10, seed=5)
    source = HalfThreaded(data, FOLIO_BYTES, FOLIO_BYTES)
    result = await rig.service.put(rig.bucket, "loop", body_of(data), length=len(data), threaded=source)
    assert result.created and source.calls == 0
    assert await get(rig, "loop") == data
