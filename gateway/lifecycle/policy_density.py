"""Hit-density eviction, the ``default`` policy: prefix-aware, and learns what a chunk is worth.

Why not LRU. Most KV chunks are written once and never read again (on the Mooncake conversation trace
three in four), while a chunk that has been read once is far more likely to be read again. LRU keeps
every new chunk as long as a proven one. Always evicting never-reused chunks first is right for small
caches but starves conversations whose next turn comes late when the cache is large; the right split
depends on the workload and the capacity, so this policy measures it instead of fixing it.

How. Chunks are in one of two classes: FRESH (first time seen, as far as the history remembers) and
REUSED (hit while cached, or inserted again while remembered in the history of evicted keys). Every
access opens a *reuse interval* that ends at the key's next access, whether or not the chunk was still
cached: evicted keys stay in a bounded history (``history`` times the number of cached keys, key and
one int each). Per class, a Kaplan-Meier estimate of the reuse-age distribution is kept over
logarithmic age buckets, where age counts inserts (the tier's own turnover clock, independent of
traffic rate and wall time); intervals still open count as at risk, so the estimate is not biased
towards short reuses during warm-up, and beyond the oldest well-observed age the hazard is
extrapolated as constant. From it each class gets a hit density per age: the best, over horizons, of
P(reused within the horizon | unused so far) divided by the expected cache occupancy until then
(a Gittins index for the reuse process; LHD, Beckmann et al. NSDI'18, uses the same notion).

Partial tails. A chunk smaller than the largest chunk seen so far is the partial last block of a prompt:
its hash covers a block that the next turn of the conversation fills further, so only an exact repeat
of the prompt can hit it (on the Mooncake traces 1% and 5% of them are ever read again, against 24% and
42% of new full chunks). Such chunks form a third class, TAIL, whose leaves are evicted first.

Victim: among *leaves* only (as in ``prefix-lru``, a chunk with a cached descendant in its learnt chain
is never evicted: a prefix lookup would stop at the hole), a TAIL leaf if there is one; otherwise, of
the oldest and the youngest leaf of FRESH and of REUSED, the one with the lowest hit density at its
age (ties: the older). Looking at both ends of each class is a cheap stand-in for LHD's sampling: a
density that falls with age makes the oldest leaf the cheapest (LRU), one that rises makes it the
youngest (a new chunk that is not admitted for long), and both shapes occur. The densities are used
only once a class has seen ``_MIN_CLOSED`` intervals end and the tier has evicted at least half as many
chunks as it holds: before that no interval as long as the residency has been observed and the density
at the ages where evictions happen is extrapolation, so until then the oldest leaf goes (prefix-LRU).

Cost: ``insert``/``touch``/``remove``/``victim`` are O(log n) amortised (lazy heaps, one dict lookup
per history hit; ``victim`` reads five heap tops). Every ``max(256, n/4)`` inserts the densities are
recomputed in O(B^2 + E), B = 80 age buckets, E <= 64*(1 + history) epochs of open intervals, about a
millisecond. Memory, measured with 16-byte keys (keys not counted): about 1.2 KB per cached key, of
which 0.6 KB is the history of evicted keys (``history`` = 4 of them per cached key, 0.15 KB each) and
most of the rest the two lazy heaps per class.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import ClassVar, Generic, TypeVar

from gateway.lifecycle.policy import reuse_density
from gateway.lifecycle.policy_tree import LazyHeap, PrefixTree

K = TypeVar("K", bound=Hashable)

FRESH = 0
REUSED = 1
TAIL = 2  # a first-seen chunk smaller than the largest seen: the partial last block of a prompt
_CLASSES = 3
_CLS_BITS = 2
_CLS_MASK = (1 << _CLS_BITS) - 1
_TICK_BITS = 32
_TICK_MAX = (1 << _TICK_BITS) - 1
_TIME_SHIFT = _TICK_BITS + _CLS_BITS

_PER_OCTAVE = 2
_OCTAVES = 40
_NBUCKETS = _PER_OCTAVE * _OCTAVES


def _bucket_bounds() -> list[int]:
    low = [0]
    for b in range(1, _NBUCKETS + 1):
        low.append(max(low[-1] + 1, int(2 ** (b / _PER_OCTAVE))))
    return low


_LOW = _bucket_bounds()  # _LOW[b] <= age < _LOW[b + 1] for ages in bucket b
_WIDTH = [_LOW[b + 1] - _LOW[b] for b in range(_NBUCKETS)]

_KEEP_CLOSED = 32  # closed-interval counts are halved past this many per remembered key
_WARMUP_TURNOVER = 0.5  # densities are trusted once this many evictions per cached key happened


def _bucket(age: int) -> int:
    return min(bisect.bisect_right(_LOW, age) - 1, _NBUCKETS - 1)


class _ReuseStats:
    """Reuse-age statistics of one class and the hit density derived from them."""

    __slots__ = ("censored", "density", "open", "reused")

    def __init__(self) -> None:
        self.reused = [0.0] * _NBUCKETS  # intervals ended by a reuse, by age bucket
        self.censored = [0.0] * _NBUCKETS  # intervals forgotten (history full), by age bucket
        self.open: dict[int, int] = {}  # epoch of the interval's start -> intervals still open
        self.density: list[float] | None = None

    def start(self, epoch: int) -> None:
        self.open[epoch] = self.open.get(epoch, 0) + 1

    def end(self, epoch: int) -> None:
        left = self.open[epoch] - 1
        if left:
            self.open[epoch] = left
        else:
            del self.open[epoch]

    def refresh(self, clock: int, shift: int, keep: float) -> None:
        opened = [0] * _NBUCKETS
        half = (1 << shift) >> 1
        for epoch, count in self.open.items():
            opened[_bucket(max(0, clock - ((epoch << shift) + half)))] += count
        closed = sum(self.reused) + sum(self.censored)
        self.density = reuse_density(self.reused, self.censored, opened, _WIDTH, closed=closed, keep=keep)[0]


class HitDensityPolicy(Generic[K]):
    """Prefix-aware eviction by learnt hit density of FRESH vs REUSED chunks, partial tails first.

    See the module docstring.

    ``history``: how many evicted keys to remember, as a multiple of the cached keys. Longer histories
    recognise returning chunks from further back but dilute the REUSED class; 4 measured best.
    """

    name: ClassVar[str] = "hit-density"

    def __init__(self, history: float = 4.0) -> None:
        if history < 0:
            raise ValueError("history must be >= 0")
        self._history = history
        # key -> state: (insert clock at last access, accesses since that insert, class) packed in one
        # int, so ordering states orders accesses and ``state >> _TIME_SHIFT`` is the clock
        self._state: dict[K, int] = {}
        self._ghosts: OrderedDict[K, int] = OrderedDict()  # evicted key -> its state, oldest first
        self._tree: PrefixTree[K] = PrefixTree()
        # per class, leaves by state: oldest first ((state, key)) and youngest first ((-state, key))
        self._oldest = tuple(LazyHeap[K](self._is_live) for _ in range(_CLASSES))
        self._youngest = tuple(LazyHeap[K](self._is_live_negated) for _ in range(_CLASSES))
        self._heaps = self._oldest + self._youngest
        self._stats = tuple(_ReuseStats() for _ in range(_CLASSES))
        self._largest = 0  # largest chunk size seen: smaller first-seen chunks are TAIL
        self._evicted = 0  # removals so far (warm-up: densities are trusted after _WARMUP_TURNOVER)
        self._clock = 0
        self._tick = 0  # accesses since the clock last moved
        self._shift = 0  # open intervals are counted per epoch of 2**shift inserts
        self._since_refresh = 0

    # -- events -------------------------------------------------------------------------------------

    def insert(self, key: K, size: int, now: float) -> None:
        if key in self._state:
            self.touch(key, now)
            return
        self._clock += 1
        self._tick = 0
        remembered = self._ghosts.pop(key, None)
        if size > self._largest:
            self._largest = size
        if remembered is None:
            cls = TAIL if size < self._largest else FRESH
        else:
            self._close(remembered, reused=True)
            cls = REUSED
        self._open(key, cls)
        self._since_refresh += 1
        if self._since_refresh >= max(256, len(self._state) >> 2):
            self._refresh()

    def touch(self, key: K, now: float) -> None:
        state = self._state.get(key)
        if state is not None:
            self._close(state, reused=True)
            self._open(key, REUSED)

    def remove(self, key: K) -> None:
        state = self._state.pop(key, None)
        if state is None:
            return
        self._evicted += 1
        ghosts = self._ghosts
        ghosts[key] = state  # the interval stays open: a later insert is a reuse
        limit = max(64, int(self._history * len(self._state)))
        while len(ghosts) > limit:
            _, old = ghosts.popitem(last=False)
            self._close(old, reused=False)
        freed = self._tree.unlink(key)
        if freed is not None:
            self._push_if_leaf(freed)

    def link(self, child: K, parent: K) -> None:
        if child not in self._state:
            return
        freed = self._tree.link(child, parent)
        if freed is not None:
            self._push_if_leaf(freed)

    def link_chain(self, keys: Sequence[K]) -> None:
        for child, parent in self._tree.new_links(keys):
            self.link(child, parent)

    def victim(self) -> K | None:
        tail = self._oldest[TAIL].top()
        if tail is not None:
            return tail[1]
        fresh = self._oldest[FRESH].top()
        reused = self._oldest[REUSED].top()
        if fresh is None or reused is None:
            if fresh is not None:
                return fresh[1]
            if reused is not None:
                return reused[1]
            return next(iter(self._state), None)  # links form a cycle: nothing is a leaf
        d_fresh, d_reused = self._stats[FRESH].density, self._stats[REUSED].density
        if d_fresh is None or d_reused is None or self._evicted < _WARMUP_TURNOVER * len(self._state):
            return fresh[1] if fresh[0] < reused[0] else reused[1]
        best_density, best_state, best_key = math.inf, 0, fresh[1]
        for cls, density in ((FRESH, d_fresh), (REUSED, d_reused)):
            young = self._youngest[cls].top()
            ends = (self._oldest[cls].top(), None if young is None else (-young[0], young[1]))
            for end in ends:
                if end is None:
                    continue
                state, key = end
                x = density[_bucket(self._clock - (state >> _TIME_SHIFT))]
                if x < best_density or (x == best_density and state < best_state):
                    best_density, best_state, best_key = x, state, key
        return best_key

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    # -- internals ----------------------------------------------------------------------------------

    def _is_live(self, rank: int, key: K) -> bool:
        return self._state.get(key) == rank and self._tree.is_leaf(key)

    def _is_live_negated(self, rank: int, key: K) -> bool:
        return self._state.get(key) == -rank and self._tree.is_leaf(key)

    def _open(self, key: K, cls: int) -> None:
        self._tick = min(self._tick + 1, _TICK_MAX)
        state = (self._clock << _TICK_BITS | self._tick) << _CLS_BITS | cls
        self._state[key] = state
        self._stats[cls].start(self._clock >> self._shift)
        if self._tree.is_leaf(key):
            self._push(state, key)

    def _close(self, state: int, *, reused: bool) -> None:
        start, cls = state >> _TIME_SHIFT, state & _CLS_MASK
        stats = self._stats[cls]
        stats.end(start >> self._shift)
        (stats.reused if reused else stats.censored)[_bucket(self._clock - start)] += 1

    def _push_if_leaf(self, key: K) -> None:
        state = self._state.get(key)
        if state is not None and self._tree.is_leaf(key):
            self._push(state, key)

    def _push(self, state: int, key: K) -> None:
        cls = state & _CLS_MASK
        oldest, youngest = self._oldest[cls], self._youngest[cls]
        oldest.push(state, key)
        if cls != TAIL:  # TAIL leaves are only ever taken oldest first
            youngest.push(-state, key)
        live = len(self._state)
        if oldest.needs_compaction(live) or youngest.needs_compaction(live):
            self._compact(cls)

    def _refresh(self) -> None:
        self._since_refresh = 0
        remembered = len(self._state) + len(self._ghosts)
        shift = max(self._shift, (remembered // 64).bit_length() - 1)
        if shift != self._shift:  # coarser epochs: recount the open intervals (rare, O(remembered))
            self._shift = shift
            for stats in self._stats:
                stats.open.clear()
            for state in (*self._state.values(), *self._ghosts.values()):
                self._stats[state & _CLS_MASK].start((state >> _TIME_SHIFT) >> shift)
        for stats in self._stats:
            stats.refresh(self._clock, self._shift, _KEEP_CLOSED * max(remembered, 64))

    def _compact(self, cls: int) -> None:
        tree = self._tree
        leaves = [(s, k) for k, s in self._state.items() if s & _CLS_MASK == cls and tree.is_leaf(k)]
        self._oldest[cls].rebuild(leaves)
        self._youngest[cls].rebuild([] if cls == TAIL else [(-s, k) for s, k in leaves])
