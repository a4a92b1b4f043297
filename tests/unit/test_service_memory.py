"""The real ChunkService, in process, over a real LMDB index and catalog and a memory tier behind a
fault-injecting wrapper: write-once, failure translation and "nothing visible after a failed write",
in milliseconds and without a server or a disk tier.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import xxhash

from backends.catalog.store import BucketPolicy
from backends.faulty import Fault, FaultyTier
from backends.index import ChunkIndex
from backends.memory import MemoryStore, MemoryTier
from backends.tiers import TierId
from gateway.access import ANONYMOUS_ROOT, Directory
from gateway.config import Settings
from gateway.errors import InsufficientStorage, NoSuchChunk, ServiceUnavailable
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


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    for name in [n for n in os.environ if n.startswith("KVGW_")]:  # only what this test says counts
        monkeypatch.delenv(name)
    settings = Settings(data_dir=tmp_path / "data", fsync=False, verify_reads=True,
                        whole_read_max_bytes=WHOLE_READ_MAX, read_window_bytes=16 * 1024)
    catalog = open_catalog(settings)
    bootstrap(settings, catalog)
    directory = Directory(catalog, anonymous=ANONYMOUS_ROOT, refresh_seconds=3600)
    directory.load()
    index = ChunkIndex(tmp_path / "index")
    store = MemoryStore()
    tier = FaultyTier(MemoryTier(store, name="fs"))
    service = ChunkService(settings, directory, index, {TierId.FS: tier}, clock=lambda: NOW)
    try:
        yield Rig(service, tier, store, index, await service.bucket(settings.default_bucket))
    finally:
        await service.close()
        await index.flush()
        index.close()
        catalog.close()


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
