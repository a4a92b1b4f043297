"""Direct reads (``direct_read_root``): a real ``kvgw serve`` locates chunks, the client reads the
chunk files of the server's own data directory, and anything it cannot read or verify goes through
batch-get, so a damaged or vanished file never yields wrong bytes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvgw_client.direct import parse_locations
from kvgw_client.errors import ProtocolError
from kvgw_client.framing import ItemStatus
from kvgw_client.http import KvgwClient
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess, leases_granted
from tests.http_faults import HttpFaultProxy
from tests.integration.client.conftest import fast_settings


def chunk_file(server: ServerProcess, key: str) -> Path:
    name = chunk_digest("kvcache", key).hex()
    return server.data_dir / "fs" / "chunks" / name[:2] / name[2:4] / name


@pytest.fixture
def direct_client(
    proxy: HttpFaultProxy, shared_server: ServerProcess, make_client: Callable[..., KvgwClient]
) -> KvgwClient:
    return make_client(proxy.url, direct_read_root=str((shared_server.data_dir / "fs").resolve()))


@contextlib.contextmanager
def leasing_client(proxy: HttpFaultProxy, server: ServerProcess) -> Iterator[KvgwClient]:
    """A client reading the server's chunk files directly, whose lookups take 5 s read leases."""
    client = KvgwClient(fast_settings(proxy.url, lease_ms=5000,
                                      direct_read_root=str((server.data_dir / "fs").resolve())))
    try:
        yield client
    finally:
        client.close()


def stored(client: KvgwClient, keys: list[str], repeat: int = 1000) -> list[str]:
    """``keys``, each stored with its own name repeated as its bytes."""
    for key in keys:
        client.blocking.put(key, key.encode() * repeat)
    return keys


class Buffers:
    """A buffer provider that records how often each position was asked for a buffer."""

    def __init__(self) -> None:
        self.bufs: dict[int, bytearray] = {}
        self.calls: dict[int, int] = {}

    def __call__(self, index: int, length: int) -> memoryview:
        self.calls[index] = self.calls.get(index, 0) + 1
        self.bufs[index] = bytearray(length)
        return memoryview(self.bufs[index])


def test_batch_read_takes_the_bytes_from_the_files_not_the_socket(
    proxy: HttpFaultProxy, direct_client: KvgwClient, names: Callable[[str], str]
) -> None:
    keys = [names(str(i)) for i in range(4)]
    bodies = [os.urandom(300_000 + i) for i in range(4)]
    for key, body in zip(keys, bodies, strict=True):
        direct_client.blocking.put(key, body)
    wanted = [keys[0], names("absent"), keys[1], keys[2], keys[3]]
    into = Buffers()
    statuses = direct_client.blocking.batch_get_into(wanted, into)
    assert statuses == [ItemStatus.OK, ItemStatus.MISSING, ItemStatus.OK, ItemStatus.OK, ItemStatus.OK]
    assert [bytes(into.bufs[i]) for i in (0, 2, 3, 4)] == bodies
    assert proxy.ops("locate") == 1 and proxy.ops("batch_get") == 0
    counters = direct_client.stats()["counters"]
    assert isinstance(counters, dict) and counters["direct.ok"] == 4
    assert counters["direct.bytes"] == sum(map(len, bodies))


async def test_items_stream_in_key_order_with_payloads(
    direct_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a, key_b = names("a"), names("b")
    await direct_client.put(key_a, b"alpha" * 1000)
    await direct_client.put(key_b, b"beta" * 1000)
    items = [item async for item in direct_client.batch_get([key_b, names("none"), key_a])]
    assert [(i.index, i.status) for i in items] == [(0, ItemStatus.OK), (1, ItemStatus.MISSING), (2, ItemStatus.OK)]
    assert items[0].data == b"beta" * 1000 and items[2].data == b"alpha" * 1000


def test_damaged_file_is_never_handed_out(
    proxy: HttpFaultProxy, shared_server: ServerProcess, direct_client: KvgwClient, names: Callable[[str], str]
) -> None:
    good, bad = names("good"), names("bad")
    direct_client.blocking.put(good, b"g" * 50_000)
    direct_client.blocking.put(bad, b"b" * 50_000)
    with open(chunk_file(shared_server, bad), "r+b") as f:  # flip one data byte, keep the size
        f.seek(100)
        f.write(b"X")
    into = Buffers()
    statuses = direct_client.blocking.batch_get_into([good, bad], into)
    # the direct read saw the mismatch and asked the gateway, which verified, quarantined, answered missing
    assert statuses == [ItemStatus.OK, ItemStatus.MISSING]
    assert bytes(into.bufs[0]) == b"g" * 50_000
    assert into.calls == {0: 1, 1: 1}  # the fallback reused the buffer the direct read had taken
    assert proxy.ops("batch_get") == 1
    assert direct_client.stats()["counters"]["direct.mismatch"] == 1  # type: ignore[index]
    assert not chunk_file(shared_server, bad).exists()


def test_vanished_file_falls_back_to_the_gateway(
    shared_server: ServerProcess, direct_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key, gone = names("kept"), names("gone")
    direct_client.blocking.put(key, b"k" * 10_000)
    direct_client.blocking.put(gone, b"g" * 10_000)
    chunk_file(shared_server, gone).unlink()  # as if evicted between locate and read
    into = Buffers()
    assert direct_client.blocking.batch_get_into([key, gone], into) == [ItemStatus.OK, ItemStatus.MISSING]
    assert direct_client.stats()["counters"]["direct.unreadable"] == 1  # type: ignore[index]


def test_a_load_right_after_its_lookup_takes_no_second_lease(
    proxy: HttpFaultProxy, shared_server: ServerProcess, names: Callable[[str], str]
) -> None:
    """The lookup's lease covers the direct read's ``locate``; once half of it has run, or after a load
    through the gateway (which ends the lease there), the next lookup asks for one again."""
    now = [1000.0]
    settings = fast_settings(proxy.url, lease_ms=5000, direct_read_root=str((shared_server.data_dir / "fs").resolve()))
    client = KvgwClient(settings, clock=lambda: now[0])
    try:
        keys = [names(str(i)) for i in range(3)]
        for key in keys:
            client.blocking.put(key, key.encode() * 1000)
        before = leases_granted(shared_server)
        assert client.blocking.exists(keys) == [True] * 3
        assert leases_granted(shared_server) == before + 3
        assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 3
        assert proxy.ops("locate") == 1 and leases_granted(shared_server) == before + 3  # no second lease
        now[0] += 2.6  # less than half of the 5 s lease is left
        assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 3
        assert leases_granted(shared_server) == before + 6
        assert client.blocking.get(keys[0]) == keys[0].encode() * 1000  # a load through the gateway
        assert client.blocking.prefix(keys) == 3
        assert leases_granted(shared_server) == before + 9  # the load ended one lease: asked again
    finally:
        client.close()


def test_a_read_under_a_lease_asks_nothing_before_its_bytes_and_still_verifies(
    proxy: HttpFaultProxy, shared_server: ServerProcess, names: Callable[[str], str]
) -> None:
    """Leased keys located once are read again without a ``locate`` (the reads are reported by a
    ``touch`` after them); a chunk deleted and written anew under the same key fails the remembered
    checksum and comes through batch-get, and is located again the next time."""
    with leasing_client(proxy, shared_server) as client:
        keys = stored(client, [names(str(i)) for i in range(3)])
        assert client.blocking.prefix(keys) == 3
        for _ in range(2):
            into = Buffers()
            assert client.blocking.batch_get_into(keys, into) == [ItemStatus.OK] * 3
            assert [bytes(into.bufs[i]) for i in range(3)] == [key.encode() * 1000 for key in keys]
        assert proxy.ops("locate") == 1 and proxy.ops("batch_get") == 0
        assert client.stats()["counters"]["direct.located_before"] == 1  # type: ignore[index]
        wait_for(lambda: proxy.ops("touch") == 1)  # the second read counted for eviction too

        assert client.blocking.delete(keys[1])
        new = os.urandom(len(keys[1]) * 1000)  # the same size: the remembered location still fits it
        client.blocking.put(keys[1], new)
        into = Buffers()
        assert client.blocking.batch_get_into(keys, into) == [ItemStatus.OK] * 3
        assert bytes(into.bufs[1]) == new  # the remembered checksum did not match: batch-get
        assert proxy.ops("batch_get") == 1 and proxy.ops("locate") == 1
        assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 3
        assert proxy.ops("locate") == 2  # what the failed read knew was dropped


def test_remembered_files_are_read_on_the_callers_own_loop(
    proxy: HttpFaultProxy, shared_server: ServerProcess, names: Callable[[str], str]
) -> None:
    """``read_remembered`` reads leased, located chunks on the loop that awaits it, not the client's I/O
    loop, verified; it reads nothing it does not hold leased and located, and gives up (None) on a
    refused buffer or a failed read, leaving the ordinary path to decide."""
    with leasing_client(proxy, shared_server) as client:
        keys = stored(client, [names(str(i)) for i in range(3)])
        assert asyncio.run(client.read_remembered(keys, Buffers())) is None  # not leased
        assert client.blocking.prefix(keys) == 3
        assert asyncio.run(client.read_remembered(keys, Buffers())) is None  # leased, not located
        assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 3  # locates them

        threads: list[str] = []
        into = Buffers()

        def recording(index: int, length: int) -> memoryview:
            threads.append(threading.current_thread().name)
            return into(index, length)

        items = asyncio.run(client.read_remembered(keys, recording))
        assert items is not None and [item.status for item in items] == [ItemStatus.OK] * 3
        assert [bytes(into.bufs[i]) for i in range(3)] == [key.encode() * 1000 for key in keys]
        assert threads == [threading.current_thread().name] * 3  # this thread's loop, not the I/O loop's
        assert proxy.ops("locate") == 1 and proxy.ops("batch_get") == 0
        wait_for(lambda: proxy.ops("touch") == 1)  # reported like any direct read
        assert asyncio.run(client.read_remembered(keys, lambda index, length: None)) is None  # refused

        assert client.blocking.delete(keys[1])
        new = os.urandom(len(keys[1]) * 1000)  # the same size: the remembered location still fits it
        client.blocking.put(keys[1], new)
        assert asyncio.run(client.read_remembered(keys, Buffers())) is None  # its checksum did not match
        assert client.stats()["counters"]["direct.remembered_retried"] == 1  # type: ignore[index]
        into = Buffers()
        assert client.blocking.batch_get_into(keys, into) == [ItemStatus.OK] * 3
        assert bytes(into.bufs[1]) == new  # the ordinary path fetched it through the gateway


def test_reads_reported_by_one_touch_per_window_and_the_rest_on_close(
    proxy: HttpFaultProxy, shared_server: ServerProcess, names: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Direct reads without a ``locate`` are reported in one ``touch`` per window, not one per read; what is
    still unreported when the client closes is sent then. The window is made an hour long here, so no
    timer fires during the test: every report comes from the close."""
    monkeypatch.setattr(KvgwClient, "_touch_delay", lambda self: 3600.0)
    with leasing_client(proxy, shared_server) as client:
        runs = [stored(client, [names(f"{run}-{i}") for i in range(2)], 500) for run in "ab"]
        for keys in runs:
            assert client.blocking.prefix(keys) == 2
            assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 2  # located
        for _ in range(3):
            for keys in runs:
                assert client.blocking.batch_get_into(keys, Buffers()) == [ItemStatus.OK] * 2  # not located
        assert proxy.ops("locate") == 2 and proxy.ops("touch") == 0
        assert client.stats()["counters"]["direct.located_before"] == 6  # type: ignore[index]
    assert proxy.ops("touch") == 1  # six reads of four keys, reported in one call


def wait_for(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (a background call lands); fails after 10 s without it."""
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_wrong_root_still_serves_every_chunk_through_http(
    proxy: HttpFaultProxy, tmp_path: Path, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    client = make_client(proxy.url, direct_read_root=str(tmp_path))
    keys = [names(str(i)) for i in range(3)]
    for key in keys:
        client.blocking.put(key, key.encode() * 100)
    into = Buffers()
    assert client.blocking.batch_get_into(keys, into) == [ItemStatus.OK] * 3
    assert [bytes(into.bufs[i]) for i in range(3)] == [k.encode() * 100 for k in keys]
    assert into.calls == {0: 1, 1: 1, 2: 1}
    assert proxy.ops("batch_get") == 1


def test_locate_answers_from_the_index_and_needs_read_rights(
    shared_server: ServerProcess, names: Callable[[str], str]
) -> None:
    key = names("loc")
    with httpx.Client(base_url=shared_server.url, headers=shared_server.auth) as c:
        assert c.put(shared_server.chunk_url(key), content=b"z" * 1234).status_code == 201
        r = c.post("/v1/buckets/kvcache/locate", json={"keys": [key, names("nope")]})
        assert r.status_code == 200
        first, second = r.json()["chunks"]
        assert second is None
        assert first["size"] == 1234 and len(first["checksum"]) == 16
        assert (shared_server.data_dir / "fs" / first["path"]) == chunk_file(shared_server, key)
        bad = c.post("/v1/buckets/kvcache/locate", json={"keys": "not-a-list"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "InvalidRequest"
    anon = httpx.post(f"{shared_server.url}/v1/buckets/kvcache/locate", json={"keys": [key]})
    assert anon.status_code == 401 and anon.json()["error"]["code"] == "Unauthorized"


@pytest.mark.parametrize("entry", [
    {"size": 1, "checksum": "00", "path": "../etc/passwd"},
    {"size": 1, "checksum": "00", "path": "/etc/passwd"},
    {"size": 1, "checksum": "00", "path": "chunks/../../x"},
    {"size": -1, "checksum": "00", "path": "chunks/a"},
    {"size": 1, "checksum": "zz", "path": "chunks/a"},
    {"size": 1},
])
def test_locate_answers_that_could_escape_the_root_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        parse_locations({"chunks": [entry]}, 1, 1 << 30)
    with pytest.raises(ProtocolError):
        parse_locations({"chunks": []}, 1, 1 << 30)
