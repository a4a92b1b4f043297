"""The LMDB index as a ``ChunkSource``: the chunks of one (bucket, tier) as the sampled policies see them.

Every call is a short read transaction (``backends.index``); nothing is cached between calls, so the
lifecycle holds no per-chunk state. Calls may take a few hundred microseconds (a sample walks a few
dozen entries and looks up their children), so the engine makes them in a worker thread.
"""

from __future__ import annotations

import random

from backends.index import ChunkIndex, IndexEntry
from backends.tiers import TierId
from gateway.lifecycle.policy import Candidate


def candidate(digest: bytes, entry: IndexEntry, leaf: bool) -> Candidate[bytes]:
    """The policy's view of an index entry."""
    return Candidate(digest, entry.size, entry.created, max(entry.last_access, entry.created), entry.hits, leaf,
                     entry.returned, entry.marks)


class IndexSource:
    """The chunks of ``bucket`` with a copy in ``tier``, live at ``now`` (expired ones are TTL's)."""

    def __init__(self, index: ChunkIndex, bucket: str, tier: TierId, now: float, *,
                 rng: random.Random | None = None, scan_limit: int = 4096) -> None:
        self._index = index
        self.bucket = bucket
        self.tier = tier
        self.now = now
        self._rng = rng if rng is not None else random.Random()
        self.scan_limit = scan_limit

    def _start(self) -> bytes:
        return self._rng.randbytes(16)

    def sample(self, count: int) -> list[Candidate[bytes]]:
        found = self._index.sample(self.bucket, int(self.tier), count, self.now, self._start(),
                                   scan_limit=self.scan_limit)
        return [candidate(digest, entry, leaf) for digest, entry, leaf in found]

    def get(self, key: bytes) -> Candidate[bytes] | None:
        found = self._index.candidate(key, int(self.tier))
        if found is None or found[0].bucket != self.bucket or not found[0].alive(self.now):
            return None
        return candidate(key, *found)

    def parent(self, key: bytes) -> bytes | None:
        return self._index.parent_of(key)

    def children(self, key: bytes) -> list[bytes] | None:
        return self._index.children_in(key, int(self.tier))

    def census(self, count: int) -> tuple[list[Candidate[bytes]], float]:
        sample = self.sample(count)
        held = self._index.usage(self.bucket, int(self.tier))[1]
        return sample, (held / len(sample) if sample else 0.0)

    def ghost_census(self, count: int) -> tuple[list[Candidate[bytes]], float]:
        drawn = self._index.sample_ghosts(count, self._start())
        if not drawn:
            return [], 0.0
        each = self._index.ghost_count() / len(drawn)  # ghosts of every bucket and tier were drawn
        # (a ghost's hits include the return that made it returned)
        mine = [Candidate(digest, g.size, g.last_access, g.last_access, g.hits, marks=g.marks)
                for digest, g in drawn if g.bucket == self.bucket and g.tier == self.tier]
        return mine, each
