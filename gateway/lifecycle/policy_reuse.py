"""The reuse-aware eviction policy (``reuse``): hit density learnt per class of reads and engine hints.

What it adds to ``hit-density`` (``gateway.lifecycle.policy.HitDensityPolicy``, whose estimator it uses):

* **Classes.** A chunk's class is whether it was read since it was stored (the strongest signal of a
  next read in every trace measured) and what engines said of it: ``shared`` (a retention class),
  ``ended`` (the request that wrote or read it finished and nothing read it since), or neither. Each
  class has its own reuse-age statistics; a class that has seen too little borrows those of its read
  class. Finer read classes (1, 2, 3+ reads) and per-chain features (the gap between turns, the depth in
  the chain) were measured too and did not pay on the Mooncake traces (BENCHMARKS.md, ``kvgw bench
  trace``: even the trace's own statistics per such class close at most a quarter of the LRU->Belady gap).
* **Hints.** Pinned chunks are never victims (``SampledPolicy``); ``session-ended`` and ``one-off``
  chunks go right after partial tails.
* **Learnt state that survives.** ``export()`` / ``restore()``: the statistics, as a JSON document the
  lifecycle leader keeps in the catalog (``gateway.lifecycle.state``), so a restarted gateway or a new
  leader goes on from what was learnt instead of starting over as prefix-LRU until it has evicted half
  the tier.

Memory: 6 + 2 classes x 56 age buckets x 3 floats, and the pool: nothing per chunk (what it needs of a
chunk, the index records: reads, last access, size, marks, leaf).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, TypeVar

from backends.index import MARK_ENDED, MARK_SHARED
from gateway.lifecycle.policy import (
    AGE_BUCKETS,
    EARLY_MARKS,
    OBS_FORGOTTEN,
    OBS_READ,
    OBS_RETURNED,
    Candidate,
    ChunkSource,
    Observed,
    Rank,
    ReuseStats,
    SampledPolicy,
    age_bucket,
)

K = TypeVar("K", bound=Hashable)

READ_CLASSES = 2  # never read since stored, read
MARK_CLASSES = 3  # neither, shared, ended
CLASSES = READ_CLASSES * MARK_CLASSES
REFRESH_EVERY = 256  # evictions between two recomputations of the densities
WARMUP_TURNOVER = 0.5  # densities are trusted once this many evictions per cached chunk happened
STATE_VERSION = 1


def mark_class(marks: int) -> int:
    """0 neither, 1 shared, 2 ended (shared wins: a shared prefix outlives the requests that end)."""
    if marks & MARK_SHARED:
        return 1
    if marks & MARK_ENDED:
        return 2
    return 0


class ReusePolicy(SampledPolicy[K]):
    """Prefix-aware sampled eviction by hit density per class of reads and hints; see the module docstring."""

    name: ClassVar[str] = "reuse"
    prefix_aware: ClassVar[bool] = True
    learns: ClassVar[bool] = True

    def __init__(self, *, samples: int = 16, pool: int = 16, rounds: int = 4, descent: int = 64,
                 census: int = 256) -> None:
        super().__init__(samples=samples, pool=pool, rounds=rounds, descent=descent)
        self.census = census
        self._fine = [ReuseStats() for _ in range(CLASSES)]
        self._coarse = [ReuseStats() for _ in range(READ_CLASSES)]
        self._largest = 0  # the largest chunk seen: smaller never-read ones are partial tails
        self._evicted = 0
        self._since_refresh = 0
        self._trusted = False
        self.restored = False  # started from a saved state (a restart or a new leader)

    # -- classes and densities ----------------------------------------------------------------------

    def classify(self, size: int, reads: int, marks: int) -> int | None:
        """The chunk's class (``reads * MARK_CLASSES + mark class``); None for a partial tail (never read
        and smaller than the largest chunk seen)."""
        if size > self._largest:
            self._largest = size
        if not reads and size < self._largest:
            return None
        return min(reads, READ_CLASSES - 1) * MARK_CLASSES + mark_class(marks)

    def density(self, cls: int, age: float) -> float:
        """Hits per second the class promises at ``age`` (its own statistics, else its read count's)."""
        b = age_bucket(age)
        fine = self._fine[cls].density
        if fine is not None:
            return fine[b]
        coarse = self._coarse[cls // MARK_CLASSES].density
        return coarse[b] if coarse is not None else 0.0

    def rank(self, c: Candidate[K], now: float) -> Rank:
        cls = self.classify(c.size, c.hits + c.returned, c.marks)
        if cls is None:
            return (-1.0, c.last_access)
        if c.marks & EARLY_MARKS:
            return (-0.5, c.last_access)
        if not self._trusted:
            return (0.0, c.last_access)
        return (0.0, self.density(cls, now - c.last_access) / max(c.size, 1), c.last_access)

    # -- learning -----------------------------------------------------------------------------------

    def _close(self, cls: int, age: float, *, reused: bool, count: float = 1.0) -> None:
        self._fine[cls].close(age, reused=reused, count=count)
        self._coarse[cls // MARK_CLASSES].close(age, reused=reused, count=count)

    def learn(self, observed: Observed) -> None:
        marks = getattr(observed, "marks", 0)
        cls = self.classify(observed.size, observed.hits, marks)
        if cls is None:
            return
        age = observed.at - observed.last_access
        if observed.kind == OBS_READ:
            self._close(cls, age, reused=True)
            if observed.reads > 1:  # reads folded together came close after each other
                again = self.classify(observed.size, observed.hits + 1, marks)
                assert again is not None
                self._close(again, 0.0, reused=True, count=observed.reads - 1)
        elif observed.kind == OBS_RETURNED:
            self._close(cls, age, reused=True)
        elif observed.kind == OBS_FORGOTTEN:
            self._close(cls, age, reused=False)

    def _observe_eviction(self, victim: Candidate[K], source: ChunkSource[K], now: float, remembered: bool) -> None:
        cls = self.classify(victim.size, victim.hits + victim.returned, victim.marks)
        if cls is not None and not remembered:
            self._close(cls, now - victim.last_access, reused=False)
        self._evicted += 1
        self._since_refresh += 1
        if self._since_refresh >= REFRESH_EVERY:
            self.refresh(source, now)

    def refresh(self, source: ChunkSource[K], now: float) -> None:
        """Recompute the densities, with the open intervals estimated from a census of the source."""
        self._since_refresh = 0
        fine = [[0.0] * AGE_BUCKETS for _ in range(CLASSES)]
        coarse = [[0.0] * AGE_BUCKETS for _ in range(READ_CLASSES)]
        cached, weight = source.census(self.census)
        held = len(cached) * weight
        ghosts, ghost_weight = source.ghost_census(self.census)
        for sample, each in ((cached, weight), (ghosts, ghost_weight)):
            for c in sample:
                cls = self.classify(c.size, c.hits + c.returned, c.marks)
                if cls is not None:
                    b = age_bucket(now - c.last_access)
                    fine[cls][b] += each
                    coarse[cls // MARK_CLASSES][b] += each
        for stats, opened in zip(self._fine, fine, strict=True):
            stats.refresh(opened)
        for stats, opened in zip(self._coarse, coarse, strict=True):
            stats.refresh(opened)
        self._trusted = (self._evicted >= WARMUP_TURNOVER * held
                         and sum(s.density is not None for s in self._coarse) >= 2)

    # -- learnt state that survives -----------------------------------------------------------------

    def export(self) -> dict[str, Any] | None:
        """The learnt state as a JSON-able document (``restore`` takes it back)."""
        return {
            "policy": self.name, "version": STATE_VERSION, "largest": self._largest, "evicted": self._evicted,
            "trusted": self._trusted,
            "fine": [_stats_doc(s) for s in self._fine], "coarse": [_stats_doc(s) for s in self._coarse],
        }

    def restore(self, doc: Any) -> bool:
        """Take back what ``export`` wrote; False (nothing changed) for a document of another policy or
        version, or a malformed one."""
        if not isinstance(doc, dict):
            return False
        try:
            if doc.get("policy") != self.name or doc.get("version") != STATE_VERSION:
                return False
            fine = [_stats_from(d) for d in doc["fine"]]
            coarse = [_stats_from(d) for d in doc["coarse"]]
            if len(fine) != CLASSES or len(coarse) != READ_CLASSES:
                return False
            largest, evicted, trusted = int(doc["largest"]), int(doc["evicted"]), bool(doc["trusted"])
        except (KeyError, TypeError, ValueError):
            return False
        self._fine, self._coarse = fine, coarse
        self._largest, self._evicted, self._trusted = largest, evicted, trusted
        self.restored = True
        return True

    def status(self) -> dict[str, Any]:
        """Whether the densities are trusted yet, evictions learnt from, and whether it went on from a
        saved state."""
        return {"policy": self.name, "trusted": self._trusted, "evictions_learnt": self._evicted,
                "restored": self.restored}


def _stats_doc(stats: ReuseStats) -> dict[str, Any]:
    return {"reused": stats.reused, "censored": stats.censored, "closed": stats.closed, "density": stats.density}


def _stats_from(doc: dict[str, Any]) -> ReuseStats:
    stats = ReuseStats()
    reused = [float(v) for v in doc["reused"]]
    censored = [float(v) for v in doc["censored"]]
    density = doc["density"]
    if len(reused) != AGE_BUCKETS or len(censored) != AGE_BUCKETS or (
            density is not None and len(density) != AGE_BUCKETS):
        raise ValueError("reuse statistics of another shape")
    stats.reused, stats.censored, stats.closed = reused, censored, float(doc["closed"])
    stats.density = None if density is None else [float(v) for v in density]
    if not all(math.isfinite(v) for v in (*reused, *censored, stats.closed, *(stats.density or ()))):
        raise ValueError("reuse statistics that are not finite")
    return stats
