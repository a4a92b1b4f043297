"""Exact eviction policies: in-memory orderings over the chunks of one (bucket, tier).

These were the lifecycle engine's policies until issue 11: they hold a structure per cached chunk
(0.2-1.2 KB each), which a tier of 100 million chunks cannot afford in every gateway. The engine now
uses the sampled policies of ``gateway.lifecycle.policy`` (no per-chunk memory); these classes stay
as the trace simulator's exact baselines (``kvgw bench trace --policy exact-default`` etc.), so the
sampled policies can be compared with what they replaced and with the reference hit rates.

Contract (every policy in ``EXACT_POLICIES``):

* Keys are opaque and hashable: the engine passes 16-byte chunk digests, the simulator ints. They
  need not be orderable (heap ranks are unique, so keys are never compared).
* ``insert(key, size, now)``: the chunk landed in the tier. Inserting a present key counts as an
  access (``touch``), except for FIFO, which ignores it. ``size`` is the chunk's size in bytes (any
  positive number; the simulator passes tokens); policies may ignore it.
* ``touch(key, now)``: a read hit. Unknown keys are ignored.
* ``remove(key)``: the chunk left the tier (evicted, deleted, expired, demoted). Unknown keys are
  ignored. Nothing is evicted until the engine calls ``remove``.
* ``link(child, parent)``: the gateway learnt that ``parent`` is the previous chunk of ``child`` in a
  prefix chain (``x-kvgw-parent`` on PUT, or the order of keys in a batch). Call it after ``insert``
  of the child; a link for an absent child is ignored. The parent need not be present: the link is
  kept with the child and counts when the parent arrives. A later link for the same child replaces
  the earlier one. Policies that are not prefix-aware ignore links.
* ``link_chain(keys)``: ``link`` each key to the one before it (the order of keys in a prefix or
  batch-get call); the same as those ``link`` calls, but a chain already known costs a dict lookup
  per key (the engine calls it on the event loop for every such call).
* ``victim()``: the key to evict next, or ``None`` when the policy is empty. It does not remove the
  key (it may tidy internal state), and calling it again without an intervening event returns the
  same key. Evict by: ``key = victim()``, delete the chunk, ``remove(key)``. If the engine cannot
  evict that chunk (I/O error), ``touch`` it to move it out of the way, or ``remove`` it.
  Prefix-aware policies (``prefix-lru``, ``hit-density``/``default``) only return leaves: keys with
  no present child in this policy instance, i.e. in this tier.
* ``key in policy``, ``len(policy)``: membership and number of keys held.
* Time: ``now`` (seconds, any monotonic origin) is always passed in; no policy reads a clock.
* Cost: every operation is O(1) or O(log n) amortised (heaps use lazy deletion and are compacted when
  stale entries outnumber live ones). Memory per cached key, measured with 16-byte keys (the keys
  themselves not counted): lru 0.2 KB, lfu 0.3 KB, prefix-lru 0.4 KB, hit-density 1.2 KB (of which
  0.6 KB is its history of evicted keys, which also keeps those key objects alive).
* Threads: none. The engine calls a policy from one thread; no operation locks.

Rebuild at startup: create the policy, then ``insert`` every indexed chunk in ascending last-access
order (oldest first), then ``link`` every chunk whose parent is recorded. Nothing learnt is persisted:
a rebuilt policy treats every chunk as accessed once (LFU count 1, hit-density FRESH) and hit-density
starts out as prefix-lru until it has seen a few dozen reuses. If the index records that a chunk was
read since it was written, ``touch`` it right after its ``insert`` so it starts as REUSED.

Policies are data: ``EXACT_POLICIES`` maps a name to a class, ``make_exact_policy(name)`` builds one.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from gateway.lifecycle.policy_density import HitDensityPolicy
from gateway.lifecycle.policy_tree import HEAP_MIN, HEAP_SLACK, LazyHeap, PrefixTree

__all__ = [
    "EXACT_POLICIES",
    "EvictionPolicy",
    "FIFOPolicy",
    "HitDensityPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PrefixLRUPolicy",
    "make_exact_policy",
]

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """What the lifecycle engine and the simulator call; see the module docstring for the contract."""

    name: ClassVar[str]

    def insert(self, key: K, size: int, now: float) -> None: ...

    def touch(self, key: K, now: float) -> None: ...

    def remove(self, key: K) -> None: ...

    def link(self, child: K, parent: K) -> None: ...

    def link_chain(self, keys: Sequence[K]) -> None: ...

    def victim(self) -> K | None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class LRUPolicy(Generic[K]):
    """Least recently used. One OrderedDict entry per key."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, size: int, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        else:
            self._order[key] = None

    def touch(self, key: K, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def link(self, child: K, parent: K) -> None:
        return None

    def link_chain(self, keys: Sequence[K]) -> None:
        return None

    def victim(self) -> K | None:
        return next(iter(self._order), None)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy[K]):
    """First in, first out: hits and re-inserts do not change the order."""

    name: ClassVar[str] = "fifo"

    def insert(self, key: K, size: int, now: float) -> None:
        if key not in self._order:
            self._order[key] = None

    def touch(self, key: K, now: float) -> None:
        return None


class LFUPolicy(Generic[K]):
    """Least frequently used, ties broken by least recently used.

    The count starts at 1 on insert, grows on every access and is forgotten when the key leaves
    (in-cache LFU, no aging). A heap of ``(count, seq, key)`` with lazy deletion; O(log n).
    """

    name: ClassVar[str] = "lfu"

    def __init__(self) -> None:
        self._state: dict[K, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, K]] = []
        self._seq = 0

    def _access(self, key: K, count: int) -> None:
        self._seq += 1
        self._state[key] = (count, self._seq)
        heapq.heappush(self._heap, (count, self._seq, key))
        if len(self._heap) > HEAP_SLACK * len(self._state) + HEAP_MIN:
            self._heap = [(c, s, k) for k, (c, s) in self._state.items()]
            heapq.heapify(self._heap)

    def insert(self, key: K, size: int, now: float) -> None:
        state = self._state.get(key)
        self._access(key, 1 if state is None else state[0] + 1)

    def touch(self, key: K, now: float) -> None:
        state = self._state.get(key)
        if state is not None:
            self._access(key, state[0] + 1)

    def remove(self, key: K) -> None:
        self._state.pop(key, None)

    def link(self, child: K, parent: K) -> None:
        return None

    def link_chain(self, keys: Sequence[K]) -> None:
        return None

    def victim(self) -> K | None:
        heap, state = self._heap, self._state
        while heap:
            count, seq, key = heap[0]
            if state.get(key) == (count, seq):
                return key
            heapq.heappop(heap)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)


class PrefixLRUPolicy(Generic[K]):
    """Prefix-aware LRU: only leaves of the learnt chain tree are evictable, least recently used first.

    A chunk with a present descendant is never the victim, so a prefix never loses a block in its
    middle (which would make every block after it useless to a prefix lookup). Keys without links are
    leaves. Should links ever form a cycle (no leaf left), ``victim`` falls back to the oldest inserted
    key. A lazy heap of ``(seq, key)`` over leaves; O(log n). About 0.3 KB per key.
    """

    name: ClassVar[str] = "prefix-lru"

    def __init__(self) -> None:
        self._seq_of: dict[K, int] = {}
        self._tree: PrefixTree[K] = PrefixTree()
        self._heap: LazyHeap[K] = LazyHeap(self._is_live)
        self._seq = 0

    def _is_live(self, seq: int, key: K) -> bool:
        return self._seq_of.get(key) == seq and self._tree.is_leaf(key)

    def _push(self, key: K) -> None:
        heap = self._heap
        heap.push(self._seq_of[key], key)
        if heap.needs_compaction(len(self._seq_of)):
            tree = self._tree
            heap.rebuild((s, k) for k, s in self._seq_of.items() if tree.is_leaf(k))

    def insert(self, key: K, size: int, now: float) -> None:
        self._seq += 1
        self._seq_of[key] = self._seq
        if self._tree.is_leaf(key):
            self._push(key)

    def touch(self, key: K, now: float) -> None:
        if key in self._seq_of:
            self.insert(key, 0, now)

    def remove(self, key: K) -> None:
        if self._seq_of.pop(key, None) is None:
            return
        freed = self._tree.unlink(key)
        if freed is not None and freed in self._seq_of:
            self._push(freed)

    def link(self, child: K, parent: K) -> None:
        if child not in self._seq_of:
            return
        freed = self._tree.link(child, parent)
        if freed is not None and freed in self._seq_of:
            self._push(freed)

    def link_chain(self, keys: Sequence[K]) -> None:
        for child, parent in self._tree.new_links(keys):
            self.link(child, parent)

    def victim(self) -> K | None:
        top = self._heap.top()
        if top is not None:
            return top[1]
        return next(iter(self._seq_of), None)

    def __contains__(self, key: object) -> bool:
        return key in self._seq_of

    def __len__(self) -> int:
        return len(self._seq_of)


EXACT_POLICIES: dict[str, type[EvictionPolicy[Any]]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "hit-density": HitDensityPolicy,
    "default": HitDensityPolicy,
}


def make_exact_policy(name: str) -> EvictionPolicy[Any]:
    """Build the exact policy registered under ``name`` (``default`` included); KeyError names the choices."""
    try:
        cls = EXACT_POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown exact eviction policy {name!r}; choose one of {sorted(EXACT_POLICIES)}") from None
    return cls()
