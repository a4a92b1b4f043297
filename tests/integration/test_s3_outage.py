"""S3 down or hung, against real S3 server processes (issue 12, items 1-4): moto killed with SIGKILL or
frozen with SIGSTOP, and Ceph RGW's radosgw stopped or paused (``outage_s3``: each in turn).

No stopwatch: "did not wait for S3" is proven by an answer that came while S3 was frozen (it never
answered anything), or before a call that runs on the background budgets against the same endpoint
returned. The latencies themselves are measured by ``kvgw bench s3-outage`` (BENCHMARKS.md). The same
rules in process, with a fault-injecting tier: ``tests/unit/test_s3_outage_service.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.catalog.store import BucketPolicy
from backends.errors import TierUnavailable
from backends.request_path import request_budget
from backends.s3 import S3Tier
from backends.tiers import TierId
from gateway.config import load_settings
from gateway.errors import ServiceUnavailable
from gateway.runtime import Gateway
from gateway.stats import gateway_stats
from kvgw_client.keys import chunk_digest
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, wait_for
from tests.rgw.fixtures import STOPPABLE_S3, stoppable_s3_of
from tests.s3server import S3Endpoint

PRIVATE = "kvgw-private"


class Clock:
    def __init__(self) -> None:
        self.now = 2_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=STOPPABLE_S3)
def outage_s3(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    """A server the test may pause, stop and start (private moto, or radosgw), bucket ``kvgw-private``;
    running and answering again afterwards."""
    endpoint = stoppable_s3_of(request, request.param)
    yield endpoint
    assert endpoint.server is not None
    endpoint.server.resume()


def outage(endpoint: S3Endpoint, how: str) -> None:
    assert endpoint.server is not None
    if how == "killed":
        endpoint.server.stop()  # moto: SIGKILL; radosgw: stopped. Connections are refused from now on
    else:
        endpoint.server.pause()  # SIGSTOP: connections are accepted by the kernel, never answered


async def body(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def put(gw: Gateway, bucket: BucketPolicy, key: str, data: bytes) -> bool:
    """What the PUT handlers do: the pre-write lookup, then the write if the key is free."""
    if await gw.service.lookup_for_write(bucket, key) is not None:
        return False
    return (await gw.service.put(bucket, key, body(data), length=len(data))).created


async def get(gw: Gateway, bucket: BucketPolicy, key: str) -> bytes:
    chunk = await gw.service.open(bucket, key)
    try:
        return b"".join([bytes(p) async for p in chunk])
    finally:
        await chunk.close()


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, endpoint: S3Endpoint, clock: Clock, **s3: Any) -> AsyncIterator[Gateway]:
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False,
                             s3=endpoint.settings(PRIVATE, **s3))
    gw = Gateway(settings, clock=clock)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()
        gw.close()


def s3_tier(gw: Gateway) -> S3Tier:
    tier = gw.tiers[TierId.S3]
    assert isinstance(tier, S3Tier)
    return tier


async def make_bucket(gw: Gateway, name: str, **policy: Any) -> BucketPolicy:
    gw.catalog.create_bucket(BucketPolicy(name, 64 << 20, **policy))
    gw.directory.load()
    return await gw.service.bucket(name)


def breaker_opens(state: Callable[[], str], lookup: Callable[[int], object]) -> bool:
    """Whether the breaker is open now or after a few more failing lookups (a reply received just before
    S3 froze may have reset the count of failures in a row)."""
    for i in range(10):
        if state() in ("open", "half-open"):
            return True
        lookup(i)
    return state() in ("open", "half-open")


# -- items 1 and 2 through the HTTP APIs of a real kvgw serve ---------------------------------------


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_new_writes_and_lookups_need_no_s3(server_factory: type[ServerProcess], tmp_path: Path,
                                           outage_s3: S3Endpoint, how: str) -> None:
    """With S3 dead or frozen, a PUT of a new key to a filesystem-tier bucket answers 201 (native) and
    200 (S3 PutObject), exists answers, reads of filesystem chunks go on; what only S3 could answer is
    503: a GET of a key the gateway does not know, a GET of an S3-only chunk."""
    env = {
        "KVGW_S3__ENDPOINT_URL": outage_s3.url, "KVGW_S3__BUCKET": PRIVATE,
        "KVGW_S3__ACCESS_KEY": outage_s3.access_key, "KVGW_S3__SECRET_KEY": outage_s3.secret_key,
        "KVGW_S3__ADDRESSING_STYLE": "path", "KVGW_S3__REGION": outage_s3.region,
        "KVGW_S3__LOOKUP_TIMEOUT": "1.0", "KVGW_S3__REQUEST_TIMEOUT": "2.0",  # roomy: S3 must answer first
        "KVGW_LIFECYCLE_INTERVAL": "3600",
    }
    server = server_factory(data_dir=tmp_path / "data", env=env)
    from gateway.cli import main as kvgw

    server.data_dir.mkdir(parents=True)  # a bucket made before the first start: only `kvgw serve` makes the dir
    os.environ.update({"KVGW_ROOT_ACCESS_KEY": "x", "KVGW_ROOT_SECRET_KEY": "y"})
    try:
        assert kvgw(["bucket", "create", "remote", "--data-dir", str(server.data_dir), "--write-tier", "s3"]) == 0
    finally:
        for k in ("KVGW_ROOT_ACCESS_KEY", "KVGW_ROOT_SECRET_KEY"):
            os.environ.pop(k, None)
    server.start()
    import boto3
    from botocore.config import Config

    s3_api = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1",
                          aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                          config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1},
                                        read_timeout=60))
    with httpx.Client(headers=server.auth, timeout=60) as c:
        assert c.put(server.chunk_url("warm"), content=b"w" * 1000).status_code == 201
        assert c.put(server.chunk_url("cold", bucket="remote"), content=b"c" * 1000).status_code == 201
        outage(outage_s3, how)
        try:
            put = c.put(server.chunk_url("new"), content=b"n" * 1000)
            assert put.status_code == 201, put.text
            assert c.put(server.chunk_url("new"), content=b"x" * 1000).status_code == 200  # write-once
            assert s3_api.put_object(Bucket="kvcache", Key="new-s3", Body=b"s" * 500)["ResponseMetadata"][
                "HTTPStatusCode"] == 200
            exists = c.post(f"{server.url}/v1/buckets/kvcache/exists", json={"keys": ["warm", "new", "unknown"]})
            assert exists.status_code == 200 and exists.json() == {"exists": [True, True, False]}
            assert c.get(server.chunk_url("new")).content == b"n" * 1000
            assert c.get(server.chunk_url("warm")).content == b"w" * 1000
            assert s3_api.get_object(Bucket="kvcache", Key="new-s3")["Body"].read() == b"s" * 500
            assert c.get(server.chunk_url("unknown")).status_code == 503  # S3 might hold it: no 404
            assert c.get(server.chunk_url("cold", bucket="remote")).status_code == 503
            assert c.put(server.chunk_url("new", bucket="remote"), content=b"r").status_code == 503  # S3's own
            assert breaker_opens(lambda: c.get(f"{server.url}/v1/admin/stats").json()["s3_breaker"],
                                 lambda i: c.post(f"{server.url}/v1/buckets/kvcache/exists",
                                                  json={"keys": [f"more-{i}"]}).raise_for_status())
            # every gateway shares S3: it stays ready (it serves the filesystem tier) and says S3 is down
            wait_for(lambda: c.get(f"{server.url}/readyz").json()["checks"]["s3"].startswith("down: "),
                     "readyz says s3: down")
            ready = c.get(f"{server.url}/readyz")
            assert ready.status_code == 200 and ready.json()["ready"] is True
            assert 'kvgw_readiness{check="s3",state="down"} 1.0' in c.get(f"{server.url}/metrics").text
        finally:
            assert outage_s3.server is not None
            outage_s3.server.resume()


# -- item 2 in process: answered before the hung call returned; the breaker opens -------------------


async def test_hung_s3_costs_lookups_their_deadline_and_opens_the_breaker(tmp_path: Path, outage_s3: S3Endpoint
                                                                          ) -> None:
    async with gateway(tmp_path, outage_s3, Clock(), operation_timeout=30.0, lookup_timeout=0.5,
                       request_timeout=1.0, breaker_threshold=5, breaker_cooldown=600.0) as gw:
        local = await gw.service.bucket("kvcache")
        remote = await make_bucket(gw, "remote", write_tier="s3")
        assert await put(gw, local, "warm", b"w" * 1000)
        assert await put(gw, remote, "cold", b"c" * 1000)
        tier = s3_tier(gw)
        outage(outage_s3, "hung")
        # a call on the background budget (no request path): hangs until its 30 s operation deadline
        background = asyncio.ensure_future(tier.stat(chunk_digest("remote", "cold")))
        await asyncio.sleep(0)
        assert await gw.service.exists(local, ["warm", "unknown"]) == [True, False]
        with pytest.raises(ServiceUnavailable):
            await gw.service.lookup(local, "unknown")
        assert await put(gw, local, "new", b"n" * 1000)
        with pytest.raises(ServiceUnavailable):
            await get(gw, remote, "cold")
        assert not background.done()  # everything above answered while S3 kept that call hanging
        for i in range(10):  # timeouts trip it: 6 calls ran out of time above (unless a reply the gateway
            if tier.breaker_state == "open":  # had received just before the freeze reset the count)
                break
            assert await gw.service.exists(local, [f"more-{i}"]) == [False]
        assert tier.breaker_state == "open"
        with request_budget(0.5), pytest.raises(TierUnavailable, match="circuit open"):
            await tier.stat(chunk_digest("kvcache", "x"))  # fails fast: no network I/O
        assert await gw.service.exists(local, ["unknown"]) == [False]
        assert gateway_stats(gw)["s3_breaker"] == "open"
        background.cancel()
        with contextlib.suppress(asyncio.CancelledError, TierUnavailable):
            await background


# -- item 3: the first S3-only GET after S3 dies -------------------------------------------------


async def test_first_s3_only_get_after_s3_dies_is_503_before_a_background_retry_gives_up(
    tmp_path: Path, outage_s3: S3Endpoint
) -> None:
    """Refused connections: the request path makes its attempts milliseconds apart and answers 503;
    the same kind of call on the background budget (3 attempts, back-off from 2 s) is still retrying."""
    async with gateway(tmp_path, outage_s3, Clock(), max_attempts=3, retry_backoff=2.0, request_timeout=2.0,
                       request_max_attempts=2, request_retry_backoff=0.01, breaker_threshold=100) as gw:
        remote = await make_bucket(gw, "remote", write_tier="s3")
        assert await put(gw, remote, "cold", b"c" * 1000)
        tier = s3_tier(gw)
        outage(outage_s3, "killed")
        background = asyncio.ensure_future(tier.stat(chunk_digest("remote", "cold")))
        await asyncio.sleep(0)
        with pytest.raises(ServiceUnavailable):
            await get(gw, remote, "cold")
        assert not background.done()
        with pytest.raises(TierUnavailable):
            await background
        entry = gw.index.get(chunk_digest("remote", "cold"))
        assert entry is not None and entry.tiers == TierId.S3  # unreachable is not gone: the entry stays


# -- item 4: never drop the last reachable copy -------------------------------------------------


@pytest.mark.parametrize("how", ["killed", "hung"])
async def test_engine_keeps_fs_copies_whose_s3_copy_is_unreachable(tmp_path: Path, outage_s3: S3Endpoint,
                                                                    how: str) -> None:
    """Every chunk is in both tiers (write-through done); then the bucket is over its watermark and S3
    is unreachable: demotion would delete the fs copies, so the engine waits and says why, and every
    chunk stays readable. (Before: the engine trusted the index's S3 bit, deleted the fs copies, and
    the chunks answered 503 for the rest of the outage.)"""
    clock = Clock()
    async with gateway(tmp_path, outage_s3, clock, operation_timeout=2.0, max_attempts=1,
                       breaker_threshold=100) as gw:
        bucket = await make_bucket(gw, "wt", write_through=True, capacity_bytes=100_000, eviction_policy="lru")
        blobs = {f"c{i}": os.urandom(10_000) for i in range(8)}
        for key, data in blobs.items():
            clock.now += 1
            assert await put(gw, bucket, key, data)
        report = await gw.lifecycle.run_pass()
        assert report.replicated == 8 and report.demoted == 0
        assert all(gw.index.get(chunk_digest("wt", k)).tiers == TierId.FS | TierId.S3  # type: ignore[union-attr]
                   for k in blobs)
        gw.catalog.update_bucket(replace(bucket, capacity_bytes=60_000))  # now over its high watermark
        gw.directory.load()
        outage(outage_s3, how)
        clock.now += 60
        report = await gw.lifecycle.run_pass()
        assert report.demoted == 0 and report.evicted == 0 and report.waiting_for_s3
        assert all(Path(gw.fs.path_for(chunk_digest("wt", k))).is_file() for k in blobs)  # noqa: ASYNC240
        assert all([await get(gw, bucket, k) == v for k, v in blobs.items()])
        waiting = gateway_stats(gw)["lifecycle_waiting"]
        assert "S3 unreachable" in waiting["wt"], waiting
        assert outage_s3.server is not None
        outage_s3.server.resume()
        if how == "killed":
            outage_s3.server.start()
            with contextlib.suppress(Exception):  # moto comes back empty; radosgw kept its objects
                outage_s3.admin().create_bucket(Bucket=PRIVATE)
        clock.now += 3600  # past the engine's back-off: S3 is asked again, and demotion resumes
        report = await gw.lifecycle.run_pass()
        assert report.demoted >= 2 and "wt" not in gateway_stats(gw)["lifecycle_waiting"]
