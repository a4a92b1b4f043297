"""kvgw's tier (``kvgw_client.vllm.KvgwTier``) inside vLLM 0.33's own ``TieringOffloadingManager`` on CPU,
against a real ``kvgw serve``: engine A stores blocks, engine B (a fresh primary tier) looks them up
(RETRY while the step's one ``exists`` call is in flight, then HIT) and loads them byte for byte; names
are vLLM's own; direct reads from the gateway's directory; a gateway stopped mid-job."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.index import MARK_ENDED
from gateway.bench.vllm_engine import block_keys
from tests.conftest import ServerProcess, wait_for
from tests.http_faults import Fault, HttpFaultProxy
from tests.index_view import IndexView
from tests.integration.vllm.conftest import kvgw_tier

MiB = 1 << 20


def blocks(n: int, size: int = MiB) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def test_store_then_another_engine_loads_retry_then_hit_byte_identical(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    keys, data = block_keys(8, seed), blocks(8)
    a = engines([kvgw_tier(gateway)])
    a.store(keys, data)
    (tier_a,) = a.tiers
    assert tier_a.stats()["tier"]["store.blocks"] == 8 and tier_a.stats()["tier"]["store.failed"] == 0

    b = engines([kvgw_tier(gateway)])
    got = b.load(keys)
    assert got.answers[0] == ["RETRY"] * 8  # the step's lookup batch is in flight
    assert got.answers[-1] == ["HIT"] * 8
    assert got.data == data
    (tier_b,) = b.tiers
    counters = tier_b.stats()["counters"]
    # one exists call for the 8 keys of the step, one batch-get for the load job
    assert (counters["exists.calls"], counters["batch_get.calls"], counters["batch_get.ok"]) == (1, 1, 8)
    assert tier_b.stats()["tier"]["lookup.batches"] == 1

    # what kvgw holds: vLLM's block names (its FileMapper's path, no leading "/"), a chain of parents
    names = [tier_a.name_of(k) for k in keys]
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=a.spec, blocks_per_file=1,
                                             parallel_agnostic=True)
    assert names == [mapper.get_file_name(k).lstrip("/") for k in keys]
    assert names[0].startswith("Qwen_Qwen3-8B_") and "_r0/" in names[0]
    got_chunk = httpx.get(gateway.chunk_url(names[3]), headers=gateway.auth, timeout=60)
    assert got_chunk.content == data[3]
    index = IndexView(gateway.data_dir)
    try:
        assert [index.parent(n) for n in names[1:]] == [index.digest(n) for n in names[:-1]]
    finally:
        index.close()


def test_a_finished_request_marks_its_blocks_ended(engines: Callable[..., Any], gateway: ServerProcess,
                                                   seed: int) -> None:
    """vLLM's ``on_request_finished`` becomes kvgw's request-end hint (``ended``) for the request's
    blocks: the lifecycle learns how often such blocks come back (docs/lifecycle.md)."""
    keys, data = block_keys(4, seed), blocks(4)
    a = engines([kvgw_tier(gateway)])
    a.store(keys, data)  # one request: stored, then finished
    (tier_a,) = a.tiers
    names = [tier_a.name_of(k) for k in keys]
    index = IndexView(gateway.data_dir)
    try:
        wait_for(lambda: all(entry is not None and entry.marks & MARK_ENDED
                             for entry in map(index.entry, names)), "the request's blocks marked ended")
    finally:
        index.close()
    assert tier_a.stats()["tier"]["requests.finished_blocks"] == 4


def test_blocks_are_named_as_vllms_fs_tier_names_its_files(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int, tmp_path: Path
) -> None:
    """vLLM's ``fs`` tier and kvgw's tier side by side in one engine: each file the fs tier writes (path
    under its root) is a chunk of kvgw under the same name, with the same bytes."""
    keys, data = block_keys(3, seed), blocks(3)
    root = tmp_path / "fs-tier"
    a = engines([{"type": "fs", "root_dir": str(root)}, kvgw_tier(gateway)])
    a.store(keys, data)
    files = sorted(p for p in root.rglob("*.bin"))
    assert len(files) == 3
    for path in files:
        name = str(path.relative_to(root))
        got = httpx.get(gateway.chunk_url(name), headers=gateway.auth, timeout=60)
        assert got.status_code == 200 and got.content == path.read_bytes()


def test_loads_read_the_gateways_directory_directly(
    engines: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    keys, data = block_keys(4, seed), blocks(4)
    engines([kvgw_tier(gateway)]).store(keys, data)
    root = str((gateway.data_dir / "fs").resolve())
    b = engines([kvgw_tier(gateway, direct_read_root=root)])
    assert b.load(keys).data == data
    counters = b.tiers[0].stats()["counters"]
    assert counters["direct.ok"] == 4 and counters.get("batch_get.bytes", 0) == 0


def test_a_misspelt_setting_fails_the_start(engines: Callable[..., Any], gateway: ServerProcess) -> None:
    with pytest.raises(ValueError, match="unknown kvgw tier settings: lookup_timeout"):
        engines([kvgw_tier(gateway, lookup_timeout=1)])


def test_a_gateway_stopped_mid_job(
    engines: Callable[..., Any], server_factory: type[ServerProcess], tmp_path: Path, seed: int
) -> None:
    """The gateway is killed while a load job's batch-get is on its way (held by a proxy): the job fails
    within ``io_timeout_s``, vLLM's manager frees the slots and the blocks miss; stores fail too; nothing
    raises into vLLM. Once the gateway is back, the same blocks load again."""
    server = server_factory(data_dir=tmp_path / "data").start()
    proxy = HttpFaultProxy(server.url).start()
    try:
        options = {"io_timeout_s": 3, "lookup_timeout_s": 2, "cooldown_s": 0.2, "cooldown_max_s": 0.5}
        tier = kvgw_tier(server, **options) | {"url": proxy.url}
        keys, data = block_keys(4, seed), blocks(4)
        engines([tier]).store(keys, data)

        b = engines([tier])
        proxy.inject(Fault("batch_get", delay=1.0))

        def kill_when_the_load_is_sent() -> None:
            wait_for(lambda: proxy.ops("batch_get") >= 1, "the load's batch-get at the proxy")
            server.kill()

        killer = threading.Thread(target=kill_when_the_load_is_sent)
        killer.start()
        got = b.load(keys)
        killer.join()
        assert "HIT_PENDING" in got.answers[-2]  # the promotion (load job) was under way
        assert got.data == [None] * 4 and got.answers[-1] == ["MISS"] * 4
        stats = b.tiers[0].stats()
        assert stats["tier"]["load.failed"] == 4

        more = block_keys(2, seed + 1)
        b.store(more, blocks(2))  # the gateway is down: the store job fails, reported to vLLM
        assert b.tiers[0].stats()["tier"]["store.failed"] == 2

        server_factory(data_dir=server.data_dir, port=server.port).start()  # stopped with the test

        def loads_again() -> bool:
            return bool(engines([tier]).load(keys).data == data)

        wait_for(loads_again, "the blocks to load again once the gateway is back", timeout=60)
    finally:
        proxy.close()
