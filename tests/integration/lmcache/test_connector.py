"""kvgw's LMCache connector, loaded by LMCache (0.5.6 or 0.5.7) as a remote-storage plugin, driven through
LMCache's own StorageManager / RemoteBackend with LocalCPUBackend memory objects, against a real
``kvgw serve``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
import xxhash
from lmcache.utils import CacheEngineKey

from backends.index import MARK_ONE_OFF, MARK_SESSION_ENDED, MARK_SHARED
from gateway.bench import lmcache_engine as le
from kvgw_client import wire
from kvgw_client.framing import byte_view
from kvgw_client.health import CircuitState
from kvgw_client.lmcache.connector import KvgwConnector, RemoteMetadata
from tests.conftest import ServerProcess, create_bucket, fs_usage, leases_granted
from tests.http_faults import Fault, HttpFaultProxy
from tests.index_view import IndexView
from tests.integration.lmcache.conftest import FAST_FAILURE

Worker = le.Worker


def connector(worker: Worker) -> KvgwConnector:
    connection = worker.backend(le.REMOTE_KVGW).connection
    assert connection is not None, "LMCache did not load the kvgw plugin"
    inner = connection.getWrappedConnector()
    assert isinstance(inner, KvgwConnector)
    return inner


def counters(worker: Worker) -> dict[str, int]:
    stats = connector(worker).stats()["counters"]
    assert isinstance(stats, dict)
    return stats


def free_chunks(worker: Worker) -> int:
    """How many full chunks LMCache's CPU pool can still hand out (a leak shows as fewer)."""
    held = []
    while (obj := worker.storage.allocate(worker.metadata.get_shapes(), worker.metadata.get_dtypes(),
                                          eviction=False, busy_loop=False)) is not None:
        held.append(obj)
    le.release(held)
    return len(held)


def assert_all_memory_back(worker: Worker, free: int) -> None:
    """Every memory object the connector took from LMCache's pool was given back (puts drop their
    reference a moment after the gateway acknowledged them, so allow a moment)."""
    wait_for(lambda: free_chunks(worker) == free, 5, f"the pool's {free} free chunks")


def store_random(worker: Worker, keys: list[CacheEngineKey], seed: int) -> list[int]:
    """Store random chunks under ``keys`` the way LMCacheEngine does, wait until they landed; their digests."""
    objs = worker.allocate(len(keys))
    digests = le.random_fill_many(objs, seed)
    worker.store(keys, objs)
    assert worker.wait_stored(le.REMOTE_KVGW, keys, timeout=30)
    return digests


def store_dropped(worker: Worker, keys: list[CacheEngineKey], seed: int) -> None:
    """Store chunks while the gateway is out: no exception, and each write is counted as failed."""
    failed = counters(worker).get("lmcache.put_failed", 0)
    objs = worker.allocate(len(keys))
    le.random_fill_many(objs, seed)
    worker.store(keys, objs)
    wait_for(lambda: counters(worker).get("lmcache.put_failed", 0) == failed + len(keys), 10, "dropped writes")


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


@pytest.mark.parametrize("chunk_mib", [1, 8, 32])
def test_byte_exact_round_trip(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int, chunk_mib: int
) -> None:
    n = {1: 8, 8: 4, 32: 2}[chunk_mib]
    worker = make_worker(shared_server.url, chunk_mib=chunk_mib, chunks=n)
    free = free_chunks(worker)
    keys = le.chunk_keys(n, seed=seed)
    assert worker.lookup(keys) == 0  # a request is looked up before its chunks are stored
    digests = store_random(worker, keys, seed)
    assert worker.lookup(keys) == n

    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    assert all(obj.get_shapes() == worker.metadata.get_shapes() for obj in got)

    # What kvgw holds is LMCache's chunk layout: RemoteMetadata, then the tensor bytes, byte for byte;
    # and each chunk's parent is the chunk before it (learned from the lookup and the store).
    conn = connector(worker)
    name = conn.name_of(keys[-1])
    body = httpx.get(shared_server.chunk_url(name), headers=shared_server.auth, timeout=30).content
    meta = RemoteMetadata.deserialize(body[: conn.remote_metadata_bytes])
    assert meta.length == chunk_mib << 20 and list(meta.shapes) == worker.metadata.get_shapes()
    assert body[conn.remote_metadata_bytes :] == bytes(byte_view(got[-1].byte_array))
    index = IndexView(shared_server.data_dir)
    try:
        assert index.parent(name) == index.digest(conn.name_of(keys[-2]))
    finally:
        index.close()
    le.release(got)
    assert_all_memory_back(worker, free)


@pytest.mark.parametrize("chunk_mib", [1, 8, 32])
def test_direct_reads_round_trip(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int, chunk_mib: int
) -> None:
    """With the gateway's fs tier mounted here (``direct_read_root``), LMCache's retrieve gets the
    chunk files read straight into its memory objects, byte for byte, and nothing over batch-get."""
    n = {1: 8, 8: 4, 32: 2}[chunk_mib]
    root = str((shared_server.data_dir / "fs").resolve())
    worker = make_worker(shared_server.url, chunk_mib=chunk_mib, chunks=n, direct_read_root=root)
    free = free_chunks(worker)
    keys = le.chunk_keys(n, seed=seed)
    digests = store_random(worker, keys, seed)
    assert worker.lookup(keys) == n
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    assert all(obj.get_shapes() == worker.metadata.get_shapes() for obj in got)
    client = connector(worker).client
    assert client.counters.get("direct.ok") == n and client.counters.get("batch_get.bytes") == 0
    le.release(got)
    # the lookup's lease still covers them and their files are located: read on LMCache's own loop
    again = worker.retrieve(keys)
    assert [le.digest(obj) for obj in again] == digests
    assert client.counters.get("direct.remembered") == 1 and client.counters.get("direct.ok") == 2 * n
    le.release(again)
    assert_all_memory_back(worker, free)


def test_raw_chunk_format_round_trip(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int
) -> None:
    """``save_chunk_meta: false``: kvgw stores the bare tensor bytes, as LMCache's S3 connector does."""
    worker = make_worker(shared_server.url, chunk_mib=8, chunks=3, meta=False)
    keys = le.chunk_keys(3, seed=seed)
    digests = store_random(worker, keys, seed)
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    stored = httpx.get(shared_server.chunk_url(keys[0].to_string()), headers=shared_server.auth, timeout=30)
    assert len(stored.content) == 8 << 20 and le.digest(got[0]) == xxhash.xxh3_64_intdigest(stored.content)
    le.release(got)


def test_prefix_lookup_stops_at_the_first_missing_chunk(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int
) -> None:
    worker = make_worker(shared_server.url, chunks=6)
    free = free_chunks(worker)
    keys = le.chunk_keys(5, seed=seed)
    present = [keys[0], keys[1], keys[3], keys[4]]  # chunk 2 was never stored
    digests = store_random(worker, present, seed)
    granted = leases_granted(shared_server)
    assert worker.lookup(keys) == 2
    assert leases_granted(shared_server) == granted + 2  # the lookup leased its hits (lease_ms, 5 s default)
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests[:2]
    le.release(got)
    remote = worker.backend(le.REMOTE_KVGW)
    objs = worker.run(remote.batched_get_non_blocking("req-prefix", keys))  # the async retrieve path
    assert [le.digest(obj) for obj in objs] == digests[:2]  # chunks after the gap were fetched and freed
    le.release(objs)
    assert_all_memory_back(worker, free)


def _keys_with(configs: dict[str, object], n: int, seed: int) -> list[CacheEngineKey]:
    """A request's keys as LMCache builds them when vLLM's ``kv_transfer_params`` carry ``configs``."""
    return [CacheEngineKey(k.model_name, k.world_size, k.worker_id, k.chunk_hash, k.dtype, request_configs=configs)
            for k in le.chunk_keys(n, seed=seed)]


def test_request_configs_become_retention_classes_and_session_end_hints(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int
) -> None:
    """``lmcache.kvgw.retention`` sets the class of the chunks a request stores; a request marked as its
    session's last turn (``lmcache.kvgw.session_end``) stores one-off chunks and hints that the chunks it
    loaded ended their session. Neither changes a key (LMCache keeps request configs beside its identity)."""
    worker = make_worker(shared_server.url, chunks=8)
    conn = connector(worker)
    system = _keys_with({"lmcache.kvgw.retention": "shared"}, 2, seed)
    store_random(worker, system, seed)
    last = _keys_with({"lmcache.kvgw.session_end": True}, 4, seed + 1000)
    store_random(worker, last[2:], seed)  # the last turn's new chunks
    plain = [CacheEngineKey(k.model_name, k.world_size, k.worker_id, k.chunk_hash, k.dtype) for k in last[:2]]
    store_random(worker, plain, seed)  # written by an earlier turn
    assert conn.name_of(plain[0]) == conn.name_of(last[0])
    index = IndexView(shared_server.data_dir)
    try:
        assert [index.entry(conn.name_of(k)).marks for k in system] == [MARK_SHARED] * 2  # type: ignore[union-attr]
        assert [index.entry(conn.name_of(k)).marks for k in last] == [0, 0, MARK_ONE_OFF, MARK_ONE_OFF]  # type: ignore[union-attr]
        got = worker.retrieve(last[:2])  # the last turn loads what the earlier ones stored
        assert len(got) == 2
        le.release(got)
        wait_for(lambda: all(index.entry(conn.name_of(k)).marks & MARK_SESSION_ENDED  # type: ignore[union-attr]
                             for k in last[:2]), 10, "the session-ended hint")
    finally:
        index.close()
    assert counters(worker).get("lmcache.session_end_hints") == 1


FULL_CAPACITY = 20 * ((1 << 20) + (64 << 10))  # about 20 of the workers' 1 MiB chunks; watermarks 0.8 and 0.9


@pytest.fixture(scope="module")
def full_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A gateway whose bucket ``full`` holds about 20 chunks, its lifecycle quick to hold it at the low
    watermark, where the gateway declines chunks hinted as read by no one again."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw-full") / "data",
                           env={"KVGW_LIFECYCLE_INTERVAL": "0.2", "KVGW_WORKERS": "1"}).start()
    create_bucket(server, "full", "--capacity-bytes", str(FULL_CAPACITY))
    yield server
    server.stop()


def test_a_session_end_chunk_the_full_gateway_declines_is_not_stored_and_not_a_failure(
    make_worker: Callable[..., Worker], full_server: ServerProcess, seed: int
) -> None:
    """At its low watermark the gateway declines the one-off chunks of a session's last turn (507
    ``Declined``). Through LMCache's own storage manager: the connector counts them as declined, not as
    failures, its client's circuit stays closed, LMCache gets its memory back, nothing is stored, and the
    next ordinary chunk is stored."""
    worker = make_worker(full_server.url, bucket="full", chunks=8)
    free = free_chunks(worker)
    for batch in range(4):  # 24 ordinary chunks: past the low watermark
        store_random(worker, le.chunk_keys(6, seed=seed * 100 + batch), seed)
    wait_for(lambda: 0 < fs_usage(full_server, "full") < FULL_CAPACITY * 0.8, 30,
             "the lifecycle evicting down to the low watermark")
    store_random(worker, le.chunk_keys(1, seed=seed * 100 + 40), seed)  # less than 5% of the capacity
    assert FULL_CAPACITY * 0.8 <= fs_usage(full_server, "full") < FULL_CAPACITY * 0.9  # at the watermark
    last = _keys_with({"lmcache.kvgw.session_end": True}, 2, seed * 100 + 50)
    objs = worker.allocate(len(last))
    le.random_fill_many(objs, seed)
    worker.store(last, objs)
    wait_for(lambda: counters(worker).get("lmcache.put_declined") == 2, 30, "two declined puts")
    conn = connector(worker)
    assert "lmcache.put_failed" not in counters(worker)
    assert conn.client.stats()["failures"] == {} and conn.client.health is CircuitState.CLOSED
    assert conn.client.blocking.exists([conn.name_of(k) for k in last]) == [False, False]
    assert worker.lookup(last) == 0  # LMCache sees no copy anywhere: it will recompute them
    assert_all_memory_back(worker, free)
    plain = le.chunk_keys(1, seed=seed * 100 + 60)
    store_random(worker, plain, seed)  # an ordinary chunk right after: admitted and stored
    assert conn.client.blocking.exists([conn.name_of(plain[0])]) == [True]


def test_prefetcher_turns_a_second_lookups_gets_into_staged_hits(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int
) -> None:
    worker = make_worker(shared_server.url, chunks=8, prefetch_bytes=64 << 20)
    conn = connector(worker)
    assert conn.prefetcher is not None
    keys = le.chunk_keys(6, seed=seed)
    assert worker.lookup(keys) == 0  # first request: nothing cached yet
    digests = store_random(worker, keys, seed)
    before = counters(worker)
    assert worker.lookup(keys) == 6  # second request: the lookup stages the chunks
    wait_for(lambda: all(conn.prefetcher.tracks(conn.name_of(k)) for k in keys), 5, "staging")  # type: ignore[union-attr]
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    stats = conn.prefetcher.stats()
    assert (stats.staged_hits, stats.misses, stats.wasted_bytes) == (6, 0, 0)
    assert stats.used_bytes == stats.prefetched_bytes >= 6 << 20 and stats.staged_now == 0
    after = counters(worker)
    assert after["batch_get.calls"] - before.get("batch_get.calls", 0) == 1  # the staging fetch, nothing more
    le.release(got)

    # The async lookup path (enable_async_loading): batched_async_contains stages, the non-blocking get is served
    # from memory.
    remote = worker.backend(le.REMOTE_KVGW)
    assert worker.run(remote.batched_async_contains("req-2", keys)) == 6
    objs = worker.run(remote.batched_get_non_blocking("req-2", keys))
    assert [le.digest(obj) for obj in objs] == digests
    assert conn.prefetcher.stats().staged_hits == 12
    le.release(objs)


def test_prefetcher_memory_limit_and_counters(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int
) -> None:
    """A buffer of two and a half chunks: a request stages its first two chunks (the prefix a reader needs
    first), never more bytes than the limit; chunks staged but never used are evicted by the next request
    and counted as wasted."""
    worker = make_worker(shared_server.url, chunks=10, prefetch_bytes=int(2.5 * ((1 << 20) + 1024)))
    conn = connector(worker)
    pre = conn.prefetcher
    assert pre is not None
    first, second = le.chunk_keys(5, seed=seed), le.chunk_keys(2, seed=seed + 1)
    d1 = store_random(worker, first, seed)
    store_random(worker, second, seed + 1)
    assert worker.lookup(first) == 5
    assert pre.stats().refused == 3 and pre.stats().staged_now == 2 * conn.chunk_bytes <= pre.limit
    got = worker.retrieve(first)  # two from memory, three fetched directly
    assert [le.digest(obj) for obj in got] == d1
    le.release(got)
    stats = pre.stats()
    # LMCache looks the request up again at retrieve: the tail still does not fit, the head is not evicted
    assert (stats.staged_hits, stats.misses, stats.refused, stats.evictions) == (2, 0, 6, 0)
    landed = stats.prefetched_bytes
    assert landed == 2 * conn.chunk_bytes and stats.used_bytes == landed

    assert worker.lookup(first[:2]) == 2  # staged again, then never used ...
    wait_for(lambda: pre.stats().prefetched_bytes == 2 * landed, 5, "restaging")
    assert worker.lookup(second) == 2  # ... and evicted by the next request
    wait_for(lambda: pre.stats().prefetched_bytes == 3 * landed, 5, "staging the next request")
    stats = pre.stats()
    assert (stats.evictions, stats.wasted_bytes, stats.staged_now) == (2, landed, landed)
    assert stats.staged_now <= pre.limit


def _pause(server: ServerProcess) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)


def _outage_calls(worker: Worker, keys: list[CacheEngineKey], fresh: list[CacheEngineKey], seed: int) -> None:
    """Everything LMCache does, during an outage: no exception, nothing found, each call bounded."""
    remote = worker.backend(le.REMOTE_KVGW)
    for _ in range(3):
        start = time.monotonic()
        assert worker.lookup(keys) == 0
        assert worker.retrieve(keys, location=le.REMOTE_KVGW) == []
        assert remote.contains(keys[0]) is False
        assert remote.get_blocking(keys[0]) is None
        assert worker.run(remote.batched_async_contains("outage", keys)) == 0
        assert worker.run(remote.batched_get_non_blocking("outage", keys)) == []
        store_dropped(worker, fresh, seed)
        assert time.monotonic() - start < 8


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "sigstop"])
def test_gateway_stopped_mid_run(
    make_worker: Callable[..., Worker], server: ServerProcess, seed: int, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway dies (SIGKILL), shuts down (SIGTERM) or hangs (SIGSTOP: connections are accepted, never
    answered) mid-run. LMCache keeps serving: no exception, lookups find nothing, gets return None, stores
    are dropped, every call bounded, LMCache's event loop never blocked. The same connector recovers by
    itself when the gateway is back on the same port and data directory."""
    worker = make_worker(server.url, chunks=12, **FAST_FAILURE)
    free = free_chunks(worker)
    keys, fresh = le.chunk_keys(4, seed=seed), le.chunk_keys(2, seed=seed + 1)
    digests = store_random(worker, keys, seed)
    assert worker.lookup(keys) == 4
    conn = connector(worker)
    kvgw_log = logging.getLogger("kvgw_client.lmcache.connector")
    kvgw_log.addHandler(caplog.handler)
    try:
        {"sigkill": server.kill, "sigterm": server.stop, "sigstop": lambda: _pause(server)}[how]()
        # The first gets of the outage wait for the gateway (a hung one: until the read timeout). Meanwhile
        # LMCache's event loop, on which those gets were scheduled, keeps running its other work.
        remote = worker.backend(le.REMOTE_KVGW)
        answers: list[Any] = []
        getter = threading.Thread(target=lambda: answers.append(remote.batched_get_blocking(keys)))
        getter.start()
        delays = []
        while getter.is_alive():
            start = time.monotonic()
            worker.run(asyncio.sleep(0), timeout=2.0)
            delays.append(time.monotonic() - start)
            time.sleep(0.01)
        getter.join()
        assert answers == [[None] * 4] and max(delays) < 0.5, max(delays)  # a blocked loop: >= 1 s

        _outage_calls(worker, keys, fresh, seed)
        assert conn.client.health is not CircuitState.CLOSED
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "failed" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per burst

        if how == "sigstop":
            assert server.proc is not None
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
        server.start()  # same port, same data directory
        wait_for(lambda: worker.lookup(keys) == 4, 15, "recovery")
    finally:
        kvgw_log.removeHandler(caplog.handler)
    got = worker.retrieve(keys)
    assert [le.digest(obj) for obj in got] == digests
    le.release(got)
    assert worker.lookup(fresh) == 0  # the writes made during the outage were dropped, not half-stored
    digests_fresh = store_random(worker, fresh, seed + 1)
    got = worker.retrieve(fresh)
    assert [le.digest(obj) for obj in got] == digests_fresh
    le.release(got)
    assert any("recovered" in r.getMessage() for r in caplog.records)
    failures = connector(worker).stats()["failures"]
    assert isinstance(failures, dict) and sum(failures.values()) >= 3
    assert_all_memory_back(worker, free)


FAULTS = {
    "5xx": Fault("*", status=503, times=10_000),
    "malformed-json": Fault("prefix", body=b'{"length": "all of them"}', times=10_000),
    "not-http": Fault("*", garble=True, times=10_000),
    "damaged-frame": Fault("batch_get", corrupt_at=wire.BATCH_HEADER.size + wire.FRAME_HEADER.size + 100,
                           times=10_000),
    "cut-stream": Fault("batch_get", cut_after=(1 << 20) + 4096, times=10_000),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_gateway_errors_and_malformed_answers_are_never_lmcaches_problem(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int, fault: str
) -> None:
    """Through a fault proxy in front of the real gateway: every LMCache call returns its neutral answer
    (a damaged chunk is never handed to LMCache), and the connector recovers when the faults stop."""
    proxy = HttpFaultProxy(shared_server.url).start()
    try:
        worker = make_worker(proxy.url, chunks=10, **FAST_FAILURE)
        free = free_chunks(worker)
        keys = le.chunk_keys(3, seed=seed)
        digests = store_random(worker, keys, seed)
        proxy.inject(FAULTS[fault])
        for _ in range(3):
            got = worker.retrieve(keys)
            assert got == [] or (fault == "cut-stream" and [le.digest(o) for o in got] == digests[:1])
            le.release(got)
            assert worker.lookup(keys) in ((0,) if fault in ("5xx", "malformed-json", "not-http") else (3,))
            if fault in ("5xx", "not-http"):
                store_dropped(worker, le.chunk_keys(1, seed=seed + 1), seed)
        proxy.clear()
        wait_for(lambda: connector(worker).client.health is CircuitState.CLOSED, 5, "recovery")
        got = worker.retrieve(keys)
        assert [le.digest(obj) for obj in got] == digests
        le.release(got)
        assert_all_memory_back(worker, free)
    finally:
        proxy.close()


@pytest.mark.parametrize("meta", [True, False], ids=["chunk-meta", "raw"])
def test_partial_last_chunk(
    make_worker: Callable[..., Worker], shared_server: ServerProcess, seed: int, meta: bool
) -> None:
    worker = make_worker(shared_server.url, chunks=4, meta=meta)
    free = free_chunks(worker)
    (key,) = le.chunk_keys(1, seed=seed)
    (obj,) = worker.allocate(1, tokens=5)
    obj.tensor.fill_(7.0)
    worker.store([key], [obj])
    assert worker.wait_stored(le.REMOTE_KVGW, [key])
    (got,) = worker.backend(le.REMOTE_KVGW).batched_get_blocking([key])
    assert got is not None and got.tensor.shape[2] == 5 and float(got.tensor.float().mean()) == 7.0
    got.ref_count_down()
    assert_all_memory_back(worker, free)


def test_chunk_of_the_wrong_size_is_refused(make_worker: Callable[..., Worker], shared_server: ServerProcess,
                                             seed: int) -> None:
    worker = make_worker(shared_server.url, meta=False)
    (key,) = le.chunk_keys(1, seed=seed)
    r = httpx.put(shared_server.chunk_url(key.to_string()), content=os.urandom(1000), headers=shared_server.auth)
    assert r.status_code == 201  # not a whole number of tokens
    assert worker.lookup([key]) == 1
    assert worker.retrieve([key]) == []
    assert counters(worker)["lmcache.bad_size"] == 1


def test_health_check_probe_key_survives_write_once(make_worker: Callable[..., Worker],
                                                    shared_server: ServerProcess) -> None:
    worker = make_worker(shared_server.url)
    remote = worker.backend(le.REMOTE_KVGW)
    probe = CacheEngineKey("test", 1, 0, 0, torch.bfloat16)
    for value in (1.0, 2.0):  # LMCache's health check writes new bytes under this one key each time
        (obj,) = worker.allocate(1)
        obj.tensor.fill_(value)
        before = counters(worker).get("put.stored", 0)
        remote.batched_submit_put_task([probe], [obj])
        obj.ref_count_down()
        wait_for(lambda n=before + 1: counters(worker).get("put.stored", 0) == n, 5, "probe write")
        (got,) = remote.batched_get_blocking([probe])
        assert got is not None and float(got.tensor.float().mean()) == value
        got.ref_count_down()


def test_plugin_that_cannot_start_is_reported_not_raised(make_worker: Callable[..., Any]) -> None:
    """A typo in the kvgw settings: LMCache only logs it, so the worker runs without the backend. This is
    LMCache's behaviour; the test pins it so the README's advice (check that the connector loaded) stays
    true."""
    worker = make_worker("http://127.0.0.1:9", pool_sise=4)
    assert worker.backend(le.REMOTE_KVGW).connection is None

