"""The exact in-memory eviction policies (the trace simulator's baselines, ``gateway.lifecycle.exact``):
orders on handmade event sequences, the prefix rule, unknown keys, registry."""

from __future__ import annotations

import random
from itertools import pairwise
from typing import Any

import pytest

from gateway.lifecycle.exact import (
    EXACT_POLICIES,
    FIFOPolicy,
    HitDensityPolicy,
    LFUPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
)
from gateway.lifecycle.exact import make_exact_policy as make_policy

ALL = sorted(EXACT_POLICIES)
PREFIX_AWARE = ["prefix-lru", "hit-density", "default"]


def evict(policy: Any) -> Any:
    """Evict like the engine: ask for the victim, then report it gone."""
    key = policy.victim()
    assert key is not None
    assert key in policy
    policy.remove(key)
    return key


def eviction_order(policy: Any) -> list[Any]:
    return [evict(policy) for _ in range(len(policy))]


# -- each policy's order -----------------------------------------------------------------------------


def test_lru_evicts_least_recently_used() -> None:
    p: LRUPolicy[str] = LRUPolicy()
    for k in "abcd":
        p.insert(k, 1, 0.0)
    p.touch("a", 1.0)
    p.insert("b", 1, 2.0)  # re-insert counts as an access
    assert eviction_order(p) == ["c", "d", "a", "b"]


def test_fifo_ignores_hits_and_reinserts() -> None:
    p: FIFOPolicy[str] = FIFOPolicy()
    for k in "abc":
        p.insert(k, 1, 0.0)
    p.touch("a", 1.0)
    p.insert("a", 1, 2.0)
    assert eviction_order(p) == ["a", "b", "c"]


def test_lfu_lowest_count_then_least_recent() -> None:
    p: LFUPolicy[str] = LFUPolicy()
    for k in "abcde":
        p.insert(k, 1, 0.0)
    p.touch("a", 1.0)
    p.touch("a", 1.0)  # a: 3
    p.touch("b", 1.0)  # b: 2
    p.touch("d", 1.0)  # d: 2, more recent than b
    # count 1: c, e (c older); count 2: b, d (b older); count 3: a
    assert eviction_order(p) == ["c", "e", "b", "d", "a"]


def test_lfu_forgets_count_on_eviction() -> None:
    p: LFUPolicy[str] = LFUPolicy()
    p.insert("a", 1, 0.0)
    for _ in range(5):
        p.touch("a", 1.0)
    p.insert("b", 1, 0.0)
    assert evict(p) == "b"
    p.remove("a")
    p.insert("a", 1, 2.0)  # back with count 1
    p.insert("c", 1, 3.0)
    p.touch("c", 3.0)
    assert evict(p) == "a"


def test_prefix_lru_evicts_leaves_only_lru_among_them() -> None:
    p: PrefixLRUPolicy[str] = PrefixLRUPolicy()
    # chain a <- b <- c, plus a lone d; a is the least recently used key but has descendants
    for k in "abc":
        p.insert(k, 1, 0.0)
    p.link("b", "a")
    p.link("c", "b")
    p.insert("d", 1, 1.0)
    assert p.victim() == "c"
    p.touch("c", 2.0)  # now d is the least recently used leaf
    assert eviction_order(p) == ["d", "c", "b", "a"]


def test_prefix_lru_parent_that_arrives_after_its_child_is_not_a_leaf() -> None:
    p: PrefixLRUPolicy[str] = PrefixLRUPolicy()
    p.insert("child", 1, 0.0)
    p.link("child", "parent")  # parent unknown yet: the link is kept with the child
    p.insert("parent", 1, 1.0)
    p.insert("other", 1, 2.0)
    assert eviction_order(p) == ["child", "parent", "other"]


def test_prefix_lru_relink_frees_the_old_parent() -> None:
    p: PrefixLRUPolicy[str] = PrefixLRUPolicy()
    for k in ("x", "y", "c"):
        p.insert(k, 1, 0.0)
    p.link("c", "x")
    p.link("c", "y")  # a later link replaces the earlier one: x is a leaf again, y is not
    assert evict(p) == "x"
    assert evict(p) == "c"
    assert evict(p) == "y"


def test_prefix_lru_cycle_still_yields_a_victim() -> None:
    p: PrefixLRUPolicy[str] = PrefixLRUPolicy()
    p.insert("a", 1, 0.0)
    p.insert("b", 1, 0.0)
    p.link("a", "b")
    p.link("b", "a")
    assert len(eviction_order(p)) == 2


@pytest.mark.parametrize("name", ALL)
def test_link_chain_is_the_same_as_linking_each_pair(name: str) -> None:
    """link_chain (prefix / batch-get calls) skips known pairs; it must end where the links would."""
    rng = random.Random(11)
    chains = [[rng.randrange(40) for _ in range(rng.randrange(1, 12))] for _ in range(60)]
    chains += chains[:20]  # repeated lookups: the pairs are known now
    by_chain, by_pair = make_policy(name), make_policy(name)
    for p in (by_chain, by_pair):
        for k in range(0, 40, 2):  # half the keys present; links of absent children are ignored
            p.insert(k, 1, float(k))
    for i, chain in enumerate(chains):
        by_chain.link_chain(chain)
        for parent, child in pairwise(chain):
            by_pair.link(child, parent)
        if i % 10 == 0:  # keys come and go between lookups
            for p in (by_chain, by_pair):
                p.insert(i % 40, 1, 100.0 + i)
                p.remove((i + 1) % 40)
    assert eviction_order(by_chain) == eviction_order(by_pair)


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_link_chain_with_a_repeated_key_links_like_each_pair_in_order(name: str) -> None:
    """x -> a -> y -> a: the last pair re-links a under y, as linking the pairs in order does, even
    when the chain is looked up a second time (its first pair then looks known)."""
    by_chain, by_pair = make_policy(name), make_policy(name)
    for p in (by_chain, by_pair):
        for t, k in enumerate("xay"):
            p.insert(k, 1, float(t))
    chain = ["x", "a", "y", "a"]
    for _ in range(2):
        by_chain.link_chain(chain)
        for parent, child in pairwise(chain):
            by_pair.link(child, parent)
    assert by_chain._tree.parent["a"] == by_pair._tree.parent["a"] == "y"
    assert eviction_order(by_chain) == eviction_order(by_pair)


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_never_evicts_a_chunk_with_a_cached_descendant(name: str) -> None:
    rng = random.Random(7)
    p = make_policy(name)
    parent_of = {k: rng.randrange(k) for k in range(1, 300)}  # a fixed random forest
    linked: dict[int, int] = {}  # our model: present child -> linked parent
    for step in range(20_000):
        key = rng.randrange(300)
        if key in p:
            p.touch(key, float(step))
        else:
            while len(p) >= 60:
                out = p.victim()
                assert out is not None
                assert out not in linked.values(), f"{name} evicted {out}, which has a cached child"
                p.remove(out)
                linked.pop(out, None)
            p.insert(key, 1, float(step))
            if key in parent_of and rng.random() < 0.9:
                p.link(key, parent_of[key])
                linked[key] = parent_of[key]


# -- hit density (default) ---------------------------------------------------------------------------


def test_hit_density_starts_as_prefix_lru() -> None:
    """Until enough reuse intervals have ended to trust its estimates, it evicts like prefix-lru."""
    rng = random.Random(3)
    a: HitDensityPolicy[int] = HitDensityPolicy()
    b: PrefixLRUPolicy[int] = PrefixLRUPolicy()
    for step in range(30):  # fewer than 32 intervals can end
        key, parent = rng.randrange(40), rng.randrange(40)
        for p in (a, b):
            if key in p:
                p.touch(key, float(step))
                continue
            if len(p) >= 10:
                evict(p)
            p.insert(key, 1, float(step))
            if parent < key:
                p.link(key, parent)
        assert [k for k in range(40) if k in a] == [k for k in range(40) if k in b]


def test_hit_density_learns_to_keep_reused_chunks_over_one_offs() -> None:
    """A hot set larger than LRU can hold against a stream of one-off chunks.

    Each round reads 60 hot keys, then writes 100 keys never seen again; capacity is 100. LRU never
    hits a hot key (159 other keys between two reads); hit density learns that REUSED chunks come
    back and FRESH ones do not, and keeps the hot set.
    """

    def hot_hit_rate(policy: Any) -> float:
        hits = reads = 0
        cold = 10_000
        for rnd in range(60):
            for key in range(60):
                reads += rnd >= 30
                if key in policy:
                    hits += rnd >= 30
                    policy.touch(key, float(rnd))
                    continue
                _store(policy, key, rnd)
            for _ in range(100):
                cold += 1
                _store(policy, cold, rnd)
        return hits / reads

    assert hot_hit_rate(LRUPolicy()) == 0.0
    assert hot_hit_rate(HitDensityPolicy()) > 0.9


def test_hit_density_evicts_partial_tails_first() -> None:
    """A chunk smaller than the largest seen is a prompt's partial last block: its leaf goes first."""
    p: HitDensityPolicy[str] = HitDensityPolicy()
    p.insert("old", 512, 0.0)
    for k, parent in (("a", None), ("b", "a"), ("tail", "b")):
        p.insert(k, 100 if k == "tail" else 512, 1.0)
        if parent is not None:
            p.link(k, parent)
    p.insert("new", 512, 2.0)
    assert evict(p) == "tail"  # younger than "old", but a partial tail
    assert evict(p) == "old"  # then prefix-LRU order (nothing learnt yet)
    p.insert("tail2", 7, 3.0)
    p.touch("tail2", 4.0)  # a partial chunk that is read is REUSED, no longer a TAIL
    assert evict(p) == "b"


def _store(policy: Any, key: int, now: float) -> None:
    while len(policy) >= 100:
        policy.remove(policy.victim())
    policy.insert(key, 1, now)


def test_hit_density_heaps_stay_bounded_under_hits_only() -> None:
    p: HitDensityPolicy[int] = HitDensityPolicy()
    for k in range(10):
        p.insert(k, 1, 0.0)
    for i in range(10_000):
        p.touch(i % 10, float(i))
    assert all(len(h) <= 2 * 10 + 64 for h in p._heaps)


def test_hit_density_history_is_bounded() -> None:
    p: HitDensityPolicy[int] = HitDensityPolicy(history=2.0)
    for k in range(5_000):
        _store(p, k, float(k))
    assert len(p) == 100
    assert len(p._ghosts) <= max(64, 2 * 100)


# -- shared contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_unknown_keys_are_ignored(name: str) -> None:
    p = make_policy(name)
    assert p.victim() is None
    assert len(p) == 0
    p.touch(b"nope", 1.0)
    p.remove(b"nope")
    p.link(b"nope", b"parent")  # absent child: ignored
    assert len(p) == 0
    assert b"nope" not in p
    assert p.victim() is None
    p.insert(b"a", 10, 2.0)
    p.link(b"a", b"unknown-parent")  # absent parent is fine
    p.remove(b"unknown-parent")
    assert p.victim() == b"a"
    assert len(p) == 1


@pytest.mark.parametrize("name", ALL)
def test_victim_is_stable_until_removed(name: str) -> None:
    p = make_policy(name)
    for i in range(50):
        p.insert(i.to_bytes(16, "big"), 4096, float(i))
        if i:
            p.link(i.to_bytes(16, "big"), (i - 1).to_bytes(16, "big"))
    first = p.victim()
    assert p.victim() == first
    seen = set()
    while len(p):
        seen.add(evict(p))
    assert len(seen) == 50


@pytest.mark.parametrize("name", ALL)
def test_insert_of_present_key_keeps_one_entry(name: str) -> None:
    p = make_policy(name)
    p.insert("a", 1, 0.0)
    p.insert("a", 1, 1.0)
    assert len(p) == 1
    p.remove("a")
    p.remove("a")
    assert len(p) == 0


def test_registry() -> None:
    assert {"lru", "fifo", "lfu", "prefix-lru", "default"} <= set(EXACT_POLICIES)
    assert isinstance(make_policy("default"), HitDensityPolicy)
    for name in ALL:
        assert make_policy(name).name == EXACT_POLICIES[name].name
    with pytest.raises(KeyError, match="lru"):
        make_policy("nope")
