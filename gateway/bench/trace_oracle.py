"""A ceiling for class-statistics eviction policies: hit density per class, from the trace's own future.

``reuse`` (and ``hit-density`` before it) learn, online, how likely a chunk of a class is to be read
again at its age, and evict the chunk worth least per byte. How much better could any such policy do,
with richer classes and perfect statistics? ``oracle-classes`` answers it on a given trace: its classes
are what the tier could know of a block (reads so far: 0, 1, 2, 3+; the gap between its last two
accesses, or for a block never read its chain's, log4 seconds; the length of the request that wrote it,
log4 blocks), and its statistics are
measured over the whole trace in advance (every reuse interval, none censored), then used unchanged
through the same sampled, prefix-aware eviction. It is not an online policy (it knows the trace's
statistics before it starts) and is printed as a baseline only (``kvgw bench trace --also
oracle-classes``); BENCHMARKS.md reads it as the most a per-class policy can close of the LRU->Belady gap.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from gateway.lifecycle.policy import AGE_BUCKETS, AGE_WIDTH, Candidate, Rank, SampledPolicy, age_bucket, reuse_density

NAME = "oracle-classes"


class _Request(Protocol):
    @property
    def timestamp(self) -> float: ...

    @property
    def hash_ids(self) -> tuple[int, ...]: ...

    @property
    def last_block_tokens(self) -> int: ...

    @property
    def block_tokens(self) -> int: ...


def _log4(x: float, top: int) -> int:
    return min(int(math.log(max(x, 1.0), 4)), top)


def gap_class(gap: float | None) -> int:
    """The chain's mean gap between turns, log4 seconds (0..5), or 6: none seen yet."""
    return 6 if gap is None else _log4(gap, 5)


class OracleClasses(SampledPolicy[int]):
    """Prefix-aware sampled eviction by per-class hit density measured over the whole trace."""

    name: ClassVar[str] = NAME
    prefix_aware: ClassVar[bool] = True

    def __init__(self, requests: Sequence[_Request]) -> None:
        super().__init__()
        self._static: dict[int, tuple[int, float | None, bool]] = {}  # block -> length class, inherited gap, tail
        self._times: dict[int, list[float]] = {}  # block -> its access times (what lets it know its last gap)
        last: dict[int, tuple[float, tuple[int, int, int]]] = {}
        hits: dict[int, int] = {}
        reused: dict[tuple[int, int, int], list[float]] = {}
        censored: dict[tuple[int, int, int], list[float]] = {}
        for req in requests:
            prev: int | None = None
            n = len(req.hash_ids)
            for pos, block in enumerate(req.hash_ids):
                t = req.timestamp
                if block in last:
                    t0, cls = last[block]
                    reused.setdefault(cls, [0.0] * AGE_BUCKETS)[age_bucket(t - t0)] += 1
                    hits[block] += 1
                else:
                    inherited = None
                    if prev is not None and hits[prev]:
                        inherited = self._last_gap(prev, last[prev][0])
                    tail = pos == n - 1 and req.last_block_tokens < req.block_tokens
                    self._static[block] = (_log4(n, 4), inherited, tail)
                    hits[block] = 0
                self._times.setdefault(block, []).append(t)
                last[block] = (t, self._key(block, hits[block], t))
                prev = block
        end = requests[-1].timestamp if requests else 0.0
        for t0, cls in last.values():
            censored.setdefault(cls, [0.0] * AGE_BUCKETS)[age_bucket(end - t0)] += 1
        self._density: dict[tuple[int, int, int], list[float]] = {}
        for cls in reused.keys() | censored.keys():
            r = reused.get(cls, [0.0] * AGE_BUCKETS)
            c = censored.get(cls, [0.0] * AGE_BUCKETS)
            density = reuse_density(r, c, [0.0] * AGE_BUCKETS, AGE_WIDTH, closed=sum(r) + sum(c), keep=math.inf)[0]
            if density is not None:
                self._density[cls] = density

    def _last_gap(self, block: int, last_access: float) -> float | None:
        times = self._times[block]
        at = bisect.bisect_right(times, last_access) - 1
        return times[at] - times[at - 1] if at >= 1 else None

    def _key(self, block: int, hits: int, last_access: float) -> tuple[int, int, int]:
        length, inherited, _ = self._static[block]
        gap = self._last_gap(block, last_access) if hits else inherited
        return (min(hits, 3), gap_class(gap), length)

    def rank(self, c: Candidate[Any], now: float) -> Rank:
        reads = c.hits + c.returned
        if not reads and self._static[c.key][2]:
            return (-1.0, c.last_access)
        density = self._density.get(self._key(c.key, reads, c.last_access))
        if density is None:
            return (0.0, 0.0, c.last_access)
        return (0.0, density[age_bucket(now - c.last_access)] / max(c.size, 1), c.last_access)
