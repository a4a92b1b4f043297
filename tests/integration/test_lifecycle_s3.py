"""Tiering with real S3 servers: demotion, promotion, write-through, S3 outages; every test runs against
moto over HTTP (or ``KVGW_TEST_S3_ENDPOINT``) and against Ceph RGW (``tests/rgw``)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.catalog.store import BucketPolicy
from backends.tiers import TierId
from gateway.config import load_settings
from gateway.errors import ServiceUnavailable
from gateway.runtime import Gateway
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess, wait_for_async
from tests.integration.test_lifecycle_fs import start
from tests.rgw.fixtures import S3_SERVERS, STOPPABLE_S3, s3_endpoint_of, stoppable_s3_of
from tests.s3server import S3Endpoint


class Clock:
    def __init__(self) -> None:
        self.now = 2_000_000.0

    def __call__(self) -> float:
        return self.now


def make_gateway(tmp_path: Path, s3: Any, clock: Clock, name: str = "data") -> Gateway:
    settings = load_settings(data_dir=tmp_path / name, lifecycle_interval=3600.0, fsync=False, s3=s3)
    gw = Gateway(settings, clock=clock)
    return gw


@pytest.fixture(params=S3_SERVERS)
def s3_endpoint(request: pytest.FixtureRequest) -> S3Endpoint:
    """Here ``s3_endpoint`` (and ``s3_bucket`` on it) is each S3 server in turn."""
    return s3_endpoint_of(request, request.param)


@pytest.fixture(params=STOPPABLE_S3)
def outage_s3(request: pytest.FixtureRequest) -> S3Endpoint:
    """A server the test may pause, stop and start (private moto, or radosgw), bucket ``kvgw-private``."""
    return stoppable_s3_of(request, request.param)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def s3_settings(s3_endpoint: S3Endpoint, s3_bucket: str) -> Any:
    return s3_endpoint.settings(s3_bucket, breaker_cooldown=0.5, operation_timeout=5.0)


@pytest.fixture
async def gateway(tmp_path: Path, s3_settings: Any, clock: Clock) -> AsyncIterator[Gateway]:
    gw = make_gateway(tmp_path, s3_settings, clock)
    await start(gw)  # the new index's resync and usage recount done before the test writes
    yield gw
    await gw.stop()
    gw.close()


async def body(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 65536):
        yield data[i : i + 65536]


async def put(gw: Gateway, bucket: BucketPolicy, key: str, data: bytes, **kw: Any) -> None:
    assert (await gw.service.put(bucket, key, body(data), length=len(data), **kw)).created


async def get(gw: Gateway, bucket: BucketPolicy, key: str) -> bytes:
    chunk = await gw.service.open(bucket, key)
    try:
        return b"".join([bytes(p) async for p in chunk])
    finally:
        await chunk.close()


def placed(gw: Gateway, bucket: str, key: str) -> int:
    entry = gw.index.get(chunk_digest(bucket, key))
    return 0 if entry is None else entry.tiers


def in_s3(endpoint: S3Endpoint, s3_bucket: str, bucket: str, key: str) -> bool:
    name = f"chunks/{chunk_digest(bucket, key).hex()}"  # the chunk object (a manifest: its data beside it)
    listing = endpoint.admin().list_objects_v2(Bucket=s3_bucket, Prefix=name)
    return name in [o["Key"] for o in listing.get("Contents", [])]


def on_disk(gw: Gateway, bucket: str, key: str) -> bool:
    return os.path.exists(gw.fs.path_for(chunk_digest(bucket, key)))


async def make_bucket(gw: Gateway, name: str, **policy: Any) -> BucketPolicy:
    bucket = BucketPolicy(name, 64 << 20, **policy)
    gw.catalog.create_bucket(bucket)
    gw.directory.load()
    return bucket


async def test_demotion_then_promotion_on_read(gateway: Gateway, clock: Clock, s3_endpoint: S3Endpoint,
                                               s3_bucket: str) -> None:
    bucket = await make_bucket(gateway, "tiered", capacity_bytes=10 * 100_000, eviction_policy="lru")
    blobs = {f"k{i}": os.urandom(100_000) for i in range(10)}
    for key, data in blobs.items():
        clock.now += 1
        await put(gateway, bucket, key, data)
    report = await gateway.lifecycle.run_pass()
    assert report.demoted == 2 and report.evicted == 0
    for key in ("k0", "k1"):  # the two least recently used went to S3, bytes verified, local copy gone
        assert placed(gateway, "tiered", key) == TierId.S3
        assert not on_disk(gateway, "tiered", key)
        assert in_s3(s3_endpoint, s3_bucket, "tiered", key)
    assert placed(gateway, "tiered", "k2") == TierId.FS and on_disk(gateway, "tiered", "k2")
    # a read of an S3-only chunk copies it back first, then serves it from the filesystem tier
    assert await get(gateway, bucket, "k0") == blobs["k0"]
    assert placed(gateway, "tiered", "k0") == TierId.FS | TierId.S3
    assert on_disk(gateway, "tiered", "k0")
    assert gateway.mover.moved_bytes["s3->fs"] == 100_000
    assert gateway.mover.moved_bytes["fs->s3"] == 200_000


async def test_concurrent_reads_of_a_cold_chunk_fetch_it_once(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway, "cold", capacity_bytes=1_000_000, eviction_policy="lru")
    data = os.urandom(3 << 20)
    await put(gateway, bucket, "cold", data)
    entry = gateway.index.get(chunk_digest("cold", "cold"))
    assert entry is not None
    await gateway.mover.demote(chunk_digest("cold", "cold"), entry)
    assert placed(gateway, "cold", "cold") == TierId.S3
    results = await asyncio.gather(*(get(gateway, bucket, "cold") for _ in range(12)))
    assert all(r == data for r in results)
    assert gateway.mover.promotions == 1
    assert gateway.mover.moved_bytes["s3->fs"] == len(data)


async def test_prefetch_stages_s3_chunks_ahead_of_reads(gateway: Gateway) -> None:
    bucket = await make_bucket(gateway, "pf")
    keys = [f"p{i}" for i in range(4)]
    for key in keys:
        await put(gateway, bucket, key, key.encode() * 1000)
        entry = gateway.index.get(chunk_digest("pf", key))
        assert entry is not None
        await gateway.mover.demote(chunk_digest("pf", key), entry)
    result = await gateway.service.prefetch(bucket, [*keys, "absent"])
    assert (result.accepted, result.local, result.missing) == (4, 0, 1)
    # a promotion is done when the index records the copy (after publishing it, the mover checks
    # that the S3 copy was not deleted meanwhile)
    await wait_for_async(lambda: all(placed(gateway, "pf", k) == TierId.FS | TierId.S3 for k in keys),
                         "prefetched chunks indexed in both tiers")
    assert all(on_disk(gateway, "pf", k) for k in keys)
    again = await gateway.service.prefetch(bucket, keys)
    assert again.local == 4 and again.accepted == 0


async def test_locate_gives_file_paths_only_for_filesystem_copies(gateway: Gateway) -> None:
    bucket = await make_bucket(gateway, "loc")
    await put(gateway, bucket, "local", b"l" * 1000)
    await put(gateway, bucket, "remote", b"r" * 2000)
    entry = gateway.index.get(chunk_digest("loc", "remote"))
    assert entry is not None
    await gateway.mover.demote(chunk_digest("loc", "remote"), entry)
    local, remote, absent = await gateway.service.locate(bucket, ["local", "remote", "absent"])
    assert absent is None
    assert local is not None and local.path is not None and local.info.size == 1000
    assert str(gateway.fs.root / local.path) == gateway.fs.path_for(chunk_digest("loc", "local"))
    # S3 only: no path, the client reads it through batch-get (which promotes it)
    assert remote is not None and remote.path is None and remote.info.size == 2000


async def test_write_tier_s3(gateway: Gateway, s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    bucket = await make_bucket(gateway, "direct", write_tier="s3")
    data = os.urandom(20 << 20)  # above the S3 tier's part size: a multipart upload
    await put(gateway, bucket, "big", data)
    assert placed(gateway, "direct", "big") == TierId.S3
    assert not on_disk(gateway, "direct", "big")
    assert in_s3(s3_endpoint, s3_bucket, "direct", "big")
    assert await get(gateway, bucket, "big") == data


async def test_the_leader_removes_the_orphans_a_dead_s3_writer_leaves(
    tmp_path: Path, s3_settings: Any, s3_endpoint: S3Endpoint, s3_bucket: str, clock: Clock
) -> None:
    """A writer that died between its data object and its manifest leaves an object no reader sees; the
    gateway's lifecycle leader lists the tier every ``s3_staging_cleanup_seconds`` and removes such
    objects once older than ``staging_max_age_seconds``, leaving published chunks alone."""
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False, s3=s3_settings,
                             staging_max_age_seconds=0.0, s3_staging_cleanup_seconds=0.1)
    gw = Gateway(settings, clock=clock)
    await start(gw)
    try:
        bucket = await make_bucket(gw, "orphans", write_tier="s3")
        data = os.urandom(20 << 20)  # a multipart upload: a data object beside its manifest
        await put(gw, bucket, "kept", data)
        tier: Any = gw.tiers[TierId.S3]
        orphan = tier.data_key(tier.key_for(chunk_digest("orphans", "died")), "ab" * 16)
        admin = s3_endpoint.admin()
        admin.put_object(Bucket=s3_bucket, Key=orphan, Body=b"o" * 100)

        def listed() -> set[str]:
            return {o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket).get("Contents", [])}

        await wait_for_async(lambda: orphan not in listed(), "the orphaned data object removed")
        assert in_s3(s3_endpoint, s3_bucket, "orphans", "kept")
        assert await get(gw, bucket, "kept") == data
    finally:
        await gw.stop()
        gw.close()


async def test_write_through_queue_is_bounded(gateway: Gateway) -> None:
    bucket = await make_bucket(gateway, "bounded", write_through=True)
    gateway.settings.write_through_max_pending = 3
    for i in range(5):
        await put(gateway, bucket, f"b{i}", b"z" * 100)
    assert gateway.index.pending_count() == 3
    assert gateway.service.write_through_skipped == 2
    await gateway.lifecycle.run_pass()
    assert gateway.index.pending_count() == 0
    assert [placed(gateway, "bounded", f"b{i}") for i in range(5)] == [TierId.FS | TierId.S3] * 3 + [TierId.FS] * 2


async def test_ttl_reclaims_s3_copies_too(gateway: Gateway, clock: Clock, s3_endpoint: S3Endpoint,
                                          s3_bucket: str) -> None:
    bucket = await make_bucket(gateway, "ttl", write_through=True)
    await put(gateway, bucket, "t", b"x" * 1000, ttl=10)
    await gateway.lifecycle.run_pass()
    assert placed(gateway, "ttl", "t") == TierId.FS | TierId.S3
    clock.now += 11
    report = await gateway.lifecycle.run_pass()
    assert report.expired == 1
    assert not on_disk(gateway, "ttl", "t") and not in_s3(s3_endpoint, s3_bucket, "ttl", "t")


async def test_s3_tier_capacity_evicts_from_s3(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway, "s3cap", write_tier="s3", s3_capacity_bytes=5000, eviction_policy="fifo")
    for i in range(5):
        clock.now += 1
        await put(gateway, bucket, f"s{i}", b"y" * 1000)
    report = await gateway.lifecycle.run_pass()
    assert report.evicted == 1
    assert await gateway.service.lookup(bucket, "s0") is None
    assert await gateway.service.lookup(bucket, "s1") is not None


async def test_write_through_survives_an_outage_and_a_restart(
    tmp_path: Path, outage_s3: S3Endpoint, clock: Clock
) -> None:
    """Write-through queued while S3 is down waits (on disk), survives a gateway restart, then runs."""
    assert outage_s3.server is not None
    s3 = outage_s3.settings("kvgw-private", breaker_cooldown=0.2, operation_timeout=2.0, connect_timeout=0.5,
                              max_attempts=1)
    gw = make_gateway(tmp_path, s3, clock)
    await gw.start()
    bucket = await make_bucket(gw, "wt", write_through=True)
    data = {f"w{i}": os.urandom(50_000) for i in range(5)}
    outage_s3.server.pause()  # S3 unreachable: connections hang, every call hits its deadline
    try:
        for key, blob in data.items():
            await put(gw, bucket, key, blob)  # filesystem writes go on
        report = await gw.lifecycle.run_pass()
        assert report.waiting_for_s3 and report.replicated == 0
        assert gw.index.pending_count() == 5
        assert all([await get(gw, bucket, k) == v for k, v in data.items()])  # filesystem reads go on
    finally:
        outage_s3.server.resume()
    await gw.stop()
    gw.close()

    gw = make_gateway(tmp_path, s3, clock)
    await gw.start()
    try:
        assert gw.index.pending_count() == 5
        deadline = time.monotonic() + 20
        while gw.index.pending_count() and time.monotonic() < deadline:
            clock.now += 60
            await gw.lifecycle.run_pass()
            await asyncio.sleep(0.1)
        assert gw.index.pending_count() == 0
        assert all([placed(gw, "wt", k) == TierId.FS | TierId.S3 for k in data])
    finally:
        await gw.stop()
        gw.close()


async def test_s3_outage_fails_fast_and_loses_nothing(tmp_path: Path, outage_s3: S3Endpoint, clock: Clock) -> None:
    assert outage_s3.server is not None
    s3 = outage_s3.settings("kvgw-private", breaker_cooldown=1.0, operation_timeout=2.0, connect_timeout=0.5,
                              max_attempts=1)
    gw = make_gateway(tmp_path, s3, clock)
    await gw.start()
    try:
        bucket = await make_bucket(gw, "out", capacity_bytes=4 * 10_000, eviction_policy="lru")
        blobs = {f"o{i}": os.urandom(10_000) for i in range(4)}
        for key, blob in blobs.items():
            clock.now += 1
            await put(gw, bucket, key, blob)
        entry = gw.index.get(chunk_digest("out", "o0"))
        assert entry is not None
        await gw.mover.demote(chunk_digest("out", "o0"), entry)  # o0 now only in S3
        outage_s3.server.stop()  # connection refused from now on
        # reads of the S3-only chunk fail fast with 503
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(ServiceUnavailable):
                await gw.service.open(bucket, "o0")
        assert time.monotonic() - started < 5.0
        # filesystem-tier reads and writes go on
        assert await get(gw, bucket, "o1") == blobs["o1"]
        await put(gw, bucket, "o4", os.urandom(10_000))
        await put(gw, bucket, "o5", os.urandom(10_000))
        # over capacity, but demotion cannot run: nothing is deleted meanwhile
        report = await gw.lifecycle.run_pass()
        assert report.waiting_for_s3 and report.demoted == 0 and report.evicted == 0
        assert all(on_disk(gw, "out", k) for k in ("o1", "o2", "o3", "o4", "o5"))
    finally:
        await gw.stop()
        gw.close()


def test_sigkill_mid_demotion_then_every_chunk_readable(
    server_factory: type[ServerProcess], tmp_path: Path, s3_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    """A gateway demoting continuously is killed at random moments; after each restart every chunk
    reads back byte-exact from some tier."""
    env = {
        "KVGW_S3__ENDPOINT_URL": s3_endpoint.url, "KVGW_S3__BUCKET": s3_bucket,
        "KVGW_S3__ACCESS_KEY": s3_endpoint.access_key, "KVGW_S3__SECRET_KEY": s3_endpoint.secret_key,
        "KVGW_S3__ADDRESSING_STYLE": "path", "KVGW_S3__REGION": s3_endpoint.region,
        "KVGW_LIFECYCLE_INTERVAL": "0.02", "KVGW_LIFECYCLE_BUDGET": "4",
    }
    server = server_factory(data_dir=tmp_path / "data", env=env)
    from gateway.cli import main as kvgw

    server.data_dir.mkdir(parents=True)  # a bucket made before the first start: only `kvgw serve` makes the dir
    os.environ.update({"KVGW_ROOT_ACCESS_KEY": "x", "KVGW_ROOT_SECRET_KEY": "y"})
    try:
        assert kvgw(["bucket", "create", "churn", "--data-dir", str(server.data_dir),
                     "--capacity-bytes", str(3 * 200_000), "--eviction-policy", "lru"]) == 0
    finally:
        for k in ("KVGW_ROOT_ACCESS_KEY", "KVGW_ROOT_SECRET_KEY"):
            os.environ.pop(k, None)
    server.start()
    blobs: dict[str, bytes] = {}
    for round_ in range(4):
        with httpx.Client(headers=server.auth, timeout=30) as c:
            for i in range(8):
                key = f"r{round_}-{i}"
                blobs[key] = os.urandom(200_000)
                assert c.put(server.chunk_url(key, bucket="churn"), content=blobs[key]).status_code == 201
        time.sleep(0.05 * (round_ + 1))  # demotions are under way
        server.kill()
        server.start()
        with httpx.Client(headers=server.auth, timeout=30) as c:
            for key, blob in blobs.items():
                r = c.get(server.chunk_url(key, bucket="churn"))
                assert r.status_code == 200, (key, r.text)
                assert r.content == blob
    with httpx.Client(headers=server.auth, timeout=30) as c:
        stats = c.get(f"{server.url}/v1/admin/stats").json()
    assert stats["chunks_indexed"] == len(blobs)

