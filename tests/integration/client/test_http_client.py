"""KvgwClient against a real ``kvgw serve``: wire behaviour, and the failure policy under real faults.

Faults are real network events: the server killed, a closed port, and ``HttpFaultProxy`` (a proxy
between client and server that delays, cuts, corrupts, answers 5xx or garbage for one exchange).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import pytest

from kvgw_client import wire
from kvgw_client.config import HealthPolicy
from kvgw_client.errors import CircuitOpen, ProtocolError, Rejected, ServerError, Unavailable
from kvgw_client.framing import ItemStatus
from kvgw_client.health import CircuitState
from kvgw_client.http import KvgwClient, PutOutcome
from tests.conftest import ServerProcess
from tests.http_faults import Fault, HttpFaultProxy
from tests.index_view import IndexView

BATCH_HEAD = wire.BATCH_HEADER.size
FRAME_HEAD = wire.FRAME_HEADER.size


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_put_get_round_trip_records_parent_and_ttl(
    shared_server: ServerProcess, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    key_b = names("b")
    c = kvgw_client.blocking
    payload = os.urandom(1 << 20)
    assert c.put(key_a, payload) is PutOutcome.STORED
    assert c.put(key_b, [b"head", memoryview(payload)], parent=key_a, ttl=60) is PutOutcome.STORED
    assert c.get(key_a) == payload
    assert c.get(key_b) == b"head" + payload
    assert c.get("absent@key") is None
    index = IndexView(shared_server.data_dir)
    try:
        assert index.parent(key_b) == index.digest(key_a) and index.parent(key_a) is None
        entry = index.entry(key_b)
        assert entry is not None and 0 < entry.expires - time.time() <= 60
    finally:
        index.close()


def test_write_once_second_put_reports_existed(kvgw_client: KvgwClient, names: Callable[[str], str]) -> None:
    key_a = names("a")
    assert kvgw_client.blocking.put(key_a, b"first") is PutOutcome.STORED
    assert kvgw_client.blocking.put(key_a, b"second") is PutOutcome.EXISTED
    assert kvgw_client.blocking.get(key_a) == b"first"


def test_exists_and_prefix(kvgw_client: KvgwClient, names: Callable[[str], str]) -> None:
    key_a = names("a")
    key_b = names("b")
    c = kvgw_client.blocking
    c.put(key_a, b"a")
    c.put(key_b, b"b")
    assert c.exists([key_a, "nope", key_b]) == [True, False, True]
    assert c.prefix([key_a, key_b, "nope", key_a]) == 2
    assert c.prefix([]) == 0 and c.exists([]) == []


def test_large_key_lists_are_split_into_calls(
    proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    client = make_client(proxy.url, max_keys_per_call=3)
    keys = [names(f"k{i}") for i in range(8)]
    for key in keys[:7]:
        client.blocking.put(key, key.encode())
    assert client.blocking.exists(keys) == [True] * 7 + [False]
    assert client.blocking.prefix(keys) == 7
    statuses = client.blocking.batch_get_into(keys, lambda i, n: memoryview(bytearray(n)))
    assert statuses == [ItemStatus.OK] * 7 + [ItemStatus.MISSING]
    assert proxy.ops("prefix") == 3 and proxy.ops("batch_get") == 3


def test_lookup_answers_of_any_length_are_read_whole(
    proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    """Lookups are read on the client's stream connections (as batch-get is), which keep an error's
    body only up to 64 KiB: an answer for 30,000 keys (~170 KB of JSON) must still arrive whole, and
    the connection serve the next call."""
    client = make_client(proxy.url, max_keys_per_call=30_000)
    stored = names("stored")
    client.blocking.put(stored, b"x")
    keys = [names(f"absent-{i:05d}") for i in range(29_999)] + [stored]
    assert client.blocking.exists(keys) == [False] * 29_999 + [True]
    assert client.blocking.exists(keys[-1:]) == [True]
    assert proxy.ops("exists") == 2


def test_threads_looking_up_at_once_each_get_their_own_answer(
    proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    """Plain threads' lookups go out on their own threads' blocking connections (``kvgw_client.calls``):
    eight threads asking different keys at once, in lockstep, each get the answer to their own
    question, every call's first attempt gets through (no retry, no failure), and the connections are
    kept for the next round, also beyond the pool size (at most one per thread), not opened per call."""
    client = make_client(proxy.url, pool_size=2)
    stored = [names(f"s{i}") for i in range(8)]
    for key in stored:
        client.blocking.put(key, key.encode())
    before = proxy.accepted
    rounds = threading.Barrier(8)
    answers: dict[int, set[tuple[tuple[bool, ...], int]]] = {}

    def ask(i: int) -> None:
        keys = [stored[i], names(f"absent-{i}"), stored[(i + 1) % 8]]
        seen = set()
        for _ in range(20):
            rounds.wait(30)
            seen.add((tuple(client.blocking.exists(keys)), client.blocking.prefix(keys)))
        answers[i] = seen

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {i: {((True, False, True), 1)} for i in range(8)}
    assert client.counters.get("exists.calls") == 160 and client.counters.get("exists.retries") == 0
    assert client.counters.get("prefix.retries") == 0 and client.stats()["failures"] == {}
    assert proxy.ops("exists") == 160 and proxy.accepted - before <= 8


def test_get_into_copies_straight_into_the_callers_buffer(kvgw_client: KvgwClient, names: Callable[[str], str]) -> None:
    key_a = names("a")
    kvgw_client.blocking.put(key_a, b"0123456789")
    head, tail = bytearray(3), bytearray(7)

    async def run() -> ItemStatus:
        return await kvgw_client.get_into(key_a, lambda i, n: [memoryview(head), memoryview(tail)])

    assert asyncio.run(run()) is ItemStatus.OK
    assert bytes(head + tail) == b"0123456789"


def test_get_retries_a_cut_body_but_not_into_a_handed_out_buffer(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    data = os.urandom(100_000)
    kvgw_client.blocking.put(key_a, data)
    proxy.inject(Fault("get", cut_after=1000))
    assert kvgw_client.blocking.get(key_a) == data  # bytes mode: retried
    proxy.inject(Fault("get", cut_after=1000))
    asked: list[int] = []

    def into(index: int, length: int) -> memoryview:
        asked.append(length)
        return memoryview(bytearray(length))

    async def run() -> ItemStatus:
        return await kvgw_client.get_into(key_a, into, quiet=True)

    assert asyncio.run(run()) is ItemStatus.LOST
    assert asked == [100_000]


async def test_batch_get_streams_items_to_another_loop(kvgw_client: KvgwClient, names: Callable[[str], str]) -> None:
    key_a = names("a")
    key_b = names("b")
    await kvgw_client.put(key_a, b"A" * 100_000)
    await kvgw_client.put(key_b, b"B" * 3)
    items = [item async for item in kvgw_client.batch_get([key_a, "missing", key_b])]
    assert [(i.index, i.status) for i in items] == [(0, ItemStatus.OK), (1, ItemStatus.MISSING), (2, ItemStatus.OK)]
    assert items[0].data == b"A" * 100_000 and items[2].data == b"BBB"


async def test_batch_get_frame_damaged_in_flight_is_not_handed_out(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    key_b = names("b")
    await kvgw_client.put(key_a, b"A" * 1000)
    await kvgw_client.put(key_b, b"B" * 1000)
    proxy.inject(Fault("batch_get", corrupt_at=BATCH_HEAD + FRAME_HEAD + 10))  # a payload byte of frame 0
    items = [item async for item in kvgw_client.batch_get([key_a, key_b])]
    assert [i.status for i in items] == [ItemStatus.CORRUPT, ItemStatus.OK]
    assert items[0].data is None and items[1].data == b"B" * 1000
    assert kvgw_client.stats()["failures"] == {"batch_get.corrupt": 1}


async def test_batch_get_cut_short(proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]) -> None:
    key_a = names("a")
    key_b = names("b")
    for key in (key_a, key_b):
        await kvgw_client.put(key, b"x" * 50_000)
    into_second_frame = BATCH_HEAD + FRAME_HEAD + 50_000 + FRAME_HEAD + 100
    proxy.inject(Fault("batch_get", cut_after=into_second_frame))
    items = [item async for item in kvgw_client.batch_get([key_a, key_b, "c"], quiet=True)]
    assert [i.status for i in items] == [ItemStatus.OK, ItemStatus.LOST, ItemStatus.LOST]
    proxy.inject(Fault("batch_get", cut_after=into_second_frame))
    seen = []

    async def drain() -> None:
        async for item in kvgw_client.batch_get([key_a, key_b]):
            seen.append(item.status)

    with pytest.raises(Unavailable):
        await drain()
    assert seen == [ItemStatus.OK, ItemStatus.LOST]  # every key gets its item before the error


def test_retries_transient_errors_then_succeeds(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    kvgw_client.blocking.put(key_a, b"a")
    proxy.inject(Fault("exists", status=503))
    proxy.inject(Fault("get", status=502))
    proxy.inject(Fault("prefix", drop=True))
    assert kvgw_client.blocking.exists([key_a]) == [True]
    assert kvgw_client.blocking.get(key_a) == b"a"
    assert kvgw_client.blocking.prefix([key_a]) == 1  # a dropped connection is retried too
    counters = kvgw_client.stats()["counters"]
    assert isinstance(counters, dict) and counters["exists.retries"] == 1 and counters["get.retries"] == 1
    assert proxy.ops("prefix") == 2


def test_malformed_answers_are_refused_never_used(
    proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    """Answers that are valid HTTP but break the contract, and answers that are not HTTP at all."""
    client = make_client(proxy.url, health=HealthPolicy(failure_threshold=10, cooldown=0.1))
    key = names("a")
    client.blocking.put(key, b"a")
    proxy.inject(Fault("exists", body=b'{"exists": "yes"}'))
    with pytest.raises(ProtocolError):
        client.blocking.exists([key])
    proxy.inject(Fault("prefix", body=b'{"length": 7}'))
    assert client.blocking.prefix([key], quiet=True) == 0
    proxy.inject(Fault("batch_get", body=b"not a batch stream"))
    assert client.blocking.batch_get_into([key], lambda i, n: None, quiet=True) == [ItemStatus.LOST]
    proxy.inject(Fault("get", garble=True))
    assert client.blocking.get(key, quiet=True) is None
    failures = client.stats()["failures"]
    assert failures == {"exists.protocol": 1, "prefix.protocol": 1, "batch_get.protocol": 1, "get.protocol": 1}
    assert client.blocking.get(key) == b"a"


def test_client_errors_are_not_retried_and_do_not_trip(
    proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient]
) -> None:
    client = make_client(proxy.url, max_keys_per_call=200_000)
    too_many = [f"k{i}" for i in range(100_001)]  # over the server's per-call limit: a real 400
    for _ in range(4):
        with pytest.raises(Rejected) as info:
            client.blocking.exists(too_many)
        assert info.value.status == 400 and info.value.code == wire.ErrorCode.INVALID_REQUEST
        assert info.value.request_id
    assert proxy.ops("exists") == 4
    assert client.health is CircuitState.CLOSED


def test_wrong_bucket_and_credentials_are_rejected(
    shared_server: ServerProcess, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    key_a = names("a")
    with pytest.raises(Rejected) as info:
        make_client(shared_server.url, bucket="other-bucket").blocking.exists([key_a])
    assert info.value.code == wire.ErrorCode.NO_SUCH_BUCKET
    with pytest.raises(Rejected) as info:
        make_client(shared_server.url, secret_key="wrong-secret").blocking.get(key_a)
    assert info.value.status == 401
    with pytest.raises(Rejected) as info:
        make_client(shared_server.url, access_key=None, secret_key=None).blocking.get(key_a)
    assert info.value.status == 401  # the server was not started with --anonymous


def test_invalid_keys_are_rejected_locally(proxy: HttpFaultProxy, kvgw_client: KvgwClient) -> None:
    with pytest.raises(Rejected):
        kvgw_client.blocking.put("bad\nkey", b"x")
    assert kvgw_client.blocking.exists(["x" * 2000], quiet=True) == [False]
    assert proxy.log == []


def test_failing_gateway_fails_fast_then_recovers_by_itself(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    key_b = names("b")
    kvgw_client.blocking.put(key_a, b"a")
    proxy.inject(Fault("*", status=503, times=1000))
    with pytest.raises(ServerError):
        kvgw_client.blocking.exists([key_a])
    assert kvgw_client.health is not CircuitState.CLOSED
    before = len(proxy.log)
    with pytest.raises(CircuitOpen):
        kvgw_client.blocking.exists([key_a])
    assert kvgw_client.blocking.exists([key_a], quiet=True) == [False]
    assert kvgw_client.blocking.get(key_a, quiet=True) is None
    assert kvgw_client.blocking.put(key_b, b"b", quiet=True) is PutOutcome.FAILED
    assert all(op == "readyz" for op, _ in proxy.log[before:])  # only probes went out
    proxy.clear()
    wait_until(lambda: kvgw_client.health is CircuitState.CLOSED)
    assert kvgw_client.blocking.exists([key_a]) == [True]
    failures = kvgw_client.stats()["failures"]
    assert isinstance(failures, dict) and failures["exists.circuit_open"] >= 2


def test_killed_gateway_is_quietly_empty_and_recovers_on_the_same_port(
    server: ServerProcess, make_client: Callable[..., KvgwClient], names: Callable[[str], str]
) -> None:
    key_a = names("a")
    client = make_client(server.url)
    client.blocking.put(key_a, b"a")
    server.kill()
    assert client.blocking.exists([key_a], quiet=True) == [False]
    assert client.blocking.prefix([key_a], quiet=True) == 0
    assert client.blocking.batch_get_into([key_a], lambda i, n: None, quiet=True) == [ItemStatus.LOST]
    assert client.blocking.ping() is False
    with pytest.raises(Unavailable):
        client.blocking.get(key_a)
    server.start()
    wait_until(lambda: client.health is CircuitState.CLOSED, timeout=10)
    assert client.blocking.get(key_a) == b"a"


def test_closed_port_is_quietly_empty(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    proxy.refuse()
    assert kvgw_client.blocking.exists([key_a], quiet=True) == [False]
    assert kvgw_client.blocking.put(key_a, b"a", quiet=True) is PutOutcome.FAILED
    proxy.accept()
    wait_until(lambda: kvgw_client.health is CircuitState.CLOSED)
    assert kvgw_client.blocking.put(key_a, b"a") is PutOutcome.STORED


def test_deadline_bounds_a_slow_call(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    """No stopwatch: the proxy holds the request for a minute, and the key is stored, so a call the
    deadline did not end would answer 1 (after the control timeout, a retry gets through). The
    deadline's own answers are 0 (quiet) and its ``Unavailable``."""
    key_a = names("a")
    assert kvgw_client.blocking.put(key_a, b"a") is PutOutcome.STORED
    proxy.inject(Fault("prefix", delay=60.0, times=2))
    assert kvgw_client.blocking.prefix([key_a], quiet=True, timeout=0.2) == 0
    with pytest.raises(Unavailable, match=r"prefix: no answer within 0\.2s"):
        kvgw_client.blocking.prefix([key_a], timeout=0.2)
    proxy.clear()
    assert kvgw_client.blocking.prefix([key_a], timeout=30.0) == 1


def test_get_refuses_a_body_damaged_in_flight(
    proxy: HttpFaultProxy, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    key_a = names("a")
    kvgw_client.blocking.put(key_a, b"payload")
    proxy.inject(Fault("get", corrupt_at=3, times=3))  # every attempt: the checksum never matches
    with pytest.raises(ProtocolError):
        kvgw_client.blocking.get(key_a)
    proxy.inject(Fault("get", corrupt_at=3, times=3))
    assert kvgw_client.blocking.get(key_a, quiet=True) is None


def test_ping_and_close(proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient]) -> None:
    client = make_client(proxy.url)
    assert client.blocking.ping() is True
    proxy.inject(Fault("readyz", status=503))
    assert client.blocking.ping() is False
    client.close()
    assert client.closed
    assert asyncio.run(client.ping()) is False
