"""Building blocks shared by the eviction policies: the learnt prefix tree and a lazily-deleted heap.

Both are plain data structures without policy logic. ``PrefixTree`` knows which present keys have
present children (only leaves of the chain tree may be evicted by prefix-aware policies); ``LazyHeap``
is a min-heap whose stale entries are skipped on read and purged when they outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# A lazily-deleted heap is rebuilt once it holds more than this factor times the live keys.
HEAP_SLACK = 2
HEAP_MIN = 64


class PrefixTree(Generic[K]):
    """Child/parent bookkeeping of the learnt prefix chains.

    ``parent[child]`` holds the link of every present child that has one; ``kids[p]`` counts the
    present children of ``p`` whether or not ``p`` itself is present, so a parent that arrives after
    its children is known not to be a leaf. Both maps hold at most one entry per present key.
    The owner calls ``link``/``unlink`` only for present children.
    """

    __slots__ = ("kids", "parent")

    def __init__(self) -> None:
        self.parent: dict[K, K] = {}
        self.kids: dict[K, int] = {}

    def is_leaf(self, key: K) -> bool:
        return key not in self.kids

    def link(self, child: K, parent: K) -> K | None:
        """Record ``parent`` as ``child``'s parent; return a former parent left without children."""
        old = self.parent.get(child)
        if old == parent or child == parent:
            return None
        self.parent[child] = parent
        self.kids[parent] = self.kids.get(parent, 0) + 1
        return self._drop_kid(old) if old is not None else None

    def new_links(self, keys: Sequence[K]) -> Iterator[tuple[K, K]]:
        """(child, parent) for each consecutive pair of ``keys`` not linked that way yet. Clients look
        the same chains up again and again; a known pair then costs one dict lookup, not a ``link``.
        Lazy: each pair is checked against the links the caller made for the pairs before it, so a
        chain that repeats a key ends exactly as linking every pair in order would."""
        known = self.parent.get
        for parent, child in pairwise(keys):
            if known(child) != parent:
                yield child, parent

    def unlink(self, child: K) -> K | None:
        """Forget ``child``'s link; return its parent if that parent has no present child left."""
        old = self.parent.pop(child, None)
        return self._drop_kid(old) if old is not None else None

    def _drop_kid(self, parent: K) -> K | None:
        left = self.kids[parent] - 1
        if left:
            self.kids[parent] = left
            return None
        del self.kids[parent]
        return parent


class LazyHeap(Generic[K]):
    """Min-heap of ``(rank, key)``; an entry is live while ``is_live(rank, key)`` says so.

    Callers push a fresh entry whenever a key's rank changes or it becomes eligible, and never delete:
    ``top`` pops dead entries as it meets them. ``compact`` rebuilds from the live keys when dead
    entries pile up, keeping memory at most ``HEAP_SLACK`` times the live count (amortised O(1)).
    """

    __slots__ = ("_entries", "_is_live")

    def __init__(self, is_live: Callable[[int, K], bool]) -> None:
        self._entries: list[tuple[int, K]] = []
        self._is_live = is_live

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, rank: int, key: K) -> None:
        heapq.heappush(self._entries, (rank, key))

    def top(self) -> tuple[int, K] | None:
        entries, is_live = self._entries, self._is_live
        while entries:
            rank, key = entries[0]
            if is_live(rank, key):
                return rank, key
            heapq.heappop(entries)
        return None

    def needs_compaction(self, live: int) -> bool:
        return len(self._entries) > HEAP_SLACK * live + HEAP_MIN

    def rebuild(self, entries: Iterable[tuple[int, K]]) -> None:
        self._entries = list(entries)
        heapq.heapify(self._entries)
