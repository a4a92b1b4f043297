"""The lifecycle engine over the real filesystem tier and LMDB index (no S3): TTL and eviction order."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from backends.catalog.store import BucketPolicy
from backends.tiers import TierId
from gateway.config import load_settings
from gateway.runtime import Gateway
from kvgw_client.keys import chunk_digest
from kvgw_client.wire import Hint
from tests.conftest import wait_for_async


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gateway(tmp_path: Path, clock: Clock) -> Iterator[Gateway]:
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False)
    gw = Gateway(settings, clock=clock)
    yield gw
    gw.close()


async def start(gw: Gateway) -> None:
    """Start, then let the cluster settle: a new index is resynced with the tier and the shared usage
    ledger recounted in the background, which would race with the test's first writes."""
    await gw.start()
    await wait_for_async(lambda: gw.cluster.subscriber.caught_up_at and not gw.cluster.resyncing,
                         "the cluster feed caught up")


async def body(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def put(gw: Gateway, bucket: BucketPolicy, key: str, size: int = 1000, **kw: object) -> None:
    result = await gw.service.put(bucket, key, body(os.urandom(size)), length=size, **kw)  # type: ignore[arg-type]
    assert result.created


async def make_bucket(gw: Gateway, name: str, policy: str, capacity: int = 10_000) -> BucketPolicy:
    bucket = BucketPolicy(name, 1 << 20, capacity_bytes=capacity, high_watermark=0.9, low_watermark=0.8,
                          eviction_policy=policy)
    gw.catalog.create_bucket(bucket)
    gw.directory.load()
    return bucket


def on_disk(gw: Gateway, bucket: str, key: str) -> bool:
    return os.path.exists(gw.fs.path_for(chunk_digest(bucket, key)))


async def fill(gw: Gateway, clock: Clock, bucket: BucketPolicy, keys: str) -> None:
    for k in keys:
        clock.now += 1
        await put(gw, bucket, k)


async def read(gw: Gateway, clock: Clock, bucket: BucketPolicy, keys: str) -> None:
    for k in keys:
        clock.now += 1
        b = await gw.service.open(bucket, k)
        await b.close()


def survivors(gw: Gateway, bucket: BucketPolicy, keys: str) -> str:
    return "".join(k for k in keys if on_disk(gw, bucket.name, k))


async def test_ttl_expiry_reclaims_bytes_within_a_pass(gateway: Gateway, clock: Clock) -> None:
    await start(gateway)
    try:
        bucket = await gateway.service.bucket("kvcache")
        await put(gateway, bucket, "short", ttl=5)
        await put(gateway, bucket, "long", ttl=500)
        await put(gateway, bucket, "forever")
        clock.now += 6
        assert await gateway.service.lookup(bucket, "short") is None  # absent at once
        assert on_disk(gateway, "kvcache", "short")  # bytes not yet reclaimed
        report = await gateway.lifecycle.run_pass()
        assert report.expired == 1
        assert not on_disk(gateway, "kvcache", "short")
        assert gateway.index.get(chunk_digest("kvcache", "short")) is None
        assert on_disk(gateway, "kvcache", "long") and on_disk(gateway, "kvcache", "forever")
    finally:
        await gateway.stop()


async def test_bucket_default_ttl(gateway: Gateway, clock: Clock) -> None:
    gateway.catalog.update_bucket(replace(await gateway.service.bucket("kvcache"), default_ttl_seconds=10))
    gateway.directory.load()
    await start(gateway)
    try:
        bucket = await gateway.service.bucket("kvcache")
        await put(gateway, bucket, "k")
        clock.now += 11
        await gateway.lifecycle.run_pass()
        assert not on_disk(gateway, "kvcache", "k")
    finally:
        await gateway.stop()


@pytest.mark.parametrize(
    ("policy", "reads", "expected"),
    [
        ("lru", "a", "adefghij"),  # b, c are the least recently used (a was read)
        ("fifo", "a", "cdefghij"),  # a, b came first; reads do not count
        ("lfu", "abdfgh", "abdfghij"),  # c, e, i, j were read least; c, e least recently
    ],
)
async def test_eviction_order_without_s3_deletes_in_policy_order(
    gateway: Gateway, clock: Clock, policy: str, reads: str, expected: str
) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, f"b-{policy}", policy)
        await fill(gateway, clock, bucket, "abcdefghi")  # 9000 bytes: at, not over, the high mark
        await read(gateway, clock, bucket, reads)
        await fill(gateway, clock, bucket, "j")  # 10 000 bytes > 9000
        report = await gateway.lifecycle.run_pass()
        assert report.evicted == 2
        assert gateway.ledgers.usage(bucket.name, TierId.FS) == 8000
        assert survivors(gateway, bucket, "abcdefghij") == expected
        for gone in sorted(set("abcdefghij") - set(expected)):
            assert await gateway.service.lookup(bucket, gone) is None
    finally:
        await gateway.stop()


@pytest.mark.parametrize("policy", ["prefix-lru", "default"])
async def test_prefix_aware_policy_never_evicts_a_chunk_with_a_cached_descendant(
    gateway: Gateway, clock: Clock, policy: str
) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, f"b-{policy}", policy)
        # chain a <- b <- c <- d (parent links from PUT), then unrelated x, y, z, w, v, u
        previous = None
        for k in "abcd":
            clock.now += 1
            await put(gateway, bucket, k, parent=previous)
            previous = k
        await fill(gateway, clock, bucket, "xyzwvu")  # 10 chunks: over the high mark
        report = await gateway.lifecycle.run_pass()
        assert report.evicted == 2
        # LRU would evict a and b (the oldest); prefix-aware evicts only leaves: d is the chain's
        # leaf, then c becomes one; a and b (still needed by c, d) stay until their tail is gone
        assert survivors(gateway, bucket, "abcdxyzwvu") == "abxyzwvu"
    finally:
        await gateway.stop()


@pytest.mark.parametrize("policy", ["lru", "default"])
async def test_pinned_chunks_stay_and_a_tier_of_pinned_chunks_says_so(
    gateway: Gateway, clock: Clock, policy: str
) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, f"p-{policy}", policy)
        await fill(gateway, clock, bucket, "abcdefghi")
        assert await gateway.service.hint(bucket, list("abcdefg"), Hint.PIN) == 7
        await fill(gateway, clock, bucket, "j")
        report = await gateway.lifecycle.run_pass()
        assert report.evicted == 2
        assert survivors(gateway, bucket, "abcdefghij") == "abcdefgj"  # h and i, not the older pinned ones
        await fill(gateway, clock, bucket, "kl")  # over the high mark again, and k and l pinned too
        assert await gateway.service.hint(bucket, ["k", "l"], Hint.PIN) == 2
        report = await gateway.lifecycle.run_pass()
        assert report.evicted == 1 and survivors(gateway, bucket, "abcdefgjkl") == "abcdefgkl"
        assert "only pinned ones" in gateway.lifecycle.waiting[bucket.name]  # 9000 bytes, all pinned
        assert await gateway.service.hint(bucket, ["a"], Hint.UNPIN) == 1
        report = await gateway.lifecycle.run_pass()
        assert report.evicted == 1 and survivors(gateway, bucket, "abcdefgkl") == "bcdefgkl"
    finally:
        await gateway.stop()


async def test_chains_learnt_from_prefix_calls(gateway: Gateway, clock: Clock) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, "b-learn", "prefix-lru")
        await fill(gateway, clock, bucket, "abcdxyzwvu")
        # no X-Kvgw-Parent: the chain a..d is learnt from the order of a prefix lookup
        assert await gateway.service.prefix(bucket, list("abcd")) == 4
        # the chain is learnt just after the answer, its links written by the index's writer thread
        digests = [chunk_digest(bucket.name, k) for k in "abcd"]
        await wait_for_async(lambda: gateway.index.parents_of(digests[1:]) == digests[:-1], "the chain a..d learnt")
        await gateway.lifecycle.run_pass()
        assert survivors(gateway, bucket, "abcdxyzwvu") == "abxyzwvu"
    finally:
        await gateway.stop()


async def test_engine_state_is_rebuilt_from_the_index_at_start(tmp_path: Path, clock: Clock) -> None:
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False)
    first = Gateway(settings, clock=clock)
    await start(first)
    bucket = await make_bucket(first, "b-restart", "lru")
    await fill(first, clock, bucket, "abcdefghi")
    await read(first, clock, bucket, "a")
    await first.stop()
    first.close()

    second = Gateway(settings, clock=clock)
    await start(second)
    try:
        assert second.ledgers.usage("b-restart", TierId.FS) == 9000
        await fill(second, clock, bucket, "j")
        await second.lifecycle.run_pass()
        assert survivors(second, bucket, "abcdefghij") == "adefghij"
    finally:
        await second.stop()
        second.close()


async def test_what_reuse_learnt_survives_a_restart(tmp_path: Path, clock: Clock) -> None:
    """The leader keeps the policy's learnt state in the catalog (``policy_state``); after a restart the
    policy goes on from it (trusted at once) instead of starting over as prefix-LRU."""
    settings = load_settings(data_dir=tmp_path / "data", lifecycle_interval=3600.0, fsync=False)
    first = Gateway(settings, clock=clock)
    await start(first)
    bucket = await make_bucket(first, "b-learnt", "reuse", capacity=40_000)
    hot = [f"hot{i}" for i in range(15)]
    for _ in range(20):  # a hot set read every round, and a stream of chunks never read again
        for key in hot:  # as an engine does: a hit is read, a miss recomputed and stored
            clock.now += 1
            if await first.service.lookup(bucket, key) is None:
                await put(first, bucket, key)
            else:
                await read(first, clock, bucket, [key])
        for _ in range(20):
            clock.now += 1
            await put(first, bucket, f"cold{clock.now}")
        await first.index.flush()
        await first.lifecycle.run_pass()
    learnt = first.ledgers.status()["b-learnt"]["fs"]
    assert learnt["trusted"] and not learnt["restored"], learnt
    await first.stop()  # saves what was learnt since the last pass
    state = first.ledgers.export()
    first.close()

    second = Gateway(settings, clock=clock)
    await start(second)
    try:
        await second.lifecycle.run_pass()
        status = second.ledgers.status()["b-learnt"]["fs"]
        assert status == {**learnt, "restored": True}
        assert second.ledgers.export() == state
    finally:
        await second.stop()
        second.close()


async def test_touches_of_direct_reads_count_for_eviction(gateway: Gateway, clock: Clock) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, "b-touch", "lru")
        await fill(gateway, clock, bucket, "abcdefghi")
        clock.now += 1
        assert gateway.service.touch(bucket, ["a", "b", "absent"]) == 2  # read from the directory directly
        await fill(gateway, clock, bucket, "j")
        await gateway.lifecycle.run_pass()
        assert survivors(gateway, bucket, "abcdefghij") == "abefghij"
    finally:
        await gateway.stop()


class Term:
    """A leadership whose remaining term the test sets."""

    def __init__(self, left: float) -> None:
        self.left = left

    def valid_for(self) -> float:
        return self.left

    def is_leader(self) -> bool:
        return self.left > 0

    def status(self) -> dict[str, object]:
        return {"leader": self.is_leader()}


async def test_only_a_leader_with_time_left_evicts_or_expires(gateway: Gateway, clock: Clock) -> None:
    """Fencing: a process that does not lead, or whose term ends within the fence margin, starts no
    destructive batch; once it leads with time to spare, it does."""
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, "b-fence", "lru")
        await fill(gateway, clock, bucket, "abcdefghij")  # over the high mark
        await put(gateway, await gateway.service.bucket("kvcache"), "ttl", ttl=1)
        clock.now += 5
        term = Term(0.0)
        gateway.lifecycle.leader = term
        for left in (0.0, gateway.lifecycle.fence_margin / 2):
            term.left = left
            report = await gateway.lifecycle.run_pass()
            assert not report.leading and report.evicted == 0 and report.expired == 0
            assert survivors(gateway, bucket, "abcdefghij") == "abcdefghij" and on_disk(gateway, "kvcache", "ttl")
        term.left = 10.0
        report = await gateway.lifecycle.run_pass()
        assert report.leading and report.evicted == 2 and report.expired == 1
        assert not on_disk(gateway, "kvcache", "ttl")
    finally:
        await gateway.stop()


async def test_past_the_high_watermark_eviction_goes_on_to_the_low_one_across_passes(
        gateway: Gateway, clock: Clock) -> None:
    await start(gateway)
    try:
        bucket = await make_bucket(gateway, "b-drain", "lru")
        await fill(gateway, clock, bucket, "abcdefghij")  # 10 000 bytes: over the high mark (9000)
        gateway.lifecycle.budget = 1
        evicted = [(await gateway.lifecycle.run_pass()).evicted for _ in range(4)]
        assert evicted == [1, 1, 0, 0]  # 9000 is not over the high mark, but not yet down to the low
        assert survivors(gateway, bucket, "abcdefghij") == "cdefghij"
    finally:
        await gateway.stop()
