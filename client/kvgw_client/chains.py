"""Which chunk comes before which: prefix chains learned from the key lists LMCache looks up.

The gateway learns prefix chains from ``X-Kvgw-Parent`` on PUT. Inside one LMCache store call the
parent of a chunk is simply the key before it, but the first chunk of a call continues a chain that
began in an earlier call. Every request is looked up (whole, in token order) before its new chunks are
stored, so remembering ``key -> previous key`` from lookups gives the parent of those first chunks.

``same_chain`` decides whether two neighbours in a looked-up list belong to one chain (the L2
adapter's lists interleave object groups); the default says yes.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence


class ParentMap:
    """A bounded LRU of ``key -> parent key``; thread-safe."""

    def __init__(self, capacity: int = 1 << 16, same_chain: Callable[[str, str], bool] | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._same_chain = same_chain
        self._lock = threading.Lock()
        self._parents: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._parents)

    def learn(self, keys: Sequence[str]) -> None:
        """Record each key's predecessor in ``keys`` (an ordered chain, or interleaved chains)."""
        with self._lock:
            for prev, key in itertools.pairwise(keys):
                if self._same_chain is not None and not self._same_chain(prev, key):
                    continue
                self._parents[key] = prev
                self._parents.move_to_end(key)
            while len(self._parents) > self._capacity:
                self._parents.popitem(last=False)

    def parent(self, key: str) -> str | None:
        with self._lock:
            return self._parents.get(key)

    def parents_of_run(self, keys: Sequence[str]) -> list[str | None]:
        """Parents for keys stored together in chain order: the learned parent of the first, then each
        key's predecessor in ``keys`` (learned ones win where they disagree)."""
        out: list[str | None] = []
        with self._lock:
            for i, key in enumerate(keys):
                learned = self._parents.get(key)
                if learned is None and i > 0 and (self._same_chain is None or self._same_chain(keys[i - 1], key)):
                    learned = keys[i - 1]
                out.append(learned)
        return out
