"""KvgwClient against the in-process fake of the native API: wire behaviour and failure policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from gateway import wire
from gateway.client.errors import CircuitOpen, ProtocolError, Rejected, ServerError, Unavailable
from gateway.client.framing import ItemStatus
from gateway.client.health import CircuitState
from gateway.client.http import KvgwClient, PutOutcome, encode_key
from tests.unit.client.conftest import fast_settings
from tests.unit.client.fake_gateway import FakeGateway, Fault

KEY_A = "org/model@1@0@a1b2@bfloat16"
KEY_B = "org/model@1@0@c3d4@bfloat16"


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_key_encoding_escapes_slash_and_at() -> None:
    assert encode_key("a/b@c d%") == "a%2Fb%40c%20d%25"


def test_put_get_roundtrip_with_parent_and_ttl(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    c = kvgw_client.blocking
    payload = bytes(range(256)) * 4000
    assert c.put(KEY_A, payload) is PutOutcome.STORED
    assert c.put(KEY_B, [b"head", memoryview(payload)], parent=KEY_A, ttl=60) is PutOutcome.STORED
    stored = fake_gateway.chunks[KEY_B]
    assert stored.data == b"head" + payload and stored.parent == KEY_A and stored.ttl == 60
    assert c.get(KEY_A) == payload
    assert c.get("absent@key") is None


def test_write_once_second_put_reports_existed(kvgw_client: KvgwClient) -> None:
    assert kvgw_client.blocking.put(KEY_A, b"first") is PutOutcome.STORED
    assert kvgw_client.blocking.put(KEY_A, b"second") is PutOutcome.EXISTED


def test_exists_and_prefix(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.put_chunk(KEY_A, b"a")
    fake_gateway.put_chunk(KEY_B, b"b")
    c = kvgw_client.blocking
    assert c.exists([KEY_A, "nope", KEY_B]) == [True, False, True]
    assert c.prefix([KEY_A, KEY_B, "nope", KEY_A]) == 2
    assert c.prefix([]) == 0 and c.exists([]) == []


def test_large_key_lists_are_split_into_calls(
    fake_gateway: FakeGateway, make_client: Callable[..., KvgwClient]
) -> None:
    client = make_client(fake_gateway.url, max_keys_per_call=3)
    keys = [f"k{i}" for i in range(8)]
    for key in keys[:7]:
        fake_gateway.put_chunk(key, key.encode())
    assert client.blocking.exists(keys) == [True] * 7 + [False]
    assert client.blocking.prefix(keys) == 7
    statuses = client.blocking.batch_get_into(keys, lambda i, n: memoryview(bytearray(n)))
    assert statuses == [ItemStatus.OK] * 7 + [ItemStatus.MISSING]
    assert fake_gateway.ops("prefix") == 3 and fake_gateway.ops("batch_get") == 3


def test_get_into_copies_straight_into_the_callers_buffer(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.put_chunk(KEY_A, b"0123456789")
    head, tail = bytearray(3), bytearray(7)

    async def run() -> ItemStatus:
        return await kvgw_client.get_into(KEY_A, lambda i, n: [memoryview(head), memoryview(tail)])

    assert asyncio.run(run()) is ItemStatus.OK
    assert bytes(head + tail) == b"0123456789"


def test_get_retries_a_cut_body_but_not_into_a_handed_out_buffer(
    fake_gateway: FakeGateway, kvgw_client: KvgwClient
) -> None:
    fake_gateway.put_chunk(KEY_A, b"x" * 100_000)
    fake_gateway.inject(Fault("get", cut_after=1000))
    assert kvgw_client.blocking.get(KEY_A) == b"x" * 100_000  # bytes mode: retried
    fake_gateway.inject(Fault("get", cut_after=1000))
    asked: list[int] = []

    def into(index: int, length: int) -> memoryview:
        asked.append(length)
        return memoryview(bytearray(length))

    async def run() -> ItemStatus:
        return await kvgw_client.get_into(KEY_A, into, quiet=True)

    assert asyncio.run(run()) is ItemStatus.LOST
    assert asked == [100_000]


async def test_batch_get_streams_items_to_another_loop(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.put_chunk(KEY_A, b"A" * 100_000)
    fake_gateway.put_chunk(KEY_B, b"B" * 3)
    items = [item async for item in kvgw_client.batch_get([KEY_A, "missing", KEY_B])]
    assert [(i.index, i.status) for i in items] == [(0, ItemStatus.OK), (1, ItemStatus.MISSING), (2, ItemStatus.OK)]
    assert items[0].data == b"A" * 100_000 and items[2].data == b"BBB"


async def test_batch_get_corrupt_frame_is_not_handed_out(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.put_chunk(KEY_A, b"A" * 1000)
    fake_gateway.put_chunk(KEY_B, b"B" * 1000)
    fake_gateway.inject(Fault("batch_get", corrupt=0))
    items = [item async for item in kvgw_client.batch_get([KEY_A, KEY_B])]
    assert [i.status for i in items] == [ItemStatus.CORRUPT, ItemStatus.OK]
    assert items[0].data is None
    assert kvgw_client.stats()["failures"] == {"batch_get.corrupt": 1}


async def test_batch_get_cut_short(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    for key in (KEY_A, KEY_B):
        fake_gateway.put_chunk(key, b"x" * 50_000)
    fake_gateway.inject(Fault("batch_get", cut_after=1))
    items = [item async for item in kvgw_client.batch_get([KEY_A, KEY_B, "c"], quiet=True)]
    assert [i.status for i in items] == [ItemStatus.OK, ItemStatus.LOST, ItemStatus.LOST]
    fake_gateway.inject(Fault("batch_get", cut_after=1))
    seen = []
    with pytest.raises(Unavailable):
        async for item in kvgw_client.batch_get([KEY_A, KEY_B]):
            seen.append(item.status)
    assert seen == [ItemStatus.OK, ItemStatus.LOST]  # every key gets its item before the error


def test_retries_transient_errors_then_succeeds(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.put_chunk(KEY_A, b"a")
    fake_gateway.inject(Fault("exists", status=503, times=1))
    fake_gateway.inject(Fault("get", status=502, times=1))
    fake_gateway.inject(Fault("prefix", drop=True, times=1))
    assert kvgw_client.blocking.exists([KEY_A]) == [True]
    assert kvgw_client.blocking.get(KEY_A) == b"a"
    assert kvgw_client.blocking.prefix([KEY_A]) == 1  # a dropped connection is retried too
    counters = kvgw_client.stats()["counters"]
    assert isinstance(counters, dict) and counters["exists.retries"] == 1 and counters["get.retries"] == 1
    assert fake_gateway.ops("prefix") == 2


def test_client_errors_are_not_retried_and_do_not_trip(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.inject(Fault("exists", status=400, times=10))
    for _ in range(5):
        with pytest.raises(Rejected) as info:
            kvgw_client.blocking.exists([KEY_A])
        assert info.value.code == wire.ErrorCode.INVALID_REQUEST and info.value.request_id == "fake-1"
    assert fake_gateway.ops("exists") == 5
    assert kvgw_client.health is CircuitState.CLOSED


def test_wrong_bucket_and_credentials_are_rejected(
    fake_gateway: FakeGateway, make_client: Callable[..., KvgwClient]
) -> None:
    with pytest.raises(Rejected) as info:
        make_client(fake_gateway.url, bucket="other-bucket").blocking.exists([KEY_A])
    assert info.value.code == wire.ErrorCode.NO_SUCH_BUCKET
    fake_gateway.credentials = ("AK", "SK")
    with pytest.raises(Rejected) as info:
        make_client(fake_gateway.url).blocking.get(KEY_A)
    assert info.value.status == 401
    authed = make_client(fake_gateway.url, access_key="AK", secret_key="SK")
    assert authed.blocking.get(KEY_A) is None


def test_invalid_keys_are_rejected_locally(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    with pytest.raises(Rejected):
        kvgw_client.blocking.put("bad\nkey", b"x")
    assert kvgw_client.blocking.exists(["x" * 2000], quiet=True) == [False]
    assert fake_gateway.log == []


def test_dead_gateway_fails_fast_then_recovers_by_itself(
    fake_gateway: FakeGateway, kvgw_client: KvgwClient
) -> None:
    fake_gateway.put_chunk(KEY_A, b"a")
    fake_gateway.inject(Fault("*", status=503, times=1000))
    with pytest.raises(ServerError):
        kvgw_client.blocking.exists([KEY_A])
    assert kvgw_client.health is not CircuitState.CLOSED
    before = len(fake_gateway.log)
    with pytest.raises(CircuitOpen):
        kvgw_client.blocking.exists([KEY_A])
    assert kvgw_client.blocking.exists([KEY_A], quiet=True) == [False]
    assert kvgw_client.blocking.get(KEY_A, quiet=True) is None
    assert kvgw_client.blocking.put(KEY_B, b"b", quiet=True) is PutOutcome.FAILED
    assert all(op == "readyz" for op, _ in fake_gateway.log[before:])  # only probes reached it
    fake_gateway.faults.clear()
    wait_until(lambda: kvgw_client.health is CircuitState.CLOSED)
    assert kvgw_client.blocking.exists([KEY_A]) == [True]
    failures = kvgw_client.stats()["failures"]
    assert isinstance(failures, dict) and failures["exists.circuit_open"] >= 2


def test_unreachable_gateway_is_quietly_empty(make_client: Callable[..., KvgwClient]) -> None:
    client = make_client("http://127.0.0.1:9")  # discard port: connection refused
    assert client.blocking.exists([KEY_A], quiet=True) == [False]
    assert client.blocking.prefix([KEY_A], quiet=True) == 0
    assert client.blocking.batch_get_into([KEY_A], lambda i, n: None, quiet=True) == [ItemStatus.LOST]
    assert client.blocking.ping() is False
    with pytest.raises(Unavailable):
        client.blocking.get(KEY_A)


def test_deadline_bounds_a_slow_call(fake_gateway: FakeGateway, kvgw_client: KvgwClient) -> None:
    fake_gateway.inject(Fault("prefix", delay=1.0))
    start = time.monotonic()
    assert kvgw_client.blocking.prefix([KEY_A], quiet=True, timeout=0.2) == 0
    assert time.monotonic() - start < 0.8


def test_get_refuses_a_body_that_does_not_match_its_checksum(
    fake_gateway: FakeGateway, kvgw_client: KvgwClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gateway.put_chunk(KEY_A, b"payload")
    monkeypatch.setattr(wire, "checksum", lambda data: "0" * 16)  # the fake now lies about checksums
    with pytest.raises(ProtocolError):
        kvgw_client.blocking.get(KEY_A)
    assert kvgw_client.blocking.get(KEY_A, quiet=True) is None


def test_blocking_calls_are_refused_on_an_event_loop(kvgw_client: KvgwClient) -> None:
    async def misuse() -> None:
        kvgw_client.blocking.exists([KEY_A])

    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(misuse())


def test_ping_and_close(fake_gateway: FakeGateway) -> None:
    client = KvgwClient(fast_settings(fake_gateway.url))
    assert client.blocking.ping() is True
    fake_gateway.ready = False
    assert client.blocking.ping() is False
    client.close()
    assert client.closed
    assert asyncio.run(client.ping()) is False
