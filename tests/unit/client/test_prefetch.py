"""StagingBuffer (bounded LRU with reservations) and Prefetcher (stage, serve, never fetch twice),
over an in-memory ChunkSource: pure logic. The prefetcher against a real gateway and LMCache is in
``tests/integration/lmcache/test_connector.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from kvgw_client.framing import BatchItem, BufferProvider, Destination, ItemStatus, destination_views
from kvgw_client.prefetch import BytesSink, Prefetcher, StagingBuffer

T = TypeVar("T")


# ---------------------------------------------------------------- StagingBuffer


def test_reserve_commit_take() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(100)
    assert buf.reserve("a", 40, group=1) == []
    assert not buf.is_ready("a") and buf.take("a") is None and buf.used == 40
    buf.commit("a", bytearray(40), 40)
    assert buf.is_ready("a")
    assert buf.take("a") == (40, bytearray(40)) and buf.used == 0 and "a" not in buf


def test_lru_eviction_of_other_groups_only() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(100)
    for key in "abc":
        buf.reserve(key, 30, group=1)
        buf.commit(key, bytearray(b"x" * 30), 30)
    assert buf.reserve("d", 30, group=1) is None  # would evict its own group: refused, nothing evicted
    assert buf.used == 90
    assert buf.reserve("d", 30, group=2) == [("a", 30, bytearray(b"x" * 30))]  # oldest first, just enough
    assert buf.used == 90 and "a" not in buf


def test_adopted_entries_are_protected_from_their_requests_reservations() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(100)
    for key in "ab":
        buf.reserve(key, 40, group=1)
        buf.commit(key, bytearray(40), 40)
    assert buf.adopt("a", 2) and not buf.adopt("zz", 2)
    assert buf.room_for(2) == 20 + 40  # free space plus b, which request 2 does not want
    assert [k for k, _, _ in buf.reserve("c", 50, group=2) or []] == ["b"]
    assert buf.reserve("d", 50, group=2) is None  # only a is left, and request 2 wants it


def test_resize_a_reservation() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(100)
    buf.reserve("old", 50, group=1)
    buf.commit("old", bytearray(50), 50)
    buf.reserve("a", 30, group=2)
    assert buf.resize("a", 20, group=2) == [] and buf.used == 70
    assert buf.resize("a", 60, group=2) == [("old", 50, bytearray(50))] and buf.used == 60
    assert buf.resize("a", 101, group=2) is None
    with pytest.raises(KeyError):
        buf.resize("a", 10, group=3)


def test_reservations_are_never_evicted_and_limit_holds() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(100)
    buf.reserve("a", 60, group=1)  # in flight
    buf.reserve("b", 30, group=2)
    buf.commit("b", bytearray(30), 30)
    assert buf.reserve("c", 50, group=3) is None
    assert buf.used == 90
    assert buf.reserve("big", 101, group=4) is None
    assert buf.release_reservation("a", group=9) is False  # someone else's
    assert buf.release_reservation("a", group=1) is True and buf.used == 30
    assert buf.clear() == (30, [bytearray(30)]) and buf.used == 0


def test_commit_must_match_reservation() -> None:
    buf: StagingBuffer[bytearray] = StagingBuffer(10)
    buf.reserve("a", 4, group=1)
    with pytest.raises(ValueError, match="does not match the reservation"):
        buf.commit("a", bytearray(5), 5)
    with pytest.raises(KeyError):
        buf.reserve("a", 4, group=1)


# ---------------------------------------------------------------- Prefetcher


class FakeSource:
    """A ChunkSource on the test's loop; ``gate`` holds batch fetches in flight."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.loop = asyncio.get_running_loop()
        self.chunks = chunks
        self.fetched: Counter[str] = Counter()
        self.prefix_calls = 0
        self.direct_gets = 0
        self.failing: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.after_item: list[object] = []

    def spawn(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def prefix(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> int:
        self.prefix_calls += 1
        n = 0
        while n < len(keys) and keys[n] in self.chunks:
            n += 1
        return n

    async def batch_get(
        self, keys: Sequence[str], *, into: BufferProvider | None = None, quiet: bool = False
    ) -> AsyncIterator[BatchItem]:
        if self.gate is not None:
            await self.gate.wait()
        for i, key in enumerate(keys):
            self.fetched[key] += 1
            data = self.chunks.get(key)
            if data is None:
                yield BatchItem(i, ItemStatus.MISSING)
            elif key in self.failing:
                yield BatchItem(i, ItemStatus.FAILED)
            else:
                assert into is not None
                dest = into(i, len(data))
                if dest is None:
                    yield BatchItem(i, ItemStatus.REFUSED, len(data))
                else:
                    destination_views(dest)[0][:] = data
                    yield BatchItem(i, ItemStatus.OK, len(data))
            await asyncio.sleep(0)


class RecordingSink(BytesSink):
    """Bytes, with a record of what was allocated and released (the LMCache sink frees MemoryObjs here)."""

    def __init__(self, fail_open: bool = False) -> None:
        self.opened: list[str] = []
        self.dropped: list[bytes] = []
        self.fail_open = fail_open

    def open(self, key: str, length: int) -> tuple[Destination, bytearray] | None:  # type: ignore[override]
        if self.fail_open:
            return None
        self.opened.append(key)
        return super().open(key, length)

    def drop(self, handle: bytearray) -> None:
        self.dropped.append(bytes(handle))


def make(source: FakeSource, limit: int) -> Prefetcher[bytearray]:
    return Prefetcher(source, limit, BytesSink())


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_staged_chunks_are_served_from_memory() -> None:
    source = FakeSource({k: k.encode() * 10 for k in "abc"})
    pre = make(source, 1000)
    assert pre.stage(["a", "b", "c"]) == 3
    await settle()
    assert pre.tracks("a")
    assert await pre.get("b") == b"b" * 10
    assert not pre.tracks("b")  # handed over: a one-shot handoff
    stats = pre.stats()
    assert (stats.staged_hits, stats.misses, stats.prefetched_bytes, stats.used_bytes) == (1, 0, 30, 10)
    assert stats.staged_now == 20
    assert source.prefix_calls == 1 and sum(source.fetched.values()) == 3


async def test_only_the_present_prefix_is_fetched() -> None:
    source = FakeSource({"a": b"1", "b": b"2", "d": b"4"})
    pre = make(source, 1000)
    pre.stage(["a", "b", "c", "d"])
    await settle()
    assert set(source.fetched) == {"a", "b"}
    assert not pre.tracks("c") and not pre.tracks("d")
    assert await pre.get("d") is None and pre.stats().misses == 1


async def test_known_prefix_skips_the_lookup() -> None:
    source = FakeSource({"a": b"1", "b": b"2"})
    pre = make(source, 1000)
    pre.stage(["a", "b", "x"], present=2)
    await settle()
    assert source.prefix_calls == 0 and set(source.fetched) == {"a", "b"}


async def test_a_key_in_flight_is_awaited_not_fetched_twice() -> None:
    source = FakeSource({"a": b"A" * 5, "b": b"B" * 5})
    source.gate = asyncio.Event()
    pre = make(source, 1000)
    pre.stage(["a", "b"])
    assert pre.stage(["a", "b"]) == 0  # already in flight
    waiter = asyncio.ensure_future(pre.get("a"))
    await settle()
    assert not waiter.done()
    source.gate.set()
    assert await waiter == b"A" * 5
    assert await pre.get("b") == b"B" * 5
    assert source.fetched == Counter({"a": 1, "b": 1})
    assert pre.stats().staged_hits == 2


async def test_a_cancelled_waiter_does_not_disturb_other_waiters() -> None:
    source = FakeSource({"a": b"A"})
    source.gate = asyncio.Event()
    pre = make(source, 1000)
    pre.stage(["a"])
    impatient = asyncio.ensure_future(pre.get("a"))
    patient = asyncio.ensure_future(pre.get("a"))
    await settle()
    impatient.cancel()
    source.gate.set()
    assert await patient == b"A"


async def test_failed_fetch_is_a_miss_and_frees_its_reservation() -> None:
    source = FakeSource({"a": b"A" * 50, "b": b"B" * 50})
    source.failing.add("a")
    pre = make(source, 1000)
    pre.stage(["a", "b"])
    await settle()
    assert await pre.get("a") is None
    stats = pre.stats()
    assert stats.misses == 1 and stats.staged_now == 50  # only b is staged


async def test_memory_never_exceeds_the_limit_and_unused_bytes_are_counted() -> None:
    chunks = {f"k{i}": bytes([i]) * 100 for i in range(10)}
    source = FakeSource(chunks)
    pre = make(source, 250)
    peaks: list[int] = []
    original = pre._provider

    def spy(*args: Any) -> BufferProvider:
        into = original(*args)

        def wrapped(index: int, length: int) -> memoryview | None:
            view = into(index, length)
            peaks.append(pre.stats().staged_now)
            return view

        return wrapped

    pre._provider = spy  # type: ignore[method-assign]
    pre.stage([f"k{i}" for i in range(5)])  # 500 bytes asked, 250 allowed
    await settle()
    stats = pre.stats()
    assert stats.staged_now == 200 and stats.refused == 3 and stats.evictions == 0
    assert await pre.get("k0") == chunks["k0"]  # the leading chunks were kept
    pre.stage(["k7", "k8"])  # a new request evicts the older, unused k1
    await settle()
    stats = pre.stats()
    assert stats.evictions == 1 and stats.wasted_bytes == 100
    assert max(peaks) <= 250
    pre.close()
    assert pre.stats().wasted_bytes == 300 and pre.stats().staged_now == 0


async def test_known_size_reserves_at_once_and_asks_only_for_what_fits() -> None:
    source = FakeSource({f"k{i}": bytes([i]) * 100 for i in range(5)})
    pre = make(source, 250)
    assert pre.stage([f"k{i}" for i in range(5)], present=5, expected_size=100) == 2
    assert pre.stats().staged_now == 200 and pre.stats().refused == 3  # reserved before anything arrives
    await settle()
    assert set(source.fetched) == {"k0", "k1"}  # the rest was never asked for


async def test_a_requests_own_chunks_are_not_evicted_by_its_second_lookup() -> None:
    """LMCache looks a request up at lookup time and again at retrieve time."""
    source = FakeSource({f"k{i}": bytes([i]) * 100 for i in range(4)})
    pre = make(source, 250)
    keys = [f"k{i}" for i in range(4)]
    pre.stage(keys, present=4, expected_size=100)
    await settle()
    pre.stage(keys, present=4, expected_size=100)  # k0, k1 are this request's: k2 finds no room
    await settle()
    assert await pre.get("k0") == bytes([0]) * 100 and await pre.get("k1") == bytes([1]) * 100
    assert pre.stats().evictions == 0 and pre.stats().refused == 4


async def test_the_first_chunk_that_does_not_fit_ends_the_fetch() -> None:
    source = FakeSource({f"k{i}": bytes([i]) * 100 for i in range(5)})
    pre = make(source, 250)
    pre.stage([f"k{i}" for i in range(5)], present=5)  # size unknown: reserved as frames arrive
    await settle()
    assert source.fetched == Counter({"k0": 1, "k1": 1, "k2": 1})  # k2 refused: k3, k4 never read
    assert pre.stats().refused == 3 and pre.stats().staged_now == 200


async def test_sink_sees_every_release() -> None:
    source = FakeSource({f"k{i}": bytes([i]) * 100 for i in range(4)})
    sink = RecordingSink()
    pre: Prefetcher[bytearray] = Prefetcher(source, 250, sink)
    pre.stage(["k0", "k1"], present=2, expected_size=100)
    await settle()
    pre.stage(["k2", "k3"], present=2, expected_size=100)  # evicts k0, k1 (never used)
    await settle()
    assert sink.dropped == [bytes([0]) * 100, bytes([1]) * 100]
    assert await pre.get("k2") == bytes([2]) * 100  # handed over: the caller owns it now
    pre.discard(["k3"])
    pre.close()
    assert sink.dropped[2:] == [bytes([3]) * 100]
    assert pre.stats().wasted_bytes == 300


async def test_a_sink_that_cannot_allocate_refuses_the_rest() -> None:
    source = FakeSource({"a": b"A", "b": b"B"})
    pre: Prefetcher[bytearray] = Prefetcher(source, 100, RecordingSink(fail_open=True))
    pre.stage(["a", "b"], present=2)
    await settle()
    assert pre.stats().refused == 2 and pre.stats().staged_now == 0 and not pre.tracks("a")


async def test_close_releases_waiters_and_stops_staging() -> None:
    source = FakeSource({"a": b"A"})
    source.gate = asyncio.Event()
    pre = make(source, 100)
    pre.stage(["a"])
    waiter = asyncio.ensure_future(pre.get("a"))
    await settle()
    pre.close()
    assert await waiter is None
    assert pre.stage(["a"]) == 0


async def test_take_ready_is_all_or_nothing() -> None:
    source = FakeSource({"a": b"A", "b": b"B"})
    source.gate = asyncio.Event()
    pre = make(source, 100)
    pre.stage(["a", "b"], present=2)
    assert pre.take_ready(["a", "b"]) is None  # in flight: nothing taken
    source.gate.set()
    await settle()
    assert pre.take_ready(["a", "zz"]) is None and pre.ready("a")
    assert pre.take_ready(["a", "b"]) == [bytearray(b"A"), bytearray(b"B")]
    assert pre.stats().staged_hits == 2 and not pre.ready("a")
