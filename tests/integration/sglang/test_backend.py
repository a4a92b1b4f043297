"""kvgw's HiCache backend (``kvgw_client.sglang``) under SGLang 0.5.23's own classes, on CPU, against a
real ``kvgw serve``: loaded by SGLang's factory from the documented launch flags, attached as the cache
controller attaches it, driven by the controller's storage loops (batches of 128) over host pools with
the real pools' shapes in every layout.
"""

from __future__ import annotations

import ctypes
import json
import re
import socket
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

from backends.index import MARK_SHARED
from gateway.bench import sglang_engine as harness
from gateway.bench.sglang_engine import MHA_LAYOUTS, MLA_LAYOUTS, MHAHostPool, MLAHostPool, fill_pages
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, leases_granted
from tests.docs import README, section, text
from tests.index_view import IndexView
from tests.integration.sglang.conftest import FAST_FAILURE, new_credential, tokens

harness.load()

from kvgw_client.config import SettingsReader  # noqa: E402
from kvgw_client.hicache import FACTORY_KEYS, SGLANG_KEYS, HiCacheSettings  # noqa: E402
from kvgw_client.sglang import KvgwHiCacheStorage  # noqa: E402  (after the harness made SGLang importable)

PAGE = 16  # tokens per page


def pool_for(layout: str, *, mla: bool = False, **kw: Any) -> Any:
    return MLAHostPool(layout, page_size=PAGE, **kw) if mla else MHAHostPool(layout, page_size=PAGE, **kw)


def written(pool: Any, pages: int, seed: int) -> tuple[list[str], torch.Tensor, list[torch.Tensor]]:
    """A prompt of ``pages`` pages: SGLang's page hashes, host indices holding it, and the pages' contents."""
    hashes = harness.page_hashes(tokens(pages * PAGE, seed), PAGE)
    indices = pool.alloc(pages * PAGE)
    assert indices is not None
    return hashes, indices, fill_pages(pool, indices, seed)


def contents(pool: Any, indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
    return [pool.page_tensor(int(indices[i * PAGE])) for i in range(pages)]


def test_the_factory_loads_it_from_the_launch_flags(make_kvgw: Callable[..., Any]) -> None:
    backend = make_kvgw(pool_for("page_first"))
    assert isinstance(backend, KvgwHiCacheStorage)  # not wrapped: no SGLANG_TEST_HICACHE_* injector set
    assert backend.settings.client.bucket == "kvcache"
    assert backend.key_prefix == "Qwen-Qwen3-8B/tp0of1"
    h = "ab" * 32
    assert backend.name(h) == f"Qwen-Qwen3-8B/tp0of1/{h}"


LAYOUTS = [(lay, False) for lay in MHA_LAYOUTS] + [(lay, True) for lay in MLA_LAYOUTS]


@pytest.mark.parametrize(("layout", "mla"), LAYOUTS)
def test_pages_round_trip_through_a_second_instance(
    make_kvgw: Callable[..., Any], seed: int, layout: str, mla: bool
) -> None:
    """200 pages (a batch of 128, then 72) written by one instance, found and loaded by another into
    another pool of the same layout, byte for byte."""
    writer_pool = pool_for(layout, mla=mla)
    hashes, indices, pages = written(writer_pool, 200, seed)
    writer = make_kvgw(writer_pool, is_mla=mla)
    assert harness.backup(writer, writer_pool, hashes, indices) == 200

    reader_pool = pool_for(layout, mla=mla)
    reader_pool.alloc(7 * PAGE)  # other host indices than the writer's
    reader = make_kvgw(reader_pool, is_mla=mla)
    assert harness.hit_query(reader, hashes) == 200
    target = reader_pool.alloc(200 * PAGE)
    assert harness.transfer(reader, reader_pool, hashes, target) == 200
    for got, want in zip(contents(reader_pool, target, 200), pages, strict=True):
        assert torch.equal(got, want)
    stats = reader.stats()["hicache"]
    assert stats["get.hits"] == 200 and stats["exists.hits"] == 200


def test_a_lookup_stops_at_a_gap(make_kvgw: Callable[..., Any], gateway: ServerProcess, seed: int) -> None:
    """``batch_exists`` is the leading run of stored pages, in one ``prefix`` call per batch; the
    controller's query stops at the batch that falls short."""
    pool = pool_for("page_first", pages=400)
    hashes, indices, _ = written(pool, 300, seed)
    backend = make_kvgw(pool)
    stored = [i for i in range(300) if not 10 <= i < 15]
    for i in stored:  # every page but 10..14
        assert backend.batch_set_v1([hashes[i]], indices[i * PAGE : (i + 1) * PAGE]) == [True]
    calls_before = backend.client.counters.get("prefix.calls")
    granted = leases_granted(gateway)
    assert backend.batch_exists(hashes[:128]) == 10
    assert backend.client.counters.get("prefix.calls") == calls_before + 1
    assert leases_granted(gateway) == granted + 10  # the leading run is leased until loaded (lease_ms)
    assert backend.batch_exists(hashes[15:143]) == 128
    assert harness.hit_query(backend, hashes) == 10
    assert harness.hit_query(backend, hashes[15:]) == 285
    target = pool.alloc(20 * PAGE)
    ok = backend.batch_get_v1(hashes[:20], target)
    assert ok == [True] * 10 + [False] * 5 + [True] * 5  # SGLang counts the leading run: 10


def test_every_page_names_its_predecessor(make_kvgw: Callable[..., Any], seed: int) -> None:
    """X-Kvgw-Parent: the previous page within a batch; across batches, the last of SGLang's prefix_keys
    when it passes them (hicache_storage_pass_prefix_keys), else what a lookup of the chain taught."""
    pool = pool_for("page_first_direct")
    hashes, indices, _ = written(pool, 140, seed)
    backend = make_kvgw(pool)
    sent: list[tuple[str, str | None]] = []
    put = backend.client.put

    async def recording_put(key: str, data: Any, **kw: Any) -> Any:
        sent.append((key, kw.get("parent")))
        return await put(key, data, **kw)

    backend.client.put = recording_put
    assert harness.backup(backend, pool, hashes, indices, prefix_keys=[]) == 140
    parents = dict(sent)
    names = [backend.name(h) for h in hashes]
    assert parents[names[0]] is None
    assert all(parents[names[i]] == names[i - 1] for i in range(1, 140))  # 128 -> 129 from prefix_keys

    more, more_indices, _ = written(pool, 4, seed + 1)  # a second request continues a chain it looked up
    chain = [hashes[-1], *more]
    assert backend.batch_exists(chain) == 1
    sent.clear()
    assert backend.batch_set_v1(more, more_indices) == [True] * 4
    assert dict(sent)[backend.name(more[0])] == names[-1]


def test_pages_of_the_shared_prefix_are_written_shared(
    make_kvgw: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    """With ``shared_prefix_tokens``, the pages within the first N tokens of a prompt (found from SGLang's
    ``prefix_keys``) are written ``X-Kvgw-Retention: shared``; the rest, and pages whose place in their
    prompt is unknown, are not."""
    pool = pool_for("page_first")
    seed += 100_000  # (other tests write prompts of seed + 1)
    hashes, indices, _ = written(pool, 140, seed)
    backend = make_kvgw(pool, shared_prefix_tokens=3 * PAGE + 5)  # three whole pages
    assert harness.backup(backend, pool, hashes, indices, prefix_keys=[]) == 140
    others, other_indices, _ = written(pool, 2, seed + 7)
    assert backend.batch_set_v1(others, other_indices) == [True, True]  # no prefix_keys: place unknown
    index = IndexView(gateway.data_dir)
    try:
        marks = [index.entry(backend.name(h)).marks for h in hashes[:5] + hashes[128:130] + others]  # type: ignore[union-attr]
        assert marks == [MARK_SHARED] * 3 + [0] * 6
    finally:
        index.close()
    assert backend.stats()["hicache"]["set.shared"] == 3


def test_ranks_and_mla(make_kvgw: Callable[..., Any], seed: int) -> None:
    """MHA: each TP rank its own pages (``tp<r>of<n>``). MLA: one name for every rank; rank 0 writes,
    the others store nothing and read what rank 0 wrote."""
    pool0, pool1 = pool_for("page_first"), pool_for("page_first")
    hashes, indices, _ = written(pool0, 8, seed)
    rank0 = make_kvgw(pool0, tp_rank=0, tp_size=2)
    rank1 = make_kvgw(pool1, tp_rank=1, tp_size=2)
    assert rank1.key_prefix == "Qwen-Qwen3-8B/tp1of2"
    assert harness.backup(rank0, pool0, hashes, indices) == 8
    assert rank0.batch_exists(hashes) == 8 and rank1.batch_exists(hashes) == 0

    mla0, mla1 = pool_for("page_first", mla=True), pool_for("page_first", mla=True)
    hashes, indices, pages = written(mla0, 8, seed + 1)
    other, other_indices, _ = written(mla1, 8, seed + 2)
    writer = make_kvgw(mla0, model="deepseek-ai/DeepSeek-V3", tp_rank=0, tp_size=2, is_mla=True)
    reader = make_kvgw(mla1, model="deepseek-ai/DeepSeek-V3", tp_rank=1, tp_size=2, is_mla=True)
    assert writer.key_prefix == reader.key_prefix == "deepseek-ai-DeepSeek-V3"
    assert writer.is_writer and not reader.is_writer
    assert reader.batch_set_v1(other, other_indices) == [True] * 8  # a reader rank's backup is a no-op
    assert writer.batch_exists(other) == 0
    assert harness.backup(writer, mla0, hashes, indices) == 8
    target = mla1.alloc(8 * PAGE)
    assert harness.transfer(reader, mla1, hashes, target) == 8
    assert all(torch.equal(g, w) for g, w in zip(contents(mla1, target, 8), pages, strict=True))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_the_generic_interface(make_kvgw: Callable[..., Any], seed: int, layout: str) -> None:
    """``interface_v1: 0``: flat pages through batch_set / batch_get (the controller's generic path),
    and get / set / exists one page at a time."""
    pool = pool_for(layout)
    hashes, indices, pages = written(pool, 130, seed)
    backend = make_kvgw(pool, interface_v1=0)
    assert harness.backup(backend, pool, hashes, indices, zero_copy=False) == 130
    other = pool_for(layout)
    reader = make_kvgw(other, interface_v1=0)
    target = other.alloc(130 * PAGE)
    assert harness.transfer(reader, other, hashes, target, zero_copy=False) == 130
    assert all(torch.equal(g, w) for g, w in zip(contents(other, target, 130), pages, strict=True))

    assert reader.exists(hashes[0]) and not reader.exists("0" * 64)
    page = reader.get(hashes[1])
    assert page is not None and page.dtype == torch.uint8 and torch.equal(page.view(pool.dtype), pages[1])
    assert reader.get("0" * 64) is None
    single = harness.page_hashes(tokens(PAGE, seed + 99), PAGE)[0]
    assert reader.set(single, pages[2]) and reader.exists(single)
    into = other.get_dummy_flat_data_page()
    assert reader.get(single, into) is into and torch.equal(into, pages[2])
    if layout in ("page_first", "page_first_direct", "page_head"):  # a page-first flat page is the v1 object
        v1 = make_kvgw(pool_for(layout))
        back = v1.mem_pool_host.alloc(PAGE)
        assert v1.batch_get_v1([hashes[3]], back) == [True]
        assert torch.equal(v1.mem_pool_host.page_tensor(int(back[0])), pages[3])


def test_a_page_of_another_shape_is_a_miss(make_kvgw: Callable[..., Any], seed: int) -> None:
    """A stored page whose size is not this pool's page size is never copied into the pool."""
    big = pool_for("page_first", head_num=4)
    hashes, indices, _ = written(big, 2, seed)
    assert harness.backup(make_kvgw(big), big, hashes, indices) == 2
    small = pool_for("page_first", head_num=2)
    backend = make_kvgw(small)
    target = small.alloc(2 * PAGE)
    assert backend.batch_get_v1(hashes, target) == [False, False]
    assert not small.kv_buffer.any()
    assert backend.stats()["hicache"]["size_mismatch"] == 2


def test_storage_metrics(make_kvgw: Callable[..., Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_stats`` hands SGLang a StorageMetrics of the batches since the last call."""

    @dataclass
    class StorageMetrics:  # sglang.srt.observability.metrics_collector.StorageMetrics, fields as in 0.5.23
        prefetch_pgs: list[int] = field(default_factory=list)
        backup_pgs: list[int] = field(default_factory=list)
        prefetch_bandwidth: list[float] = field(default_factory=list)
        backup_bandwidth: list[float] = field(default_factory=list)

    module = types.ModuleType("sglang.srt.observability.metrics_collector")
    module.StorageMetrics = StorageMetrics  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 130, seed)
    backend = make_kvgw(pool, metrics=True)
    harness.backup(backend, pool, hashes, indices)
    harness.transfer(backend, pool, hashes, pool.alloc(130 * PAGE))
    stats = backend.get_stats()
    assert stats.backup_pgs == [128, 2] and stats.prefetch_pgs == [128, 2]
    assert all(bw > 0 for bw in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert backend.get_stats().backup_pgs == []


def test_clear_removes_this_ranks_pages(make_kvgw: Callable[..., Any], gateway: ServerProcess, seed: int) -> None:
    """``clear()`` deletes every page of its rank (list + DELETE) with a delete grant; other ranks'
    pages stay. Without the grant it fails (False), never raises, and deletes nothing."""
    model = f"clear-test/{seed}"
    pool0, pool1 = pool_for("page_first", pages=1100), pool_for("page_first")
    hashes, indices, _ = written(pool0, 1100, seed)  # more than one listing page
    indices1 = pool1.alloc(4 * PAGE)
    rank0 = make_kvgw(pool0, model=model, tp_rank=0, tp_size=2)
    rank1 = make_kvgw(pool1, model=model, tp_rank=1, tp_size=2)
    assert harness.backup(rank0, pool0, hashes, indices) == 1100
    assert harness.backup(rank1, pool1, hashes[:4], indices1) == 4

    ak, sk = new_credential(gateway, "--write")
    no_delete = make_kvgw(pool_for("page_first"), model=model, tp_rank=0, tp_size=2, access_key=ak, secret_key=sk)
    assert no_delete.clear() is False
    assert rank0.batch_exists(hashes[:128]) == 128

    ak, sk = new_credential(gateway, "--write", "--delete")
    deleter = make_kvgw(pool_for("page_first"), model=model, tp_rank=0, tp_size=2, access_key=ak, secret_key=sk)
    assert deleter.clear() is True
    assert deleter.stats()["hicache"]["cleared"] == 1100
    assert rank0.batch_exists(hashes[:128]) == 0
    assert rank1.batch_exists(hashes[:4]) == 4


# -- failures: a miss or a failed set, never an exception, never longer than the timeout --------------------


def free_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


@pytest.mark.parametrize("where", ["refused", "silent"])
def test_an_unreachable_gateway_is_a_miss(
    make_kvgw: Callable[..., Any], seed: int, where: str, request: pytest.FixtureRequest
) -> None:
    port = free_port() if where == "refused" else request.getfixturevalue("silent_port")
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 130, seed)
    backend = make_kvgw(pool, url=f"http://127.0.0.1:{port}", **FAST_FAILURE)
    bound = FAST_FAILURE["io_timeout_s"] + FAST_FAILURE["lookup_timeout_s"] + 1.0
    calls: list[tuple[Callable[[], Any], Any]] = [
        (lambda: backend.batch_exists(hashes[:128]), 0),
        (lambda: backend.batch_set_v1(hashes[:128], indices[: 128 * PAGE]), [False] * 128),
        (lambda: backend.batch_get_v1(hashes[:128], indices[: 128 * PAGE]), [False] * 128),
        (lambda: backend.exists(hashes[0]), False),
        (lambda: backend.get(hashes[0]), None),
        (lambda: backend.set(hashes[0], pool.get_data_page(0)), False),
        (lambda: backend.batch_set(hashes[:2], [pool.get_data_page(0), pool.get_data_page(PAGE)]), False),
        (lambda: backend.batch_get(hashes[:2], [pool.get_dummy_flat_data_page()] * 2), [None, None]),
    ]
    for call, expected in calls:
        started = time.monotonic()
        assert call() == expected
        assert time.monotonic() - started < bound
    started = time.monotonic()
    assert backend.clear() is False
    failures = backend.client.stats()["failures"]
    assert failures and all(kind.split(".")[1] in ("unavailable", "timeout", "circuit_open") for kind in failures)


def test_it_recovers_when_the_gateway_comes_back(
    server_factory: type[ServerProcess], tmp_path: Any, make_kvgw: Callable[..., Any], seed: int
) -> None:
    server = server_factory(data_dir=tmp_path / "own").start()
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 4, seed)
    backend = make_kvgw(pool, url=server.url, **FAST_FAILURE)
    assert harness.backup(backend, pool, hashes, indices) == 4
    server.stop()
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_get_v1(hashes, indices) == [False] * 4
    server.start()
    deadline = time.monotonic() + 30
    while backend.batch_exists(hashes) != 4:
        assert time.monotonic() < deadline, "the backend did not recover"
        time.sleep(0.1)
    assert backend.batch_get_v1(hashes, indices) == [True] * 4


def test_a_bad_call_is_counted_not_raised(make_kvgw: Callable[..., Any], seed: int) -> None:
    """Host indices that do not match the keys (an SGLang-side surprise): False, counted, logged once."""
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 2, seed)
    backend = make_kvgw(pool)
    assert backend.batch_get_v1(hashes, indices[:PAGE]) == [False, False]
    assert backend.batch_set_v1(hashes, indices[: PAGE + 1]) == [False, False]
    assert backend.stats()["hicache_failures"] == {"batch_get_v1.ValueError": 1, "batch_set_v1.ValueError": 1}


def test_the_pages_are_kvgw_chunks(make_kvgw: Callable[..., Any], gateway: ServerProcess, seed: int) -> None:
    """A page is an ordinary chunk: its buffers back to back, readable through the native API."""
    pool = pool_for("layer_first")
    hashes, indices, _ = written(pool, 1, seed)
    backend = make_kvgw(pool, ttl_s=3600)
    assert harness.backup(backend, pool, hashes, indices) == 1
    addresses, sizes = pool.get_page_buffer_meta(indices)
    expected = b"".join(ctypes.string_at(a, n) for a, n in zip(addresses, sizes, strict=True))
    resp = httpx.get(gateway.chunk_url(backend.name(hashes[0])), headers=gateway.auth)
    assert resp.status_code == 200 and resp.content == expected
    assert len(expected) == pool.page_bytes


def test_unknown_settings_fail_the_attach(make_kvgw: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="unknown kvgw HiCache settings: acess_key"):
        make_kvgw(pool_for("page_first"), acess_key="x")


def test_credentials_from_the_environment(
    make_kvgw: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setenv("KVGW_ACCESS_KEY", ROOT_AK)
    monkeypatch.setenv("KVGW_SECRET_KEY", ROOT_SK)
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 1, seed)
    backend = make_kvgw(pool, access_key=None, secret_key=None)
    assert harness.backup(backend, pool, hashes, indices) == 1


def sglang_doc(where: str) -> str:
    """kvgw's SGLang documentation: ``docs/sglang.md``, or the README's short "SGLang HiCache" section."""
    return section(README.read_text(), "SGLang HiCache") if where == "README.md" else text("docs/sglang.md")


@pytest.mark.parametrize("where", ["docs/sglang.md", "README.md"])
def test_the_documented_launch_flags(
    gateway: ServerProcess, seed: int, where: str
) -> None:
    """The ``--hicache-storage-backend-extra-config`` for kvgw's backend, as written in the docs page and
    the README and as SGLang parses it (its JSON, with SGLang's own keys removed by its controller),
    loads and works."""
    doc = sglang_doc(where)
    flags = re.findall(r"--hicache-storage-backend-extra-config '(\{.*?\})'", doc, flags=re.S)
    extra = json.loads(flags[0])
    assert extra["module_path"] == "kvgw_client.sglang" and extra["class_name"] == "KvgwHiCacheStorage"
    assert "--hicache-storage-backend dynamic" in doc
    extra.pop("hicache_storage_pass_prefix_keys")  # HybridCacheController.parse_storage_backend_extra_config
    extra.update(url=gateway.url, access_key=ROOT_AK, secret_key=ROOT_SK)
    pool = pool_for("page_first")
    hashes, indices, _ = written(pool, 2, seed)
    backend = harness.attach("dynamic", harness.storage_config(extra=extra), pool)
    try:
        assert harness.backup(backend, pool, hashes, indices) == 2
        assert backend.batch_exists(hashes) == 2
    finally:
        backend.close()


def test_every_key_the_backend_reads_is_documented(gateway: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """``docs/sglang.md``'s table names every extra-config key the backend reads, and SGLang's own."""
    page = sglang_doc("docs/sglang.md")
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", page, flags=re.M))
    for row in re.findall(r"^\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)+) \|", page, flags=re.M):
        documented |= set(re.findall(r"`([a-z_0-9]+)`", row))
    read: set[str] = set()
    raw = SettingsReader._raw

    def spy(self: SettingsReader, key: str) -> object | None:
        read.add(key)
        return raw(self, key)

    monkeypatch.setattr(SettingsReader, "_raw", spy)
    HiCacheSettings.from_extra_config({"url": gateway.url}, {})
    assert read - documented == set()  # every key the backend reads is in the page's table
    assert (FACTORY_KEYS | SGLANG_KEYS) - {"tp_lcm_size"} <= documented

