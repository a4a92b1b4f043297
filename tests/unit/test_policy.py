"""The sampled eviction policies (what the lifecycle engine runs) over the in-memory source: orders on
handmade traces, the prefix rule, batches, ghosts, what ``default`` learns, bounded memory, registry.

Sampling is exact while a tier holds no more chunks than a round samples (16): the small traces below
have one right answer. Larger ones check what sampling promises: the victims come from the oldest
chunks, never from a chain's middle.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from backends.index import MARK_ONE_OFF, MARK_PINNED, MARK_SESSION_ENDED, MARK_SHARED
from gateway.lifecycle.memory_source import MemorySource
from gateway.lifecycle.policies import POLICIES, make_policy
from gateway.lifecycle.policy import (
    Candidate,
    FIFOPolicy,
    HitDensityPolicy,
    LFUPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    SampledPolicy,
)
from gateway.lifecycle.policy_reuse import ReusePolicy

ALL = sorted(POLICIES)
PREFIX_AWARE = ["prefix-lru", "hit-density", "default"]


def evict(policy: SampledPolicy[Any], source: MemorySource[Any], now: float = 1e6) -> Any:
    """Evict like the engine: pick, read the parent, evict (remembering it), report."""
    if policy.learns:
        while source.observations:
            policy.learn(source.observations.popleft())
    victim = policy.victim(source, now)
    assert victim is not None
    assert victim.key in source
    parent = source.parent(victim.key)
    policy.evicted(victim, parent, source, now, remembered=source.evict(victim.key, now))
    return victim.key


def order(policy: SampledPolicy[Any], source: MemorySource[Any]) -> list[Any]:
    return [evict(policy, source) for _ in range(len(source))]


def filled(keys: str, *, start: float = 0.0, size: int = 1) -> MemorySource[str]:
    source: MemorySource[str] = MemorySource(seed=1)
    for i, k in enumerate(keys):
        source.insert(k, size, start + i)
    return source


# -- each policy's order (exact at this size) -------------------------------------------------------


def test_lru_evicts_least_recently_used() -> None:
    source = filled("abcd")
    source.touch("a", 10.0)
    assert order(LRUPolicy(), source) == ["b", "c", "d", "a"]


def test_fifo_ignores_reads() -> None:
    source = filled("abc")
    source.touch("a", 10.0)
    assert order(FIFOPolicy(), source) == ["a", "b", "c"]


def test_lfu_fewest_reads_then_least_recent() -> None:
    source = filled("abcde")
    for k, t in (("a", 10.0), ("a", 11.0), ("b", 12.0), ("d", 13.0)):
        source.touch(k, t)
    # no reads: c, e (c older); one read: b, d (b older); two: a
    assert order(LFUPolicy(), source) == ["c", "e", "b", "d", "a"]


def test_prefix_lru_evicts_leaves_only_lru_among_them() -> None:
    # chain a <- b <- c, plus a lone d; a is the least recently used chunk but has descendants
    source = filled("abcd")
    source.link_chain("abc")
    policy: PrefixLRUPolicy[str] = PrefixLRUPolicy()
    assert policy.victim(source, 5.0) == Candidate("c", 1, 2.0, 2.0, 0, True)
    source.touch("c", 20.0)  # now d is the least recently used leaf
    assert order(policy, source) == ["d", "c", "b", "a"]


def test_a_parent_that_arrives_after_its_child_is_not_a_leaf() -> None:
    source = filled("c")
    source.insert("p", 1, 1.0)
    source.link("c", "p")
    source.insert("o", 1, 2.0)
    assert order(PrefixLRUPolicy(), source) == ["c", "p", "o"]


def test_a_later_link_replaces_the_earlier_one() -> None:
    source = filled("xyc")
    source.link("c", "x")
    source.link("c", "y")  # x is a leaf again, y is not
    assert order(PrefixLRUPolicy(), source) == ["x", "c", "y"]


def test_a_cycle_of_links_still_yields_victims() -> None:
    source = filled("ab")
    source.link("a", "b")
    source.link("b", "a")
    assert sorted(order(PrefixLRUPolicy(), source)) == ["a", "b"]


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_a_batch_takes_a_chain_from_its_end(name: str) -> None:
    """The engine picks a batch before evicting any of it: a victim's parent may follow it in the batch
    (``picked``), so a chain goes tail first, as one victim at a time would take it."""
    source = filled("abcdxyzwvu")
    source.link_chain("abcd")
    policy = make_policy(name)
    taken: list[str] = []
    for _ in range(3):
        victim = policy.victim(source, 100.0, taken)
        assert victim is not None
        taken.append(victim.key)
        policy.picked(victim, source.parent(victim.key), source, taken)
    assert taken == ["d", "c", "b"]


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_never_evicts_a_chunk_with_a_cached_descendant(name: str) -> None:
    rng = random.Random(7)
    source: MemorySource[int] = MemorySource(seed=3)
    policy = make_policy(name)
    parent_of = {k: rng.randrange(k) for k in range(1, 600)}  # a fixed random forest
    for step in range(20_000):
        key = rng.randrange(600)
        if key in source:
            source.touch(key, float(step))
            continue
        while len(source) >= 120:  # well past one sample: the rule must hold for sampled victims
            out = evict(policy, source, float(step))
            assert source.children(out) == [], f"{name} evicted {out}, which has a cached child"
        source.insert(key, 1, float(step))
        if key in parent_of and rng.random() < 0.9:
            source.link(key, parent_of[key])


def test_sampled_lru_takes_victims_from_the_oldest() -> None:
    """1000 chunks, 16 samples and a pool of 16 per victim: the first 100 victims are all among the
    oldest fifth (exact LRU would take the oldest 100)."""
    source: MemorySource[int] = MemorySource(seed=5)
    for k in range(1000):
        source.insert(k, 1, float(k))
    policy: LRUPolicy[int] = LRUPolicy()
    victims = [evict(policy, source) for _ in range(100)]
    assert max(victims) < 200
    assert len(policy._pool) <= policy.pool_size


# -- hit density (default) ---------------------------------------------------------------------------


def _store(policy: SampledPolicy[Any], source: MemorySource[Any], key: Any, now: float, cap: int = 100) -> None:
    while len(source) >= cap:
        evict(policy, source, now)
    source.insert(key, 1, now)


def test_hit_density_starts_as_prefix_lru() -> None:
    """Until it has statistics and the tier has turned over half its chunks, it evicts like prefix-lru."""
    rng = random.Random(3)
    a: MemorySource[int] = MemorySource(seed=1)
    b: MemorySource[int] = MemorySource(seed=1)
    pa: HitDensityPolicy[int] = HitDensityPolicy()
    pb: PrefixLRUPolicy[int] = PrefixLRUPolicy()
    for step in range(60):
        key, parent = rng.randrange(40), rng.randrange(40)
        for policy, source in ((pa, a), (pb, b)):
            if key in source:
                source.touch(key, float(step))
                continue
            _store(policy, source, key, float(step), cap=10)
            if parent < key:
                source.link(key, parent)
        assert sorted(k for k in range(40) if k in a) == sorted(k for k in range(40) if k in b)


def test_hit_density_learns_to_keep_reused_chunks_over_one_offs() -> None:
    """A hot set larger than LRU can hold against a stream of one-off chunks.

    Each round reads 60 hot keys, then writes 100 keys never seen again; capacity is 100. LRU never
    hits a hot key (159 other keys between two reads); hit density learns that read chunks come back
    and unread ones do not, and keeps most of the hot set.
    """

    def hot_hit_rate(policy: SampledPolicy[int]) -> float:
        source: MemorySource[int] = MemorySource(seed=2)
        hits = reads = 0
        cold = 10_000
        now = 0.0
        for rnd in range(60):
            for key in range(60):
                now += 1.0
                reads += rnd >= 30
                if key in source:
                    hits += rnd >= 30
                    source.touch(key, now)
                    continue
                _store(policy, source, key, now)
            for _ in range(100):
                now += 1.0
                cold += 1
                _store(policy, source, cold, now)
        return hits / reads

    assert hot_hit_rate(LRUPolicy()) == 0.0
    assert hot_hit_rate(HitDensityPolicy()) > 0.8
    assert hot_hit_rate(ReusePolicy()) > 0.8


def _trained_reuse_policy(marks: int = 0) -> tuple[ReusePolicy[int], MemorySource[int], float]:
    """A ``reuse`` policy that has learnt on the hot set / one-off stream above (writes with ``marks``)."""
    policy: ReusePolicy[int] = ReusePolicy()
    source: MemorySource[int] = MemorySource(seed=2)
    cold, now = 10_000, 0.0
    for _ in range(30):
        for key in range(60):
            now += 1.0
            if key in source:
                source.touch(key, now)
            else:
                _store(policy, source, key, now)
        for _ in range(100):
            now += 1.0
            cold += 1
            if len(source) >= 100:
                evict(policy, source, now)
            source.insert(cold, 1, now, marks)
    return policy, source, now


def test_reuse_policy_state_survives_export_and_restore_through_json() -> None:
    policy, source, now = _trained_reuse_policy()
    state = policy.export()
    assert state is not None and state["trusted"] and state["policy"] == "reuse"
    again: ReusePolicy[int] = ReusePolicy()
    assert again.restore(json.loads(json.dumps(state)))
    assert again.export() == state
    sample = source.census(100)[0]
    assert [again.rank(c, now) for c in sample] == [policy.rank(c, now) for c in sample]
    fresh: ReusePolicy[int] = ReusePolicy()
    assert {fresh.rank(c, now)[0] for c in sample} <= {0.0, -1.0}  # untrained: prefix-LRU order


@pytest.mark.parametrize("bad", [None, {}, {"policy": "hit-density", "version": 1}, {"policy": "reuse", "version": 99},
                                 {"policy": "reuse", "version": 1, "fine": [], "coarse": []}, "text"])
def test_reuse_policy_refuses_state_of_another_kind(bad: object) -> None:
    policy: ReusePolicy[int] = ReusePolicy()
    before = policy.export()
    assert not policy.restore(bad)
    assert policy.export() == before


def test_reuse_policy_learns_hinted_classes_apart() -> None:
    """Chunks written with a hint are a class of their own: here the never-read stream is written as
    ``shared`` (the hint lies) and the hot set without: the hinted class learns it is read never."""
    policy, _, _ = _trained_reuse_policy(marks=MARK_SHARED)
    assert policy._fine[1].density is not None and policy._fine[0].density is not None
    assert policy.density(1, 10.0) < policy.density(0, 10.0) / 10


def test_hit_density_evicts_partial_tails_first() -> None:
    """A never-read chunk smaller than the largest seen is a prompt's partial last block: it goes first."""
    source: MemorySource[str] = MemorySource()
    source.insert("old", 512, 0.0)
    for k in ("a", "b", "tail"):
        source.insert(k, 100 if k == "tail" else 512, 1.0)
    source.link_chain(["a", "b", "tail"])
    source.insert("new", 512, 2.0)
    policy: HitDensityPolicy[str] = HitDensityPolicy()
    assert evict(policy, source) == "tail"  # younger than "old", but a partial tail
    assert evict(policy, source) == "old"  # then prefix-LRU order (nothing learnt yet)
    source.insert("tail2", 7, 3.0)
    source.touch("tail2", 4.0)  # a partial chunk that is read is no longer a tail
    assert evict(policy, source) == "b"


def test_a_chunk_stored_again_while_remembered_counts_as_reused() -> None:
    source: MemorySource[str] = MemorySource(history=2.0)
    for i, k in enumerate("abcd"):
        source.insert(k, 1, float(i))
    policy: HitDensityPolicy[str] = HitDensityPolicy()
    assert evict(policy, source) == "a"
    source.insert("a", 1, 10.0)
    got = source.get("a")
    assert got is not None and got.returned and got.hits == 0  # REUSED for default; LFU counts reads only
    seen = source.observations[-1]
    assert (seen.kind, seen.last_access, seen.at) == (2, 0.0, 10.0)


def test_ghosts_are_bounded_by_history() -> None:
    source: MemorySource[int] = MemorySource(history=2.0)
    policy: HitDensityPolicy[int] = HitDensityPolicy()
    for k in range(5_000):
        _store(policy, source, k, float(k))
    assert len(source) == 100
    assert len(source.ghost_census(10_000)[0]) <= 200
    assert len(policy._pool) <= policy.pool_size


# -- shared contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_an_empty_source_has_no_victim(name: str) -> None:
    policy = make_policy(name)
    source: MemorySource[bytes] = MemorySource()
    assert policy.victim(source, 0.0) is None
    source.insert(b"a", 10, 1.0)
    source.link(b"a", b"unknown-parent")  # an absent parent is fine
    assert evict(policy, source) == b"a"
    assert policy.victim(source, 2.0) is None


@pytest.mark.parametrize("name", ALL)
def test_every_chunk_can_be_evicted(name: str) -> None:
    source: MemorySource[bytes] = MemorySource(seed=4)
    for i in range(50):
        source.insert(i.to_bytes(16, "big"), 4096, float(i))
        if i:
            source.link(i.to_bytes(16, "big"), (i - 1).to_bytes(16, "big"))
    seen = set(order(make_policy(name), source))
    assert len(seen) == 50


@pytest.mark.parametrize("name", ALL)
def test_excluded_keys_are_never_victims(name: str) -> None:
    source = filled("abcdef")
    policy = make_policy(name)
    victim = policy.victim(source, 10.0, exclude={"a", "b", "c", "d", "e"})
    assert victim is not None and victim.key == "f"
    assert policy.victim(source, 10.0, exclude=set("abcdef")) is None


@pytest.mark.parametrize("name", ALL)
def test_pinned_chunks_are_never_victims(name: str) -> None:
    source = filled("abcdef")
    source.link_chain("ab")  # b is a's only child: pinning b keeps a too (a is never a leaf)
    for key in "bde":
        source.mark(key, MARK_PINNED)
    policy = make_policy(name)
    victim = policy.victim(source, 10.0)  # now in the pool: pinned before it is taken, it is passed over
    assert victim is not None and victim.key in "acf"
    policy._pool[victim.key] = victim
    source.mark(victim.key, MARK_PINNED)
    free = {"c", "f"} if policy.prefix_aware else {"a", "c", "f"}
    assert sorted(order_while(policy, source)) == sorted(free - {victim.key})
    for key in {"b", victim.key}:
        source.mark(key, 0, MARK_PINNED)
    assert sorted(order_while(policy, source)) == sorted({"a", "b", victim.key})
    assert sorted(source._fields) == ["d", "e"] and policy.victim(source, 11.0) is None


def order_while(policy: SampledPolicy[Any], source: MemorySource[Any]) -> list[Any]:
    """Evict until the policy finds nothing it may evict."""
    out: list[Any] = []
    while policy.victim(source, 1e6) is not None:
        out.append(evict(policy, source))
    return out


@pytest.mark.parametrize("name", ["hit-density", "default"])
def test_session_ended_and_one_off_chunks_go_right_after_partial_tails(name: str) -> None:
    source: MemorySource[str] = MemorySource(seed=1)
    source.insert("full", 512, 1.0)
    source.insert("tail", 100, 2.0)  # smaller than the largest seen: a partial tail
    source.insert("ended", 512, 3.0)
    source.insert("doc", 512, 4.0, marks=MARK_ONE_OFF)
    source.insert("old", 512, 0.5)
    source.mark("ended", MARK_SESSION_ENDED)
    source.insert("read", 512, 5.0)
    source.mark("read", MARK_SESSION_ENDED)
    source.touch("read", 6.0)  # read after its session ended: the mark is gone
    assert order(make_policy(name), source) == ["tail", "ended", "doc", "old", "full", "read"]


def test_registry() -> None:
    assert {"lru", "fifo", "lfu", "prefix-lru", "hit-density", "reuse", "default"} <= set(POLICIES)
    assert isinstance(make_policy("default"), ReusePolicy)
    for name in ALL:
        assert make_policy(name).name == POLICIES[name].name
    with pytest.raises(KeyError, match="lru"):
        make_policy("nope")
    with pytest.raises(ValueError, match="samples"):
        LRUPolicy(samples=0)
