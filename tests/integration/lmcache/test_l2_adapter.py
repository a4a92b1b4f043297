"""kvgw's L2 adapter for LMCache's (0.5.6 or 0.5.7) multiprocess server, built by LMCache's own
``--l2-adapter`` parser and factory (``native_plugin`` wraps it in LMCache's ``NativeConnectorL2Adapter``),
fed with L1 memory objects from LMCache's ``L1MemoryManager``, against a real ``kvgw serve``.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.bench import lmcache_engine as le
from kvgw_client.lmcache import l2_adapter
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, leases_granted
from tests.index_view import IndexView
from tests.integration.lmcache.conftest import FAST_FAILURE

ROUTES = {"native_plugin": "KvgwNativeClient", "plugin": "KvgwL2Adapter"}


def spec(url: str, route: str = "native_plugin", **params: object) -> dict[str, object]:
    adapter_params: dict[str, object] = {"url": url, "bucket": "kvcache", "access_key": ROOT_AK, "secret_key": ROOT_SK}
    adapter_params.update(params)
    return {"type": route, "module_path": "kvgw_client.lmcache.l2_adapter", "class_name": ROUTES[route],
            "adapter_params": adapter_params}


@pytest.fixture
def make_driver() -> Iterator[Callable[..., le.L2Driver]]:
    made: list[le.L2Driver] = []

    def make(adapter_spec: dict[str, object], *, chunk_mib: int = 1, chunks: int = 8) -> le.L2Driver:
        driver = le.L2Driver(adapter_spec, chunk_mib=chunk_mib, l1_bytes=max(64, 3 * chunks * chunk_mib) << 20)
        made.append(driver)
        return driver

    yield make
    for driver in made:
        driver.close()


def round_trip(driver: le.L2Driver, keys: list[Any], seed: int) -> None:
    """Store random chunks, look them up, load them into fresh L1 objects: byte for byte."""
    objs = driver.allocate(len(keys))
    digests = le.random_fill_many(objs, seed)
    result = driver.store(keys, objs)
    assert result.is_successful() and result.bytes_transferred() == len(keys) * (driver.chunk_mib << 20)
    driver.free(objs)
    assert driver.lookup(keys) == [True] * len(keys)
    into = driver.allocate(len(keys))
    assert driver.load(keys, into) == [True] * len(keys)
    assert [le.digest(obj) for obj in into] == digests
    driver.unlock(keys)
    driver.free(into)


@pytest.mark.parametrize(
    ("route", "chunk_mib"), [("native_plugin", 1), ("native_plugin", 8), ("native_plugin", 32), ("plugin", 8)]
)
def test_byte_exact_round_trip(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int, route: str, chunk_mib: int
) -> None:
    n = {1: 8, 8: 4, 32: 2}[chunk_mib]
    driver = make_driver(spec(shared_server.url, route), chunk_mib=chunk_mib, chunks=n)
    keys = le.object_keys(n, seed=seed)
    assert driver.lookup(keys) == [False] * n
    round_trip(driver, keys, seed)
    # stored under LMCache's string form of the key, exactly the L1 bytes, chained to the previous chunk
    names = [le.l2_key_string(k) for k in keys]
    stored = httpx.get(shared_server.chunk_url(names[-1]), headers=shared_server.auth, timeout=30)
    assert stored.status_code == 200 and len(stored.content) == chunk_mib << 20
    index = IndexView(shared_server.data_dir)
    try:
        assert index.parent(names[-1]) == index.digest(names[-2])
    finally:
        index.close()


@pytest.mark.parametrize("chunk_mib", [1, 32])
def test_direct_reads_round_trip(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int, chunk_mib: int
) -> None:
    """With the gateway's fs tier mounted here, loads read the chunk files into L1 objects directly."""
    n = {1: 8, 32: 2}[chunk_mib]
    root = str((shared_server.data_dir / "fs").resolve())
    driver = make_driver(spec(shared_server.url, direct_read_root=root), chunk_mib=chunk_mib, chunks=n)
    keys = le.object_keys(n, seed=seed)
    round_trip(driver, keys, seed)
    native = driver.adapter._client
    assert native.client.counters.get("direct.ok") == n
    assert native.client.counters.get("batch_get.bytes") == 0


def test_lookup_is_per_key_and_load_fails_only_the_missing(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int
) -> None:
    """L2 lookups answer per key (the controller computes the prefix) and lease the hits (LMCache's
    lookup-and-lock); a load reports each key."""
    driver = make_driver(spec(shared_server.url))
    keys = le.object_keys(4, seed=seed)
    present = [keys[0], keys[1], keys[3]]
    objs = driver.allocate(3)
    digests = le.random_fill_many(objs, seed)
    assert driver.store(present, objs).is_successful()
    driver.free(objs)
    granted = leases_granted(shared_server)
    assert driver.lookup(keys) == [True, True, False, True]
    assert leases_granted(shared_server) == granted + 3  # lookup-and-lock leased the hits in the gateway
    into = driver.allocate(4)
    assert driver.load(keys, into) == [True, True, False, True]
    assert [le.digest(into[i]) for i in (0, 1, 3)] == digests
    driver.unlock(present)
    driver.free(into)


def test_delete(make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int) -> None:
    driver = make_driver(spec(shared_server.url))
    keys = le.object_keys(2, seed=seed)
    objs = driver.allocate(2)
    le.random_fill_many(objs, seed)
    assert driver.store(keys, objs).is_successful()
    driver.free(objs)
    driver.adapter.delete(keys[:1])
    assert driver.lookup(keys) == [False, True]
    driver.unlock(keys[1:])


def test_chunk_of_the_wrong_size_is_refused(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int
) -> None:
    driver = make_driver(spec(shared_server.url))
    (key,) = le.object_keys(1, seed=seed)
    r = httpx.put(shared_server.chunk_url(le.l2_key_string(key)), content=os.urandom(1000), headers=shared_server.auth)
    assert r.status_code == 201
    assert driver.lookup([key]) == [True]
    into = driver.allocate(1)
    assert driver.load([key], into) == [False]
    driver.unlock([key])
    driver.free(into)


def test_prefetch_turns_loads_into_staged_hits(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int
) -> None:
    driver = make_driver(spec(shared_server.url, prefetch_bytes=32 << 20))
    keys = le.object_keys(4, seed=seed)
    objs = driver.allocate(4)
    digests = le.random_fill_many(objs, seed)
    assert driver.store(keys, objs).is_successful()
    driver.free(objs)
    native = driver.adapter._client  # NativeConnectorL2Adapter's handle on our KvgwNativeClient
    assert driver.lookup(keys) == [True] * 4  # stages the present chunks
    pre = native._prefetcher
    deadline = time.monotonic() + 5
    while pre.stats().prefetched_bytes < 4 << 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    into = driver.allocate(4)
    assert driver.load(keys, into) == [True] * 4
    assert [le.digest(obj) for obj in into] == digests
    assert pre.stats().staged_hits == 4 and native.client.counters.get("batch_get.calls") == 1
    driver.unlock(keys)
    driver.free(into)


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_gateway_stopped_mid_run(
    make_driver: Callable[..., le.L2Driver], server: ServerProcess, seed: int, how: str, route: str
) -> None:
    """Every task completes (failed, never raised, bounded), the adapter reports itself unhealthy where it
    can, and the same adapter recovers when the gateway is back on the same port and data directory."""
    driver = make_driver(spec(server.url, route, **{k: v for k, v in FAST_FAILURE.items() if k != "lookup_timeout_s"}))
    keys, fresh = le.object_keys(3, seed=seed), le.object_keys(2, seed=seed + 1)
    objs = driver.allocate(3)
    digests = le.random_fill_many(objs, seed)
    assert driver.store(keys, objs).is_successful()
    driver.free(objs)
    (server.kill if how == "sigkill" else server.stop)()

    for _ in range(3):
        start = time.monotonic()
        assert driver.lookup(keys) == [False] * 3
        into = driver.allocate(3)
        assert driver.load(keys, into) == [False] * 3
        driver.free(into)
        objs = driver.allocate(2)
        assert not driver.store(fresh, objs).is_successful()
        driver.free(objs)
        assert time.monotonic() - start < 8
    if route == "plugin":
        assert driver.adapter.report_status()["is_healthy"] is False

    server.start()
    deadline = time.monotonic() + 15
    while driver.lookup(keys) != [True] * 3:
        assert time.monotonic() < deadline, "no recovery"
        time.sleep(0.05)
    into = driver.allocate(3)
    assert driver.load(keys, into) == [True] * 3
    assert [le.digest(obj) for obj in into] == digests
    driver.unlock(keys)
    driver.free(into)
    assert driver.lookup(fresh) == [False, False]  # the failed stores left nothing behind
    round_trip(driver, fresh, seed + 1)
    if route == "plugin":
        assert driver.adapter.report_status()["is_healthy"] is True


def _io_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvgw-client-io")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["wrapper", "client"])
def test_a_failed_construction_releases_the_client(
    monkeypatch: pytest.MonkeyPatch, shared_server: ServerProcess, where: str
) -> None:
    """When LMCache's wrapper refuses to construct (as 0.5.7's did, for its new required memory_tags), or
    the client fails half-way, the kvgw client made so far is closed: no I/O thread, no event fd left."""
    threads, fds = _io_threads(), _open_fds()
    if where == "wrapper":
        def refuse(self: object, *args: object, **kwargs: object) -> None:
            raise TypeError("missing 1 required positional argument: 'memory_tags'")

        monkeypatch.setattr(l2_adapter.NativeConnectorL2Adapter, "__init__", refuse)
    else:
        def no_fd() -> object:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(l2_adapter, "_EventFd", no_fd)
    params = spec(shared_server.url, "plugin", prefetch_bytes=1 << 20)["adapter_params"]
    with pytest.raises((TypeError, OSError)):
        l2_adapter.KvgwL2Adapter({**params, "max_capacity_gb": 0})  # type: ignore[dict-item]
    deadline = time.monotonic() + 5
    while _io_threads() != threads:
        assert time.monotonic() < deadline, "the client's I/O thread outlived the failed construction"
        time.sleep(0.01)
    assert _open_fds() <= fds  # the event fd and the connection pool's sockets are gone


@pytest.mark.parametrize("route", list(ROUTES))
def test_memory_tags_and_touch(
    make_driver: Callable[..., le.L2Driver], shared_server: ServerProcess, seed: int, route: str
) -> None:
    """LMCache 0.5.7's adapter surface: the memory tags say remote storage; ``submit_touch`` (what
    ``StorageManager.touch_cached_keys`` calls) counts as reads in kvgw on the ``plugin`` route (LMCache's
    own wrapper of the ``native_plugin`` route only notifies its listeners)."""
    driver = make_driver(spec(shared_server.url, route))
    if l2_adapter.MEMORY_TAGS is None:  # LMCache 0.5.6: no tags, and only our adapter has submit_touch
        assert importlib.metadata.version("lmcache") == "0.5.6"
        if route == "native_plugin":
            return
    else:
        tags = driver.adapter.get_memory_tags()
        assert (tags.segment.value, tags.residency.value) == ("storage", "remote")
    keys = le.object_keys(2, seed=seed)
    objs = driver.allocate(2)
    le.random_fill_many(objs, seed)
    assert driver.store(keys, objs).is_successful()
    driver.free(objs)
    names = [le.l2_key_string(k) for k in keys]
    index = IndexView(shared_server.data_dir)
    try:
        before = [index.entry(n).hits for n in names]  # type: ignore[union-attr]
        driver.adapter.submit_touch(keys)
        want = [h + 1 for h in before] if route == "plugin" else before
        deadline = time.monotonic() + 5
        while [index.entry(n).hits for n in names] != want:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "kvgw did not count the touch"
            time.sleep(0.02)
    finally:
        index.close()
