"""Eviction policies that need no per-chunk memory: scoring functions over sampled chunks.

A tier of 100 million chunks cannot keep an ordering of its chunks in every gateway's memory (the exact
policies of ``gateway.lifecycle.exact`` took 0.2-1.2 KB per chunk). These policies keep none: what they
know of a chunk is what the index records (size, created, last access, hits, whether a later chunk of
its prefix chain is held: ``leaf``), read through a ``ChunkSource``. To pick a victim a policy samples
a few chunks of the (bucket, tier) at random, ranks them, and evicts the lowest-ranked, the way Redis
approximates LRU and LFU (and LHD samples for hit density): ``samples`` fresh candidates per victim
merged into a small ``pool`` of the lowest-ranked candidates seen so far, so good candidates outlive the
round that found them. Memory is O(pool + statistics) per (bucket, tier), whatever the tier holds.

The offline trace simulator (``gateway.bench.trace_sim``) drives these same classes over an in-memory
``ChunkSource`` (``gateway.lifecycle.memory_source``), so the hit rates it reports are this code's.

Contract:

* ``rank(candidate, now)``: a tuple; lower is evicted first. Named policies differ only here (and in
  ``prefix_aware``).
* ``victim(source, now, exclude)``: the candidate to evict next, or None when the source holds nothing
  (or only ``exclude``\\ d keys). It is re-read from the source just before it is returned, so it is
  present and, for prefix-aware policies, a leaf. The caller reads its parent (``ChunkSource.parent``),
  evicts it, then calls ``evicted``; a
  victim it could not evict it reports with ``forget`` (or just leaves it: it is not in the pool any
  more and is found again by a later sample).
* Prefix-aware policies (``prefix-lru``, ``default``) return only leaves: chunks with no later chunk of
  their learnt chain in this tier, so a prefix lookup never stops at a hole. A sampled chunk that is not
  a leaf is followed down its chain (``ChunkSource.children``) to one that is, at most ``descent`` steps;
  when a leaf is evicted its parent, now perhaps a leaf, joins the pool. If links form a cycle (no leaf
  anywhere), the lowest-ranked sampled chunk goes anyway.
* ``learn(observed)``: a chunk of the tier was read, came back after its eviction, or its eviction was
  forgotten (``backends.index.Observation``, which the index records and the engine hands over);
  ``evicted(victim, parent, source, now, remembered)``: the victim is gone. Only ``default`` learns.
* Time: ``now`` (unix seconds) is always passed in; no policy reads a clock. Threads: none; the engine
  calls a policy from one thread at a time.

Exactness, measured on the Mooncake traces (BENCHMARKS.md, ``kvgw bench trace``): with 16 samples and a
pool of 16, sampled prefix-LRU stays within 0.0025 of the exact one; LRU, FIFO and LFU lose 0.002-0.05
(not being prefix-aware, a victim drawn from among the oldest breaks chains in the middle more often);
``default`` stays above the exact LRU (it ties it at one small capacity) and within 0.012 of the exact
``default`` it replaced.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Hashable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar

from backends.index import MARK_ONE_OFF, MARK_PINNED, MARK_SESSION_ENDED

__all__ = [
    "Candidate",
    "ChunkSource",
    "FIFOPolicy",
    "HitDensityPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PrefixLRUPolicy",
    "ReuseStats",
    "SampledPolicy",
    "age_bucket",
    "reuse_density",
]

K = TypeVar("K", bound=Hashable)
Rank = tuple[float, ...]


class Candidate(NamedTuple, Generic[K]):
    """What a policy sees of one chunk: the index's fields, nothing kept in memory."""

    key: K
    size: int
    created: float
    last_access: float  # the last read, or ``created`` if never read
    hits: int  # reads since it was stored
    leaf: bool = True  # no later chunk of its learnt prefix chain is held in this tier
    returned: bool = False  # stored again while the source remembered evicting it (a ghost)
    marks: int = 0  # engine hints (``backends.index.MARK_*``): pinned chunks are never victims


class ChunkSource(Protocol[K]):
    """The chunks of one (bucket, tier) as the policy may see them: the index, or the simulator's dict."""

    def sample(self, count: int) -> list[Candidate[K]]:
        """Up to ``count`` chunks of the tier chosen at random (fewer only if it holds fewer)."""
        ...

    def get(self, key: K) -> Candidate[K] | None:
        """The chunk as it is now, or None if the tier no longer holds it."""
        ...

    def parent(self, key: K) -> K | None:
        """The learnt previous chunk of ``key``'s prefix chain, if any."""
        ...

    def children(self, key: K) -> list[K] | None:
        """The later chunks of ``key``'s chain (its children) held in this tier; None if there are too
        many to list (a chunk with that many is not treated as a leaf)."""
        ...

    def census(self, count: int) -> tuple[list[Candidate[K]], float]:
        """A random sample of up to ``count`` chunks of the tier (leaves or not) and how many chunks each
        stands for (held / sampled): what ``default`` estimates the ages of cached chunks from."""
        ...

    def ghost_census(self, count: int) -> tuple[list[Candidate[K]], float]:
        """Likewise for the evictions the source remembers (``Candidate.last_access``: before eviction)."""
        ...


class Observed(Protocol):
    """What a policy learns from (``backends.index.Observation``): a chunk just before it was read
    (``kind`` 1), stored again after its eviction (2), or forgotten as evicted (3)."""

    @property
    def kind(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def last_access(self) -> float: ...
    @property
    def hits(self) -> int: ...
    @property
    def at(self) -> float: ...
    @property
    def reads(self) -> int: ...


OBS_READ, OBS_RETURNED, OBS_FORGOTTEN = 1, 2, 3  # as in backends.index
EARLY_MARKS = MARK_SESSION_ENDED | MARK_ONE_OFF  # hinted as read by no one again: evicted right after tails


class SampledPolicy(Generic[K]):
    """Redis-style sampled eviction: ``samples`` random candidates per victim, a pool of the best."""

    name: ClassVar[str]
    prefix_aware: ClassVar[bool] = False
    learns: ClassVar[bool] = False  # whether ``learn`` does anything (callers may skip it)

    def __init__(self, *, samples: int = 16, pool: int = 16, rounds: int = 4, descent: int = 64) -> None:
        if samples < 1 or pool < 1 or rounds < 1:
            raise ValueError("samples, pool and rounds must be >= 1")
        self.samples = samples
        self.pool_size = pool
        self.rounds = rounds
        self.descent = descent
        self._pool: dict[Any, Candidate[K]] = {}

    # -- what named policies define -----------------------------------------------------------------

    def rank(self, c: Candidate[K], now: float) -> Rank:
        raise NotImplementedError

    def learn(self, observed: Observed) -> None:
        """A read, a return or a forgotten eviction of a chunk of this (bucket, tier)."""
        return None

    def export(self) -> dict[str, Any] | None:
        """What the policy has learnt, as a JSON-able document to keep in the catalog
        (``gateway.lifecycle.state``); None: nothing worth keeping (only ``reuse`` keeps its state)."""
        return None

    def restore(self, doc: Any) -> bool:
        """Take back what ``export`` wrote (of this policy); False if nothing was taken."""
        return False

    def status(self) -> dict[str, Any]:
        """What the admin stats show of the policy (``/v1/admin/stats``, ``lifecycle_policies``)."""
        return {"policy": self.name}

    def _observe_eviction(self, victim: Candidate[K], source: ChunkSource[K], now: float, remembered: bool) -> None:
        return None

    # -- victims ------------------------------------------------------------------------------------

    def victim(self, source: ChunkSource[K], now: float, exclude: Collection[K] = ()) -> Candidate[K] | None:
        """The chunk to evict next (see the module docstring); None if there is none."""
        pool = self._pool
        stuck: list[Candidate[K]] = []  # sampled non-leaves, to descend from if no leaf turns up
        for _ in range(self.rounds):
            self._fill(source, exclude, stuck)
            if pool or not stuck:
                break
        held = False  # a walk down a chain ended at a pinned chunk: the chain is no cycle
        if not pool and stuck:  # follow the lowest-ranked few down their chains (each walk reads the index)
            stuck.sort(key=lambda c: self.rank(c, now))
            for c in stuck[: max(1, self.samples // 4)]:
                leaf = self._descend(source, c)
                if leaf is not None and leaf.marks & MARK_PINNED:
                    held = True
                elif leaf is not None and leaf.key not in exclude:
                    pool[leaf.key] = leaf
        ranked = sorted(pool.values(), key=lambda c: self.rank(c, now))
        for stale in ranked[self.pool_size :]:
            del pool[stale.key]
        del ranked[self.pool_size :]
        while ranked:
            best = ranked.pop(0)
            fresh = source.get(best.key)
            if fresh is None or best.key in exclude or fresh.marks & MARK_PINNED or \
                    not self._leaf(fresh, source, exclude):
                pool.pop(best.key, None)
                continue
            if fresh != best:  # read (or re-linked) since it was sampled: rank it again
                pool[best.key] = fresh
                rank = self.rank(fresh, now)
                if ranked and rank > self.rank(ranked[0], now):
                    bisect.insort(ranked, fresh, key=lambda c: self.rank(c, now))
                    continue
            del pool[best.key]
            return fresh
        if stuck and not held:  # nothing is a leaf (links form a cycle): progress beats the rule
            return source.get(min(stuck, key=lambda c: self.rank(c, now)).key)
        return None  # (samples of pinned chunks and their chains only also end here: the engine says why it waits)

    def evicted(self, victim: Candidate[K], parent: K | None, source: ChunkSource[K], now: float, *,
                remembered: bool = False) -> None:
        """``victim`` left the tier: learn from it. ``parent``: its learnt parent, read before the eviction
        (which forgets the link); now perhaps a leaf, it joins the pool. ``remembered``: the source keeps
        it as a ghost (its return, or its being forgotten, will be observed)."""
        self._pool.pop(victim.key, None)
        self._observe_eviction(victim, source, now, remembered)
        if self.prefix_aware and parent is not None:
            up = source.get(parent)
            if up is not None and up.leaf and not up.marks & MARK_PINNED:
                self._pool[parent] = up

    def forget(self, key: K) -> None:
        """Drop ``key`` from the pool (a victim the caller could not evict)."""
        self._pool.pop(key, None)

    def picked(self, victim: Candidate[K], parent: K | None, source: ChunkSource[K], exclude: Collection[K]) -> None:
        """``victim`` is going with the keys in ``exclude`` (a batch picked before any is evicted): its
        parent is a leaf once they are gone, so it may follow in the same batch."""
        if self.prefix_aware and parent is not None and parent not in exclude:
            up = source.get(parent)
            if up is not None and not up.marks & MARK_PINNED and self._leaf(up, source, exclude):
                self._pool[parent] = up

    def _leaf(self, c: Candidate[K], source: ChunkSource[K], exclude: Collection[K]) -> bool:
        """Whether ``c`` may go (prefix-aware policies: no child of it stays in the tier)."""
        if not self.prefix_aware or c.leaf:
            return True
        if not exclude:
            return False
        kids = source.children(c.key)
        return kids is not None and all(k in exclude for k in kids)

    def _fill(self, source: ChunkSource[K], exclude: Collection[K], stuck: list[Candidate[K]]) -> None:
        """One round of sampling into the pool; non-leaves (prefix-aware policies) go to ``stuck``."""
        pool = self._pool
        prefix_aware = self.prefix_aware
        for c in source.sample(self.samples):
            if c.key in exclude or c.marks & MARK_PINNED:
                continue
            if prefix_aware and not c.leaf:
                stuck.append(c)
                continue
            pool[c.key] = c

    def _descend(self, source: ChunkSource[K], c: Candidate[K]) -> Candidate[K] | None:
        """Follow ``c``'s chain towards its end, through its least recently used child, until a leaf
        (at most ``descent`` steps). The leaf may be pinned: the caller does not evict it then."""
        for _ in range(self.descent):
            below = None
            for key in source.children(c.key) or ():
                kid = source.get(key)
                if kid is not None and (below is None or kid.last_access < below.last_access):
                    below = kid
            if below is None:
                return None
            if below.leaf:
                return below
            c = below
        return None


class LRUPolicy(SampledPolicy[K]):
    """Least recently used (read or stored)."""

    name: ClassVar[str] = "lru"

    def rank(self, c: Candidate[K], now: float) -> Rank:
        return (c.last_access,)


class FIFOPolicy(SampledPolicy[K]):
    """First in, first out: reads do not count."""

    name: ClassVar[str] = "fifo"

    def rank(self, c: Candidate[K], now: float) -> Rank:
        return (c.created,)


class LFUPolicy(SampledPolicy[K]):
    """Least frequently read since stored, ties by least recently used."""

    name: ClassVar[str] = "lfu"

    def rank(self, c: Candidate[K], now: float) -> Rank:
        return (float(c.hits), c.last_access)


class PrefixLRUPolicy(SampledPolicy[K]):
    """Prefix-aware LRU: only leaves of the learnt chains, least recently used first."""

    name: ClassVar[str] = "prefix-lru"
    prefix_aware: ClassVar[bool] = True

    def rank(self, c: Candidate[K], now: float) -> Rank:
        return (c.last_access,)


# -- hit density (default) -------------------------------------------------------------------------

FRESH = 0  # never read since stored
REUSED = 1  # read at least once
TAIL = 2  # never read and smaller than the largest chunk seen: the partial last block of a prompt
_CLASSES = 2  # classes with statistics (TAIL leaves are simply evicted first)

_PER_OCTAVE = 2
_BASE_AGE = 0.05  # seconds: ages below this share bucket 0
AGE_BUCKETS = 56  # up to 0.05 * 2**28 s (~150 days); older ages share the last bucket
_LOW = [0.0] + [_BASE_AGE * 2 ** (b / _PER_OCTAVE) for b in range(1, AGE_BUCKETS + 1)]
AGE_WIDTH = [_LOW[b + 1] - _LOW[b] for b in range(AGE_BUCKETS)]

_MIN_CLOSED = 32  # intervals a class must have seen end before its density is trusted
_MIN_AT_RISK = 20  # a bucket's hazard is measured only where this many intervals reached it
_TAIL_BUCKETS = 4  # reliable buckets the constant tail hazard is measured over
_KEEP_CLOSED = 16384  # closed-interval counts are halved past this many (the estimate follows the workload)
_REFRESH_EVERY = 256  # evictions between two recomputations of the densities
_WARMUP_TURNOVER = 0.5  # densities are trusted once this many evictions per cached chunk happened


def age_bucket(age: float) -> int:
    """The logarithmic age bucket (seconds since the last access) reuse statistics are kept in."""
    if age < _BASE_AGE:
        return 0
    return min(int(math.log2(age / _BASE_AGE) * _PER_OCTAVE) + 1, AGE_BUCKETS - 1)


class ReuseStats:
    """Reuse-age statistics of one class and the hit density derived from them.

    An interval opens at every access (store or read) of a chunk and closes at its next read or return
    (``reused``, at the age it reached), or when its eviction is forgotten, or at the eviction itself
    if the source keeps no ghost of it (``censored``: the reuse, if any, comes later than we waited).
    Kaplan-Meier over logarithmic age buckets gives the reuse-age distribution; intervals still open
    (cached chunks and remembered evictions, estimated from a random sample of each) count as at risk,
    so long reuses are not under-counted while they are still open; beyond the oldest well-observed age
    the hazard is extrapolated as constant.
    """

    __slots__ = ("censored", "closed", "density", "reused")

    def __init__(self) -> None:
        self.reused = [0.0] * AGE_BUCKETS
        self.censored = [0.0] * AGE_BUCKETS
        self.closed = 0.0
        self.density: list[float] | None = None

    def close(self, age: float, *, reused: bool, count: float = 1.0) -> None:
        (self.reused if reused else self.censored)[age_bucket(age)] += count
        self.closed += count

    def refresh(self, opened: list[float]) -> None:
        self.density, self.closed = reuse_density(self.reused, self.censored, opened, AGE_WIDTH, closed=self.closed,
                                                  keep=_KEEP_CLOSED)


def reuse_density(reused: list[float], censored: list[float], opened: Sequence[float], width: Sequence[float], *,
                  closed: float, keep: float) -> tuple[list[float] | None, float]:
    """One class's hit density per age bucket from its reuse-age counts, and how many closed intervals
    the counts hold afterwards.

    One estimator serves both hit-density policies, this sampled one and the exact one of
    ``gateway.lifecycle.policy_density`` (ages in inserts there, in seconds here: only the buckets'
    ``width`` differs), so a fix or a tuning of the estimate reaches both.

    ``reused``/``censored``: intervals closed by a reuse / without one, by age bucket, ``closed`` of them
    in all; past ``keep`` both are halved in place (forgetting slowly lets the estimate follow a
    changing workload). Below ``_MIN_CLOSED`` the density is None: too little seen to trust.
    ``opened``: intervals still open, by the age they have reached; they count as at risk, so long
    reuses are not under-counted while still open. Kaplan-Meier over the buckets gives the survival
    (not yet reused) per age; past the last bucket that ``_MIN_AT_RISK`` intervals reached, the hazard
    is extrapolated as the constant rate of the last ``_TAIL_BUCKETS`` reliable buckets. The density at
    an age is the best, over horizons, of P(reused within the horizon | not yet) over the expected
    occupancy until then (a Gittins index; LHD's hit density).
    """
    nbuckets = len(width)
    if closed > keep:
        for b in range(nbuckets):
            reused[b] *= 0.5
            censored[b] *= 0.5
        closed *= 0.5
    if closed < _MIN_CLOSED:
        return None, closed
    at_risk = [0.0] * (nbuckets + 1)
    for b in range(nbuckets - 1, -1, -1):
        at_risk[b] = at_risk[b + 1] + reused[b] + censored[b] + opened[b]
    reliable = [b for b in range(nbuckets) if at_risk[b] >= _MIN_AT_RISK]
    last = reliable[-1] if reliable else -1
    tail = reliable[-_TAIL_BUCKETS:]
    exposure = sum(at_risk[b] * width[b] for b in tail)
    tail_rate = sum(reused[b] for b in tail) / exposure if exposure > 0 else 0.0
    surv = [1.0] * (nbuckets + 1)
    for b in range(nbuckets):
        hazard = reused[b] / at_risk[b] if b <= last else 1.0 - math.exp(-tail_rate * width[b])
        surv[b + 1] = surv[b] * (1.0 - hazard)
    density = [0.0] * nbuckets
    for a in range(nbuckets):
        alive = surv[a]
        if alive <= 1e-12:
            continue
        best = occupancy = 0.0
        for e in range(a, nbuckets):
            occupancy += width[e] * (surv[e] + surv[e + 1]) * 0.5
            rate = (alive - surv[e + 1]) / occupancy
            if rate > best:
                best = rate
            if surv[e + 1] < alive * 1e-4:
                break
        density[a] = best
    return density, closed


class HitDensityPolicy(SampledPolicy[K]):
    """Prefix-aware eviction by learnt hit density per byte of never-read vs read chunks, partial tails
    first: LHD (Beckmann et al., NSDI'18) over sampled candidates.

    Why not LRU: most KV chunks are written once and never read again, while a chunk read once is far
    more likely to be read again; how much more, and for how long, depends on workload and capacity,
    so the policy measures it. Chunks are FRESH (never read), REUSED (read, or stored again after an
    eviction the index remembered: ``returned``) or TAIL (never read and smaller than the largest chunk
    seen: a prompt's partial last block, which only an exact repeat of the prompt can hit). Per class
    it keeps reuse-age statistics (``ReuseStats``; ages are seconds since the last access, in
    logarithmic buckets), fed by reads, returns and evictions, and from them a hit density per age: the
    best, over horizons, of P(read within the horizon | unread so far) over the expected occupancy
    until then. A candidate's rank is that density at its age divided by its size; TAIL leaves rank
    below everything. Until the tier has evicted half as many chunks as it holds and both classes have
    statistics, it ranks like prefix-LRU.

    Memory: two classes x 56 age buckets x 2 floats, and the pool. Nothing per chunk: what an exact
    policy keeps per chunk (class, age, ghosts of evicted chunks) is read from the index.
    """

    name: ClassVar[str] = "hit-density"
    prefix_aware: ClassVar[bool] = True
    learns: ClassVar[bool] = True

    def __init__(self, *, samples: int = 16, pool: int = 16, rounds: int = 4, descent: int = 64,
                 census: int = 256) -> None:
        super().__init__(samples=samples, pool=pool, rounds=rounds, descent=descent)
        self.census = census
        self._stats = tuple(ReuseStats() for _ in range(_CLASSES))
        self._largest = 0
        self._evicted = 0
        self._since_refresh = 0
        self._trusted = False

    def classify(self, size: int, hits: int) -> int:
        if size > self._largest:
            self._largest = size
        if hits:
            return REUSED
        return TAIL if size < self._largest else FRESH

    def rank(self, c: Candidate[K], now: float) -> Rank:
        cls = self.classify(c.size, c.hits + c.returned)
        if cls == TAIL:
            return (-1.0, c.last_access)
        if c.marks & EARLY_MARKS:
            return (-0.5, c.last_access)
        if not self._trusted:
            return (0.0, c.last_access)
        density = self._stats[cls].density
        assert density is not None
        return (0.0, density[age_bucket(now - c.last_access)] / max(c.size, 1), c.last_access)

    def learn(self, observed: Observed) -> None:
        cls = self.classify(observed.size, observed.hits)
        if cls == TAIL:
            return
        age = observed.at - observed.last_access
        if observed.kind == OBS_READ:
            self._stats[cls].close(age, reused=True)
            if observed.reads > 1:  # reads folded together came close after each other
                self._stats[REUSED].close(0.0, reused=True, count=observed.reads - 1)
        elif observed.kind == OBS_RETURNED:
            self._stats[cls].close(age, reused=True)
        elif observed.kind == OBS_FORGOTTEN:
            self._stats[cls].close(age, reused=False)

    def _observe_eviction(self, victim: Candidate[K], source: ChunkSource[K], now: float, remembered: bool) -> None:
        if not remembered:
            cls = self.classify(victim.size, victim.hits + victim.returned)
            if cls != TAIL:
                self._stats[cls].close(now - victim.last_access, reused=False)
        self._evicted += 1
        self._since_refresh += 1
        if self._since_refresh >= _REFRESH_EVERY:
            self.refresh(source, now)

    def refresh(self, source: ChunkSource[K], now: float) -> None:
        """Recompute the densities, with the open intervals estimated from a census of the source."""
        self._since_refresh = 0
        opened = [[0.0] * AGE_BUCKETS for _ in range(_CLASSES)]
        cached, weight = source.census(self.census)
        held = len(cached) * weight
        ghosts, ghost_weight = source.ghost_census(self.census)
        for sample, each in ((cached, weight), (ghosts, ghost_weight)):
            for c in sample:
                cls = self.classify(c.size, c.hits + c.returned)
                if cls != TAIL:
                    opened[cls][age_bucket(now - c.last_access)] += each
        for stats, open_ in zip(self._stats, opened, strict=True):
            stats.refresh(open_)
        self._trusted = (self._evicted >= _WARMUP_TURNOVER * held
                         and all(s.density is not None for s in self._stats))
