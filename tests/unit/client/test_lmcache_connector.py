"""KvgwConnector driven the way LMCache 0.5.6 drives it (RemoteBackend, plugin loading, real
LocalCPUBackend memory), against the in-process fake of the native API.

Phase 2 repeats these against ``kvgw serve`` and a real LMCacheEngine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (.ci/install-lmcache.sh)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from gateway.client.health import CircuitState
from gateway.client.lmcache_connector import ConnectorSettings, KvgwConnector
from tests.unit.client.fake_gateway import FakeGateway, Fault

MODEL = "org/tiny-model"
TOKENS = 16
KV_SHAPE = (2, 2, TOKENS, 8, 16)  # layers, k/v, tokens, heads, head size -> 16 KiB bf16 chunks


@dataclass
class Env:
    backend: RemoteBackend
    cpu: LocalCPUBackend
    metadata: LMCacheMetadata
    loop: asyncio.AbstractEventLoop
    gateway: FakeGateway

    @property
    def conn(self) -> KvgwConnector:
        connection = self.backend.connection
        assert connection is not None, "the kvgw plugin did not load"
        wrapped = connection.getWrappedConnector()
        assert isinstance(wrapped, KvgwConnector)
        return wrapped

    def chunk(self, value: float, tokens: int = TOKENS) -> Any:
        shapes = self.metadata.get_shapes()
        if tokens != TOKENS:
            shapes = [torch.Size([s[0], s[1], tokens, s[3]]) for s in shapes]
        obj = self.cpu.allocate(shapes, self.metadata.get_dtypes(), MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.fill_(value)
        return obj

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def free_chunks(self) -> int:
        """How many full chunks the CPU pool can still hand out (a leak shows as fewer)."""
        held = []
        while (obj := self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(),
                                        MemoryFormat.KV_2LTD, eviction=False, busy_loop=False)) is not None:
            held.append(obj)
        for obj in held:
            obj.ref_count_down()
        return len(held)


def keys(n: int, salt: int = 0) -> list[CacheEngineKey]:
    return [CacheEngineKey(MODEL, 1, 0, 0xABC000 + salt * 100 + i, torch.bfloat16) for i in range(n)]


@pytest.fixture
def make_env(fake_gateway: FakeGateway) -> Iterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(*, meta: bool = True, class_name: str = "KvgwConnector", **extra: object) -> Env:
        extra_config: dict[str, object] = {
            "remote_storage_plugin.kvgw.module_path": "gateway.client.lmcache_connector",
            "remote_storage_plugin.kvgw.class_name": class_name,
            "kvgw.url": fake_gateway.url,
            "kvgw.bucket": "kvcache",
            "kvgw.cooldown_s": 0.1,
            "kvgw.retry_backoff_s": 0.005,
            "kvgw.prefetch_bytes": 1 << 20,
            "save_chunk_meta": meta,
        }
        extra_config.update({f"kvgw.{k}": v for k, v in extra.items()})
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=TOKENS, max_local_cpu_size=0.01, local_cpu=False, save_unfull_chunk=True,
            remote_storage_plugins=["kvgw"], extra_config=extra_config,
        )
        metadata = LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE, chunk_size=TOKENS, role="worker",
        )
        cpu = LocalCPUBackend(config, metadata)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        backend = RemoteBackend(config, metadata, loop, cpu, plugin_name="kvgw")
        env = Env(backend, cpu, metadata, loop, fake_gateway)
        made.append(env)
        return env

    yield make
    for env in made:
        env.backend.close()
        env.loop.call_soon_threadsafe(env.loop.stop)


def store(env: Env, ks: list[CacheEngineKey], values: list[float], *, lands: bool = True) -> None:
    """Submit puts as LMCache's storage manager does; wait until they land (or briefly, if they cannot)."""
    objs = [env.chunk(v) for v in values]
    env.backend.batched_submit_put_task(ks, objs)
    for obj in objs:
        obj.ref_count_down()  # the backend holds its own reference while the put runs
    gateway = env.gateway
    deadline = time.monotonic() + (5.0 if lands else 0.3)
    while time.monotonic() < deadline:
        if lands and all(env.conn.name_of(k) in gateway.chunks for k in ks):
            time.sleep(0.02)  # let the put callbacks finish
            return
        time.sleep(0.01)
    assert not lands, "puts did not reach the gateway"


def means(objs: list[Any]) -> list[float | None]:
    return [None if o is None else float(o.tensor.float().mean()) for o in objs]


def release(objs: list[Any]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


@pytest.mark.parametrize("class_name", ["KvgwConnector", "KvgwConnectorAdapter"])
@pytest.mark.parametrize("meta", [True, False], ids=["chunk-meta", "raw"])
def test_store_lookup_retrieve_roundtrip(
    make_env: Callable[..., Env], fake_gateway: FakeGateway, meta: bool, class_name: str
) -> None:
    env = make_env(meta=meta, class_name=class_name)
    free = env.free_chunks()
    ks = keys(4)
    names = [k.to_string() for k in ks]
    assert env.backend.batched_contains(ks) == 0  # looked up first: the chain is learned here
    store(env, ks[:1], [1.0])
    store(env, ks[1:3], [2.0, 3.0])
    assert fake_gateway.chunks[names[0]].parent is None
    assert fake_gateway.chunks[names[1]].parent == names[0]  # learned from the lookup
    assert fake_gateway.chunks[names[2]].parent == names[1]  # previous key in the same store
    expected = env.conn.full_chunk_size_bytes + (env.conn.remote_metadata_bytes if meta else 0)
    assert len(fake_gateway.chunks[names[0]].data) == expected

    assert env.backend.batched_contains(ks) == 3
    got = env.backend.batched_get_blocking(ks[:3])
    assert means(got) == [1.0, 2.0, 3.0]
    stats = env.conn.prefetcher.stats() if env.conn.prefetcher else None
    assert stats is not None and stats.staged_hits == 3  # the lookup staged them
    release(got)
    assert env.free_chunks() == free


def test_async_lookup_path_stages_then_serves(make_env: Callable[..., Env], fake_gateway: FakeGateway) -> None:
    env = make_env()
    ks = keys(3, salt=1)
    store(env, ks, [4.0, 5.0, 6.0])
    assert env.run(env.backend.batched_async_contains("req-1", ks + keys(1, salt=9))) == 3
    objs = env.run(env.backend.batched_get_non_blocking("req-1", ks))
    assert means(objs) == [4.0, 5.0, 6.0]
    release(objs)
    assert fake_gateway.ops("batch_get") == 1  # staged once, served from memory


def test_non_blocking_get_keeps_only_the_prefix(make_env: Callable[..., Env]) -> None:
    env = make_env(prefetch_bytes=0)
    free = env.free_chunks()
    ks = keys(3, salt=2)
    store(env, [ks[0], ks[2]], [1.0, 3.0])
    objs = env.run(env.backend.batched_get_non_blocking("req-2", ks))
    assert means(objs) == [1.0]
    release(objs)
    assert env.free_chunks() == free  # the third chunk was fetched and released


@pytest.mark.parametrize("meta", [True, False], ids=["chunk-meta", "raw"])
def test_partial_last_chunk(make_env: Callable[..., Env], meta: bool) -> None:
    env = make_env(meta=meta, prefetch_bytes=0)
    free = env.free_chunks()
    (key,) = keys(1, salt=3)
    obj = env.chunk(7.0, tokens=5)
    env.backend.batched_submit_put_task([key], [obj])
    time.sleep(0.3)
    obj.ref_count_down()
    (got,) = env.backend.batched_get_blocking([key])
    assert got is not None and got.tensor.shape[2] == 5 and float(got.tensor.float().mean()) == 7.0
    got.ref_count_down()
    assert env.free_chunks() == free


def test_gateway_failures_are_never_lmcaches_problem(make_env: Callable[..., Env], fake_gateway: FakeGateway) -> None:
    env = make_env()
    free = env.free_chunks()
    ks = keys(2, salt=4)
    store(env, ks, [1.0, 2.0])
    fake_gateway.inject(Fault("*", status=503, times=10_000))
    assert env.backend.batched_contains(ks) == 0
    assert env.backend.contains(ks[0]) is False
    assert env.backend.batched_get_blocking(ks) == [None, None]
    assert env.backend.get_blocking(ks[0]) is None
    assert env.run(env.backend.batched_async_contains("r", ks)) == 0
    store(env, keys(1, salt=5), [9.0], lands=False)  # must not raise
    assert env.conn.client.health is not CircuitState.CLOSED
    fake_gateway.faults.clear()
    deadline = time.monotonic() + 5
    while env.conn.client.health is not CircuitState.CLOSED:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert env.backend.batched_contains(ks) == 2
    got = env.backend.batched_get_blocking(ks)
    assert means(got) == [1.0, 2.0]
    release(got)
    assert env.free_chunks() == free
    counters = env.conn.stats()["counters"]
    assert isinstance(counters, dict) and counters["lmcache.get_none"] >= 3


def test_wrong_sized_chunk_is_refused(make_env: Callable[..., Env], fake_gateway: FakeGateway) -> None:
    env = make_env(meta=False, prefetch_bytes=0)
    (key,) = keys(1, salt=6)
    fake_gateway.put_chunk(key.to_string(), b"\x01" * 1000)  # not a whole number of tokens
    assert env.backend.batched_get_blocking([key]) == [None]
    counters = env.conn.stats()["counters"]
    assert isinstance(counters, dict) and counters["lmcache.bad_size"] == 1


def test_health_check_probe_key_survives_write_once(make_env: Callable[..., Env]) -> None:
    env = make_env(prefetch_bytes=0)
    probe = CacheEngineKey("test", 1, 0, 0, torch.bfloat16)
    for value in (1.0, 2.0):  # LMCache writes new bytes under the same key each recovery check
        store(env, [probe], [value])
        (got,) = env.backend.batched_get_blocking([probe])
        assert means([got]) == [value]
        release([got])


def test_ping_and_settings(make_env: Callable[..., Env], fake_gateway: FakeGateway) -> None:
    env = make_env()
    assert env.run(env.conn.ping()) == 0
    fake_gateway.ready = False
    assert env.run(env.conn.ping()) == 1
    with pytest.raises(ValueError, match=r"kvgw.*settings: pool_sise"):
        ConnectorSettings.from_extra_config({"kvgw.url": "http://gw", "kvgw.bucket": "kvcache", "kvgw.pool_sise": 1},
                                            None, {})
    per_instance = ConnectorSettings.from_extra_config(
        {"kvgw.url": "http://gw", "kvgw.bucket": "kvcache", "remote_storage_plugin.kvgw.b.bucket": "other",
         "remote_storage_plugin.kvgw.b.module_path": "x", "remote_storage_plugin.kvgw.b.class_name": "y"},
        "kvgw.b", {"KVGW_ACCESS_KEY": "AK", "KVGW_SECRET_KEY": "SK"},
    )
    assert per_instance.client.bucket == "other" and per_instance.client.access_key == "AK"
