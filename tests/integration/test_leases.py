"""Read leases between lookup and load (``gateway.leases``), on the real LMDB index, filesystem tier and
SQLite catalog, with an injected clock: a leased chunk outlives the eviction pass that would have taken
it and loads; a lease runs out; a load ends it; the leased-bytes cap; TTL reclaim; a lookup that races a
removal. Through HTTP: the wire format and its errors. Across gateways: tests/integration/cluster."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet
from sqlalchemy import create_engine

from backends.catalog.store import BucketPolicy
from gateway.config import load_settings
from gateway.leases import LEASES, REMOVED, REMOVING, LeaseUnavailable
from gateway.runtime import Gateway
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess
from tests.integration.test_lifecycle_fs import Clock, body, on_disk, start

CHUNK = 1000


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "postgresql"])
async def gateway(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> AsyncIterator[Gateway]:
    """The embedded default (SQLite) and the cluster's catalog (PostgreSQL): the lease statements differ."""
    catalog: dict[str, Any] = {}
    if request.param == "postgresql":
        catalog = {"catalog_url": request.getfixturevalue("pg_url"), "catalog_key": Fernet.generate_key().decode()}
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False, **catalog)
    gw = Gateway(settings, clock=clock)
    await start(gw)
    yield gw
    await gw.stop()
    gw.close()


async def make_bucket(gw: Gateway, name: str = "lease", **policy: object) -> BucketPolicy:
    bucket = BucketPolicy(name, 1 << 20, capacity_bytes=10 * CHUNK, eviction_policy="fifo",
                          max_leased_bytes=5 * CHUNK)
    bucket = replace(bucket, **policy)  # type: ignore[arg-type]
    gw.catalog.create_bucket(bucket)
    gw.directory.load()
    return bucket


async def fill(gw: Gateway, clock: Clock, bucket: BucketPolicy, keys: list[str], **kw: object) -> None:
    for key in keys:
        clock.now += 1
        result = await gw.service.put(bucket, key, body(os.urandom(CHUNK)), length=CHUNK, **kw)  # type: ignore[arg-type]
        assert result.created


async def load(gw: Gateway, bucket: BucketPolicy, key: str) -> bytes:
    chunk = await gw.service.open(bucket, key)
    try:
        return b"".join([bytes(part) async for part in chunk])
    finally:
        await chunk.close()


async def test_a_leased_chunk_outlives_the_eviction_pass_and_loads(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway)
    keys = [f"k{i}" for i in range(10)]
    await fill(gateway, clock, bucket, keys)  # 10 000 bytes: over the high watermark (9 000)
    grant, absent = await gateway.service.lease(bucket, ["k0", "k1"], 5_000)  # fifo would take k0, k1 first
    assert grant.granted_ms == 5_000 and grant.leased == 2 and grant.leased_bytes == 2 * CHUNK and not absent
    report = await gateway.lifecycle.run_pass()
    assert report.evicted == 2 and report.leased == 2  # down to 8 000, around the leased two
    assert on_disk(gateway, "lease", "k0") and on_disk(gateway, "lease", "k1")
    assert not on_disk(gateway, "lease", "k2") and not on_disk(gateway, "lease", "k3")
    assert len(await load(gateway, bucket, "k0")) == CHUNK


async def test_a_lease_runs_out(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway)
    await fill(gateway, clock, bucket, [f"k{i}" for i in range(10)])
    await gateway.service.lease(bucket, ["k0"], 2_000)
    clock.now += 2.5  # the lease ended; nobody loaded
    report = await gateway.lifecycle.run_pass()
    assert report.leased == 0 and report.evicted == 2
    assert not on_disk(gateway, "lease", "k0")


async def test_a_load_ends_the_lease(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway)
    await fill(gateway, clock, bucket, [f"k{i}" for i in range(10)])
    await gateway.service.lease(bucket, ["k0"], 60_000)
    await load(gateway, bucket, "k0")
    assert await gateway.leases.release_loaded() == 1
    assert await gateway.leases.leased_bytes("lease") == 0
    report = await gateway.lifecycle.run_pass()
    assert report.leased == 0 and not on_disk(gateway, "lease", "k0")


async def test_the_lease_length_is_capped_by_the_bucket(gateway: Gateway) -> None:
    bucket = await make_bucket(gateway, max_lease_ms=1_500)
    grant, _ = await gateway.service.lease(bucket, [], 60_000)
    assert grant.granted_ms == 1_500
    off = await make_bucket(gateway, "off", max_lease_ms=0)
    grant, _ = await gateway.service.lease(off, [], 60_000)
    assert grant.granted_ms == 0 and grant.refused is not None and "max_lease_ms" in grant.refused


async def test_leased_bytes_are_capped_so_leases_cannot_starve_eviction(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway, max_leased_bytes=2 * CHUNK)
    await fill(gateway, clock, bucket, [f"k{i}" for i in range(10)])
    first, _ = await gateway.service.lease(bucket, ["k0", "k1"], 10_000)
    assert first.leased == 2
    again, _ = await gateway.service.lease(bucket, ["k1"], 10_000)  # re-leasing what is leased fits
    assert again.leased == 1 and again.refused is None
    past, absent = await gateway.service.lease(bucket, ["k2"], 10_000)
    assert past.granted_ms == 0 and past.leased == 0 and not absent
    assert past.refused is not None and "cap" in past.refused
    report = await gateway.lifecycle.run_pass()
    assert report.evicted == 2 and on_disk(gateway, "lease", "k0") and not on_disk(gateway, "lease", "k2")


async def test_the_default_cap_is_a_tenth_of_the_capacity(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway, max_leased_bytes=None)  # capacity 10 000: 1 000 leased at once
    await fill(gateway, clock, bucket, ["a", "b"])
    assert (await gateway.service.lease(bucket, ["a"], 1_000))[0].leased == 1
    assert (await gateway.service.lease(bucket, ["b"], 1_000))[0].refused is not None


async def test_ttl_reclaim_leaves_a_leased_chunk_for_its_load(gateway: Gateway, clock: Clock) -> None:
    bucket = await make_bucket(gateway, capacity_bytes=None)
    await fill(gateway, clock, bucket, ["t"], ttl=10)
    clock.now += 8  # 2 s before the TTL: a lookup leases it for 5 s
    await gateway.service.lease(bucket, ["t"], 5_000)
    clock.now += 3  # the TTL passed 1 s ago; the lease has 2 s left
    report = await gateway.lifecycle.run_pass()
    assert report.expired == 0 and report.leased == 1 and on_disk(gateway, "lease", "t")
    assert len(await load(gateway, bucket, "t")) == CHUNK  # the leased load is served
    await gateway.leases.release_loaded()
    assert await gateway.service.lookup(bucket, "t") is None  # others see the TTL
    report = await gateway.lifecycle.run_pass()
    assert report.expired == 1 and not on_disk(gateway, "lease", "t")


async def test_a_lookup_that_races_a_removal_answers_absent(gateway: Gateway, clock: Clock) -> None:
    """The lifecycle claimed the chunk (removing it now): the lease is not granted on it and the lookup
    answers it absent. Removed a moment ago: the lookup re-checks the tiers."""
    bucket = await make_bucket(gateway)
    await fill(gateway, clock, bucket, ["gone", "back", "kept"])
    digests = {k: chunk_digest("lease", k) for k in ("gone", "back", "kept")}
    assert await gateway.leases.claim("lease", [digests["gone"], digests["back"]]) == {digests["gone"],
                                                                                      digests["back"]}
    await gateway.leases.settle(removed=[digests["back"]])  # "back": removed, then written again
    await gateway.leases.sync()  # as every granting process learns of it (within a sync)
    with gateway.leases.engine.connect() as conn:
        kinds = dict(conn.execute(LEASES.select().with_only_columns(LEASES.c.digest, LEASES.c.kind)).all())
    assert kinds == {digests["gone"]: REMOVING, digests["back"]: REMOVED}
    grant, absent = await gateway.service.lease(bucket, ["gone", "back", "kept"], 1_000)
    assert absent == {"gone"}  # "back" is on disk: re-checked and leased
    assert grant.leased == 2 and grant.gone == {digests["gone"]} and grant.recheck == {digests["back"]}
    os.unlink(gateway.fs.path_for(digests["kept"]))  # a removal this index has not heard of
    await gateway.leases.claim("lease", [digests["kept"]])  # the lease on it holds: not claimed
    assert (await gateway.leases.claim("lease", [digests["kept"]])) == set()


async def test_a_lease_table_that_cannot_be_reached_refuses_the_lease(gateway: Gateway, clock: Clock,
                                                                      tmp_path: Path) -> None:
    """Leases are granted in memory while this process's last sync is recent (``fresh_seconds``); once it
    is older, lookups are answered without a lease, and the lifecycle removes nothing meanwhile."""
    bucket = await make_bucket(gateway)
    await fill(gateway, clock, bucket, ["a"])
    assert (await gateway.service.lease(bucket, ["a"], 1_000))[0].granted_ms  # takes its share of the cap
    working, local = gateway.leases.engine, gateway.leases.local
    gateway.leases.engine = create_engine(f"sqlite:///{tmp_path / 'no-such-dir' / 'catalog.sqlite'}")
    try:
        with pytest.raises(LeaseUnavailable):
            await gateway.leases.sync()
        recent, _ = await gateway.service.lease(bucket, ["a"], 1_000)  # the last sync is recent: in memory
        local.monotonic = lambda: time.monotonic() + local.fresh_seconds  # and now it is not
        grant, absent = await gateway.service.lease(bucket, ["a"], 1_000)
        with pytest.raises(LeaseUnavailable):
            await gateway.leases.claim("lease", [chunk_digest("lease", "a")])
    finally:
        gateway.leases.engine.dispose()
        gateway.leases.engine = working
        local.monotonic = time.monotonic
    assert recent.granted_ms == 1_000
    assert grant.granted_ms == 0 and grant.refused is not None and "unreachable" in grant.refused and not absent


# -- through HTTP ---------------------------------------------------------------------------------


def test_lookups_take_leases_over_http(server: ServerProcess, client: httpx.Client) -> None:
    assert client.put("/v1/buckets/kvcache/chunks/a", content=b"x" * 100).status_code == 201
    assert client.put("/v1/buckets/kvcache/chunks/b", content=b"y" * 50).status_code == 201
    keys = {"keys": ["a", "b", "c"], "lease_ms": 2_000}
    r = client.post("/v1/buckets/kvcache/prefix", json=keys)
    assert r.status_code == 200, r.text
    assert r.json() == {"length": 2, "lease": {"granted_ms": 2_000, "chunks": 2, "bytes": 150}}
    r = client.post("/v1/buckets/kvcache/exists", json=keys)
    assert r.json()["exists"] == [True, True, False] and r.json()["lease"]["chunks"] == 2
    r = client.post("/v1/buckets/kvcache/locate", json=keys)
    assert r.json()["lease"]["chunks"] == 2 and r.json()["chunks"][2] is None
    plain = client.post("/v1/buckets/kvcache/prefix", json={"keys": ["a"]})
    assert plain.json() == {"length": 1}  # no lease asked, none in the answer


@pytest.mark.parametrize("lease_ms", [-1, "10", 1.5, True, 600_001])
def test_a_malformed_lease_is_a_400(server: ServerProcess, client: httpx.Client, lease_ms: object) -> None:
    r = client.post("/v1/buckets/kvcache/prefix", json={"keys": ["a"], "lease_ms": lease_ms})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "InvalidRequest" and "lease_ms" in error["message"] and error["request_id"]
