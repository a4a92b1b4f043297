"""The L2 adapter, created by LMCache's own ``--l2-adapter`` parsing and factory, against the fake API."""

from __future__ import annotations

import argparse
import json
import select
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed (.ci/install-lmcache.sh)")

import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from gateway.client.l2_adapter import same_chain
from tests.unit.client.fake_gateway import FakeGateway, Fault

ROUTES = [("native_plugin", "KvgwNativeClient"), ("plugin", "KvgwL2Adapter")]


@pytest.fixture(scope="module")
def cpu() -> tuple[LocalCPUBackend, LMCacheMetadata]:
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01, local_cpu=False)
    metadata = LMCacheMetadata(
        model_name="org/m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 4, 8), chunk_size=16, role="worker",
    )
    return LocalCPUBackend(config, metadata), metadata


@pytest.fixture
def make_adapter(fake_gateway: FakeGateway) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(route: tuple[str, str], **params: object) -> Any:
        parser = argparse.ArgumentParser()
        add_l2_adapters_args(parser)
        adapter_params = {"url": fake_gateway.url, "bucket": "kvcache", "cooldown_s": 0.1,
                          "retry_backoff_s": 0.005, **params}
        spec = {"type": route[0], "module_path": "gateway.client.l2_adapter", "class_name": route[1],
                "adapter_params": adapter_params}
        config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
        adapter = create_l2_adapter(config.adapters[0])
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()


def obj_keys(n: int, tag: int) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=bytes([tag, i]) * 8, model_name="org/m", kv_rank=0) for i in range(n)]


def chunk(cpu: tuple[LocalCPUBackend, LMCacheMetadata], value: float) -> Any:
    backend, metadata = cpu
    obj = backend.allocate(metadata.get_shapes(), metadata.get_dtypes(), MemoryFormat.KV_2LTD)
    assert obj is not None
    obj.tensor.fill_(value)
    return obj


def wait(fd: int, query: Callable[[int], Any], task_id: int) -> Any:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        result = query(task_id)
        if result is not None:
            return result
        select.select([fd], [], [], 0.05)
    raise AssertionError("task did not complete")


def store(adapter: Any, keys: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objs)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done = adapter.pop_completed_store_tasks()
        if task in done:
            return done[task]
        select.select([adapter.get_store_event_fd()], [], [], 0.05)
    raise AssertionError("store did not complete")


def bits(bitmap: Any, n: int) -> list[bool]:
    return [bitmap.test(i) for i in range(n)]


@pytest.mark.parametrize("route", ROUTES, ids=[r[0] for r in ROUTES])
def test_lookup_store_load_delete(
    make_adapter: Callable[..., Any], cpu: Any, fake_gateway: FakeGateway, route: tuple[str, str]
) -> None:
    adapter = make_adapter(route, prefetch_bytes=1 << 20)
    keys = obj_keys(3, tag=len(route[0]))
    lookup = adapter.submit_lookup_and_lock_task(keys, {})
    assert bits(wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, lookup), 3) == [
        False, False, False,
    ]
    result = store(adapter, keys[:2], [chunk(cpu, 1.0), chunk(cpu, 2.0)])
    assert result.is_successful() and result.bytes_transferred() == 2 * 4096
    stored = list(fake_gateway.chunks.values())[-2:]
    assert stored[1].parent is not None and stored[1].parent.endswith(keys[0].chunk_hash.hex())

    lookup = adapter.submit_lookup_and_lock_task(keys, {})
    assert bits(wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, lookup), 3) == [
        True, True, False,
    ]
    buffers = [chunk(cpu, 0.0) for _ in range(3)]
    load = adapter.submit_load_task(keys, buffers)
    assert bits(wait(adapter.get_load_event_fd(), adapter.query_load_result, load), 3) == [True, True, False]
    assert [float(b.tensor.float().mean()) for b in buffers[:2]] == [1.0, 2.0]
    adapter.submit_unlock(keys[:2])
    adapter.delete(keys[:1])
    assert all(not name.endswith(keys[0].chunk_hash.hex()) for name in fake_gateway.chunks)
    for obj in buffers:
        obj.ref_count_down()


def test_load_refuses_a_chunk_of_the_wrong_size(make_adapter: Callable[..., Any], cpu: Any,
                                                fake_gateway: FakeGateway) -> None:
    adapter = make_adapter(ROUTES[0])
    (key,) = obj_keys(1, tag=40)
    fake_gateway.put_chunk(f"org/m@00000000@0@{key.chunk_hash.hex()}", b"short")
    buffer = chunk(cpu, 5.0)
    load = adapter.submit_load_task([key], [buffer])
    assert bits(wait(adapter.get_load_event_fd(), adapter.query_load_result, load), 1) == [False]
    buffer.ref_count_down()


def test_gateway_down_reports_failures_without_raising(make_adapter: Callable[..., Any], cpu: Any,
                                                      fake_gateway: FakeGateway) -> None:
    adapter = make_adapter(ROUTES[1])
    keys = obj_keys(2, tag=50)
    fake_gateway.inject(Fault("*", status=503, times=10_000))
    lookup = adapter.submit_lookup_and_lock_task(keys, {})
    assert bits(wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, lookup), 2) == [
        False, False,
    ]
    objs = [chunk(cpu, 1.0), chunk(cpu, 2.0)]
    assert not store(adapter, keys, objs).is_successful()
    load = adapter.submit_load_task(keys, objs)
    assert bits(wait(adapter.get_load_event_fd(), adapter.query_load_result, load), 2) == [False, False]
    assert adapter.report_status()["is_healthy"] is False
    fake_gateway.faults.clear()
    deadline = time.monotonic() + 5
    while not adapter.report_status()["is_healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for obj in objs:
        obj.ref_count_down()


def test_bad_params_fail_before_the_client_starts() -> None:
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    spec = {"type": "plugin", "module_path": "gateway.client.l2_adapter", "class_name": "KvgwL2Adapter",
            "adapter_params": {"bucket": "kvcache"}}
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    with pytest.raises(ValueError, match="url"):
        create_l2_adapter(config.adapters[0])


def test_same_chain_rule() -> None:
    assert same_chain("m@00000000@0@aa", "m@00000000@0@bb")
    assert not same_chain("m@00000000@0@aa", "m@00000000@1@bb")
    assert not same_chain("m@00000000@0@aa@salt1", "m@00000000@0@bb@salt2")
    assert same_chain("m@00000000@0@aa@s", "m@00000000@0@bb@s")
