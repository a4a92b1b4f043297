"""LMCache's own S3 paths (0.5.6 and 0.5.7) against kvgw's S3 API, unchanged: the in-process S3 connector in the bare
(``s3://host:port``) and virtual-hosted (``s3://<bucket>.<host>:port``) forms, and the multiprocess
server's ``s3`` L2 adapter (virtual-hosted; it also lists keys with ListObjectsV2).

The gateway runs with ``KVGW_S3_API_BASE_DOMAIN=localhost``, so ``kvcache.localhost`` names bucket
``kvcache``; that name must resolve to 127.0.0.1 (``.ci/run`` adds it to /etc/hosts). Bare requests go to
the default bucket, ``kvcache``. Objects written through S3 are the same chunks the native API serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
import xxhash
from lmcache.utils import CacheEngineKey

from gateway.bench import lmcache_engine as le
from kvgw_client.framing import byte_view
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess


@pytest.fixture
def make_s3_worker() -> Iterator[Callable[..., le.Worker]]:
    made: list[le.Worker] = []

    def make(remote_url: str, *, chunk_mib: int, chunks: int) -> le.Worker:
        config = le.engine_config(cpu_gb=le.cpu_pool_gb(chunk_mib, chunks),
                                  extra=le.s3_connector_extra(ROOT_AK, ROOT_SK), remote_url=remote_url)
        worker = le.Worker(config, le.make_metadata(chunk_mib))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


def s3_object_name(key: CacheEngineKey) -> str:
    """Where LMCache's S3 connector puts a chunk: the key string with "/" flattened to "_"."""
    return str(key.to_string()).replace("/", "_")


def store(worker: le.Worker, keys: list[CacheEngineKey], seed: int) -> list[int]:
    objs = worker.allocate(len(keys))
    digests = le.random_fill_many(objs, seed)
    worker.store(keys, objs)
    assert worker.wait_stored(le.REMOTE_URL, keys, timeout=60)
    return digests


@pytest.mark.parametrize(("form", "chunk_mib"), [("bare", 1), ("bare", 8), ("bare", 32), ("virtual-hosted", 8),
                                                 ("virtual-hosted", 32)])
def test_s3_connector_byte_exact_round_trip(
    make_s3_worker: Callable[..., le.Worker], s3_gateway: ServerProcess, request: pytest.FixtureRequest,
    seed: int, form: str, chunk_mib: int,
) -> None:
    """8 MiB is one PUT; 32 MiB is a multipart upload of four 8 MiB parts and parallel ranged GETs."""
    host = "127.0.0.1" if form == "bare" else request.getfixturevalue("vhost")
    n = {1: 6, 8: 3, 32: 2}[chunk_mib]
    worker = make_s3_worker(f"s3://{host}:{s3_gateway.port}", chunk_mib=chunk_mib, chunks=n)
    keys = le.chunk_keys(n, seed=seed)
    digests = store(worker, keys, seed)
    assert worker.lookup(keys) == n
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    # the same bytes, as one chunk of bucket kvcache, through the native API
    native = httpx.get(s3_gateway.chunk_url(s3_object_name(keys[0])), headers=s3_gateway.auth, timeout=30)
    assert native.status_code == 200 and native.content == bytes(byte_view(got[0].byte_array))
    le.release(got)


def test_s3_connector_prefix_lookup_stops_at_the_first_missing_chunk(
    make_s3_worker: Callable[..., le.Worker], s3_gateway: ServerProcess, seed: int
) -> None:
    worker = make_s3_worker(f"s3://127.0.0.1:{s3_gateway.port}", chunk_mib=1, chunks=6)
    keys = le.chunk_keys(4, seed=seed)
    digests = store(worker, [keys[0], keys[1], keys[3]], seed)  # chunk 2 never stored
    assert worker.lookup(keys) == 2
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests[:2]
    le.release(got)


@pytest.fixture
def make_s3_driver(vhost: str, s3_gateway: ServerProcess) -> Iterator[Callable[..., le.L2Driver]]:
    made: list[le.L2Driver] = []

    def make(*, chunk_mib: int, chunks: int) -> le.L2Driver:
        spec = {"type": "s3", "s3_endpoint": f"s3://{vhost}:{s3_gateway.port}", "s3_region": "us-east-1",
                "disable_tls": True, "s3_prefer_http2": False, "s3_num_io_threads": 4,
                "aws_access_key_id": ROOT_AK, "aws_secret_access_key": ROOT_SK}
        driver = le.L2Driver(spec, chunk_mib=chunk_mib, l1_bytes=max(64, 3 * chunks * chunk_mib) << 20)
        made.append(driver)
        return driver

    yield make
    for driver in made:
        driver.close()


@pytest.mark.parametrize("chunk_mib", [1, 8, 32])
def test_s3_l2_adapter_byte_exact_round_trip(
    make_s3_driver: Callable[..., le.L2Driver], s3_gateway: ServerProcess, seed: int, chunk_mib: int
) -> None:
    n = {1: 6, 8: 3, 32: 2}[chunk_mib]
    driver = make_s3_driver(chunk_mib=chunk_mib, chunks=n)
    keys = le.object_keys(n, seed=seed)
    present = keys[:1] + keys[2:]
    objs = driver.allocate(len(present))
    digests = le.random_fill_many(objs, seed)
    assert driver.store(present, objs).is_successful()
    driver.free(objs)
    assert driver.lookup(keys) == [True, False] + [True] * (n - 2)
    into = driver.allocate(len(present))  # (a load of the missing key makes awscrt log a RuntimeError)
    assert driver.load(present, into) == [True] * len(present)
    assert [le.digest(obj) for obj in into] == digests
    driver.unlock(present)
    native = httpx.get(s3_gateway.chunk_url(le.l2_key_string(keys[0])), headers=s3_gateway.auth, timeout=30)
    assert xxhash.xxh3_64_intdigest(native.content) == digests[0]  # S3 keys are kept verbatim: "/" and "@"
    driver.free(into)


def test_s3_l2_adapter_lists_keys_with_list_objects_v2(
    make_s3_driver: Callable[..., le.L2Driver], seed: int
) -> None:
    driver = make_s3_driver(chunk_mib=1, chunks=5)
    model = f"org/listing-{seed}"
    keys = le.object_keys(5, seed=seed, model=model)
    objs = driver.allocate(5)
    le.random_fill_many(objs, seed)
    assert driver.store(keys, objs).is_successful()
    driver.free(objs)
    listed, cursor, pages = [], None, 0
    while True:  # pages of two: continuation tokens round-trip
        page = driver.adapter.list_l2_keys(model_name=model, page_size=2, cursor=cursor)
        listed += list(page.entries)
        pages += 1
        cursor = page.next_page_token
        if cursor is None:
            break
    assert pages == 3 and len(listed) == 5
    assert all(entry.size_bytes == 1 << 20 for entry in listed)
    assert {entry.key for entry in listed} == {k.to_encoded_object_key() for k in keys}
