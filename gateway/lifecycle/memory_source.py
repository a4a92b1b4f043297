"""An in-memory ``ChunkSource``: what the LMDB index records about chunks, kept in dicts.

The trace simulator (``gateway.bench.trace_sim``) and the unit tests run the sampled policies of
``gateway.lifecycle.policy`` over it; the gateway runs them over the index (``IndexSource``). Both give
the same view and the same behaviour: size, created, last access, hits, learnt parent links, whether a
chunk is a leaf (no present child), ghosts of evicted chunks (at most ``history`` times the chunks
held, forgotten at random; a chunk stored again while remembered is ``returned``), and
``observations`` of reads, returns and forgotten ghosts for the policy to learn from. Sampling is
uniform over present keys, as a random seek into the index's digest order is (digests are uniform
hashes). The per-key memory here is the simulator's, not the gateway's.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable, Sequence
from itertools import pairwise
from typing import Generic, TypeVar

from backends.index import (
    MARKS_CLEARED_BY_READ,
    OBS_FORGOTTEN,
    OBS_READ,
    OBS_RETURNED,
    OBSERVATIONS_KEPT,
    Observation,
)
from gateway.lifecycle.policy import Candidate

K = TypeVar("K", bound=Hashable)


class _Bag(Generic[K]):
    """Keys with O(1) insert, remove and uniform random choice."""

    def __init__(self) -> None:
        self.keys: list[K] = []
        self.slot: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: K) -> None:
        self.slot[key] = len(self.keys)
        self.keys.append(key)

    def discard(self, key: K) -> bool:
        slot = self.slot.pop(key, None)
        if slot is None:
            return False
        last = self.keys.pop()
        if last != key:
            self.keys[slot] = last
            self.slot[last] = slot
        return True

    def pick(self, rng: random.Random, count: int) -> list[K]:
        keys = self.keys
        if len(keys) <= count:
            return list(keys)
        n = len(keys)
        return [keys[int(rng.random() * n)] for _ in range(count)]


class MemorySource(Generic[K]):
    """Present chunks with their index fields; ``link`` records prefix chains as the index does."""

    def __init__(self, seed: int = 0, *, history: float = 2.0) -> None:
        self.history = history
        self._present: _Bag[K] = _Bag()
        # size, created, last access, hits, returned, marks
        self._fields: dict[K, tuple[int, float, float, int, bool, int]] = {}
        self._parent: dict[K, K] = {}  # present child -> learnt parent
        self._kids: dict[K, set[K]] = {}  # parent (present or not) -> its present children
        self._ghosts: dict[K, Candidate[K]] = {}  # evicted, remembered: the chunk as it was
        self._ghost_keys: _Bag[K] = _Bag()
        self._rng = random.Random(seed)
        self.observations: deque[Observation] = deque(maxlen=OBSERVATIONS_KEPT)

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, key: object) -> bool:
        return key in self._fields

    # -- changes (what the service and the mover do to the index) -----------------------------------

    def insert(self, key: K, size: int, now: float, marks: int = 0) -> None:
        """Store a chunk (a present key is left as it is). One remembered as evicted has returned.
        ``marks``: the hint marks it is stored with (its retention class)."""
        if key in self._fields:
            return
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._ghost_keys.discard(key)
            self.observations.append(Observation(OBS_RETURNED, "", 1, ghost.size, ghost.last_access,
                                                 ghost.hits + ghost.returned, now, 1, ghost.marks))
        self._present.add(key)
        self._fields[key] = (size, now, now, 0, ghost is not None, marks)

    def touch(self, key: K, now: float, count: int = 1) -> None:
        fields = self._fields.get(key)
        if fields is not None:
            size, created, last, hits, returned, marks = fields
            self.observations.append(Observation(OBS_READ, "", 1, size, last, hits + returned, now, count, marks))
            if now > last:
                marks &= ~MARKS_CLEARED_BY_READ
            self._fields[key] = (size, created, max(last, now), hits + count, returned, marks)

    def mark(self, key: K, set_marks: int, clear_marks: int = 0) -> bool:
        """An engine hint: set and clear marks of a present chunk (as ``ChunkIndex.mark``)."""
        fields = self._fields.get(key)
        if fields is None:
            return False
        self._fields[key] = (*fields[:5], (fields[5] & ~clear_marks) | set_marks)
        return True

    def remove(self, key: K) -> None:
        """The chunk is gone (deleted, expired): nothing is remembered."""
        if not self._present.discard(key):
            return
        del self._fields[key]
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._drop_kid(parent, key)

    def evict(self, key: K, now: float) -> bool:
        """The lifecycle evicted the chunk: remove it and remember it (forgetting random older ghosts
        beyond ``history`` times the chunks held). Returns whether it is remembered."""
        candidate = self.get(key)
        self.remove(key)
        if candidate is None or self.history <= 0:
            return False
        self._ghosts[key] = candidate
        self._ghost_keys.add(key)
        limit = int(self.history * len(self._present))
        while len(self._ghost_keys) > limit:
            gone = self._ghost_keys.keys[int(self._rng.random() * len(self._ghost_keys))]
            self._ghost_keys.discard(gone)
            ghost = self._ghosts.pop(gone)
            self.observations.append(Observation(OBS_FORGOTTEN, "", 1, ghost.size, ghost.last_access,
                                                 ghost.hits + ghost.returned, now, 1, ghost.marks))
        return key in self._ghosts

    def link(self, child: K, parent: K) -> None:
        """``parent`` precedes ``child`` in a prefix chain; a later link replaces an earlier one."""
        if child not in self._fields or child == parent:
            return
        old = self._parent.get(child)
        if old == parent:
            return
        if old is not None:
            self._drop_kid(old, child)
        self._parent[child] = parent
        self._kids.setdefault(parent, set()).add(child)

    def link_chain(self, keys: Sequence[K]) -> None:
        for parent, child in pairwise(keys):
            self.link(child, parent)

    def _drop_kid(self, parent: K, child: K) -> None:
        kids = self._kids[parent]
        kids.discard(child)
        if not kids:
            del self._kids[parent]

    # -- ChunkSource ----------------------------------------------------------------------------

    def _candidate(self, key: K) -> Candidate[K]:
        size, created, last, hits, returned, marks = self._fields[key]
        return Candidate(key, size, created, last, hits, key not in self._kids, returned, marks)

    def sample(self, count: int) -> list[Candidate[K]]:
        return [self._candidate(k) for k in self._present.pick(self._rng, count)]

    def get(self, key: K) -> Candidate[K] | None:
        return self._candidate(key) if key in self._fields else None

    def parent(self, key: K) -> K | None:
        return self._parent.get(key)

    def children(self, key: K) -> list[K] | None:
        return list(self._kids.get(key, ()))

    def census(self, count: int) -> tuple[list[Candidate[K]], float]:
        sample = self.sample(count)
        return sample, (len(self._present) / len(sample) if sample else 0.0)

    def ghost_census(self, count: int) -> tuple[list[Candidate[K]], float]:
        sample = [self._ghosts[k] for k in self._ghost_keys.pick(self._rng, count)]
        return sample, (len(self._ghost_keys) / len(sample) if sample else 0.0)
