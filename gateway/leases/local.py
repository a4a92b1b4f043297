"""The read leases one gateway process grants, held in its memory: granted at once, written later.

A lookup's lease is granted here, inline, without waiting for anything (``LocalLeases.grant``: one dict
update from C in the common case), and recorded three ways: in ``_leased`` (what this process holds: a
load through it ends the lease, TTL reclaim serves it), in a capped bucket's ``_used`` bytes (its share
of the leased-bytes cap), and in ``_pending`` (one entry per grant call), which the lease syncer
(``gateway.leases.book``) takes, merges in its own thread and writes to the catalog's ``chunk_leases``
table in the background (``gateway.leases.table``). The heap ``_expiry`` forgets leases as they end.

What may be granted depends on what this process learnt at its last sync, which this module keeps:

- **claims** (``_claimed``): the chunks the lifecycle leader is removing (``REMOVING``: answered absent)
  or removed a moment ago (``REMOVED``: the caller re-checks the tiers before answering present), read
  from ``lease_log`` in order, up to ``_known``. Each sync reports the ``_known`` it had when it was
  taken (``Batch.seen``): every grant made before this process knew of a claim numbered ``<= seen`` is
  in that batch or an earlier one. The seam is one lock: ``grant`` checks the claims and appends to
  ``_pending`` under it, ``take`` reads ``_known`` and swaps ``_pending`` under it, and ``apply``
  updates the claims and ``_known`` under it.
- **freshness**: no grant unless the last successful sync was *sent* less than ``fresh_seconds`` ago
  (the catalog then dates it ``synced_at`` no earlier); every grant this process has not yet written
  therefore began before ``synced_at + fresh_seconds`` and lasts at most ``horizon_ms``, the horizon that
  sync announced (10 s, a bucket's default ``max_lease_ms``; a longer lease waits for a sync announcing
  it, and the horizon comes back down ``HORIZON_KEEP_SECONDS`` after the last such request). The
  catalog records the sum as ``quiet_at``, after which the leader may ignore this process if it falls
  silent (killed, cut off): all its unwritten leases have ended by then.
- **quotas** (``_quotas``): in a bucket with a leased-bytes cap, the bytes this process may hold leased,
  its share of the cap granted by a sync (``LeaseTable._rebalance_in``; the shares of live processes never
  add up past the cap).

``grant`` answers a ``LeaseGrant``, or a ``Wait`` when it can only answer after a sync (none yet, a
lease longer than the announced horizon, no or too small a quota, a chunk removed lately to re-check):
the async ``LeaseBook.grant`` does that; the lookup lane hands such a lookup to the ASGI path.

Threads: ``grant``, ``loaded``, ``leased_here`` on the event loop; ``take``, ``requeue`` and ``apply`` in
the syncer's thread. Clocks: ``clock`` (unix seconds, injectable) dates leases as the catalog stores
them; ``monotonic`` measures freshness and quota age.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat
from typing import Any

READ, REMOVING, REMOVED, RELEASED = 0, 1, 2, 3  # chunk_leases.kind / lease_log.state
FRESH_SECONDS = 2.0  # no grant unless the last successful sync was sent less than this long ago
DEFAULT_HORIZON_MS = 10_000  # the longest lease granted without a sync first (a bucket's default max)
HORIZON_KEEP_SECONDS = 60.0  # a horizon raised for a long lease is announced this long after the last one
QUOTA_SECONDS = 1.0  # how often a process's shares of the caps are rebalanced while it holds any
QUOTA_RETRY_SECONDS = 0.1  # a lookup past a share the last rebalance could not grow is refused at once

REFUSED_UNREACHABLE = "the lease table is unreachable; answered without a lease"
REFUSED_OFF = "leases are off for this bucket (max_lease_ms = 0)"
_EMPTY: frozenset[bytes] = frozenset()
_NEVER = (0.0, 0)


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The answer to a lease request, for the caller to apply to its lookup's answer.

    ``gone``: found by the lookup but being removed now: answer them as absent. ``recheck``: removed a
    moment ago and leased now: answer them as present only if a tier still holds them. ``refused``: why
    no lease was taken (the lookup answers without one); None when ``granted_ms`` > 0 or none was asked.
    """

    granted_ms: int = 0
    leased: int = 0
    leased_bytes: int = 0
    gone: frozenset[bytes] = _EMPTY
    recheck: frozenset[bytes] = _EMPTY
    refused: str | None = None

    def doc(self) -> dict[str, Any]:
        """The ``lease`` member of a lookup's JSON answer."""
        out: dict[str, Any] = {"granted_ms": self.granted_ms, "chunks": self.leased, "bytes": self.leased_bytes}
        if self.refused is not None:
            out["refused"] = self.refused
        return out


@dataclass(frozen=True, slots=True)
class Wait:
    """Why a grant must wait for a sync, and what that sync must ask for: ``demand`` bytes more of
    ``bucket``'s cap (``cap``), or a horizon of ``horizon_ms``."""

    reason: str
    bucket: str = ""
    demand: int = 0
    cap: int | None = None
    horizon_ms: int = 0


@dataclass(slots=True)
class Quota:
    """This process's share of a bucket's cap, as the last rebalance left it."""

    bytes: int
    full: bool  # the rebalance granted less than it asked: the cap is contended
    at: float  # monotonic time of that rebalance


@dataclass(frozen=True, slots=True)
class QuotaAsk:
    cap: int
    used: int
    demand: int


# one entry per grant call: bucket, digests, sizes, until, the digests left out (being removed)
_Pending = list[tuple[str, tuple[bytes, ...], Sequence[int], float, frozenset[bytes]]]


@dataclass(slots=True)
class Batch:
    """What one sync writes and reports (``LocalLeases.take``).

    The grants are columns, one row per digest with its latest end: ``digests`` (16 bytes each,
    concatenated), ``sizes``, ``untils`` and ``bucket_of`` (1-based into ``buckets``), taken from the
    pending dicts from C (a lease extended a thousand times between syncs is one row), so neither taking
    nor writing a batch runs Python per digest (``gateway.leases.table``). Grants of digests in
    ``releases`` or that ended by ``now`` are not written."""

    seen: int  # lease_log position known when taken (-1: none yet: the sync reads the whole view)
    digests: bytes
    sizes: list[int]
    untils: list[float]
    bucket_of: list[int]
    buckets: list[str]
    releases: list[bytes]  # leases ended by a load through this process (and not granted again since)
    cancelled: set[bytes]  # of those, leases granted in this batch: they end before they are written
    horizon_ms: int  # announced: quiet_at = synced_at + fresh_seconds + horizon
    quotas: dict[str, QuotaAsk]  # shares to rebalance
    sent: float  # monotonic time taken, before it is sent
    now: float  # the clock when taken: grants that ended by then are not written
    raw_pending: _Pending = field(default_factory=list)
    raw_releases: list[bytes] = field(default_factory=list)
    raw_demand: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def grants(self) -> dict[bytes, tuple[str, int, float]]:
        """The grants merged: digest -> (bucket, bytes, until), the latest end winning, releases left out."""
        merged: dict[bytes, tuple[str, int, float]] = {}
        for i, size in enumerate(self.sizes):
            digest = self.digests[16 * i : 16 * i + 16]
            old = merged.get(digest)
            if self.untils[i] > self.now and (old is None or old[2] < self.untils[i]):
                merged[digest] = (self.buckets[self.bucket_of[i] - 1], size, self.untils[i])
        for digest in self.releases:
            merged.pop(digest, None)
        return merged


@dataclass(slots=True)
class SyncResult:
    """What one sync read back (``gateway.leases.table``)."""

    head: int  # the lease_log position read: every entry up to it is in ``log`` or ``view``
    log: list[tuple[int, bytes, int, float]]  # (seq, digest, state, expires_at) after ``Batch.seen``
    view: list[tuple[bytes, int, float]] | None  # the whole claims view instead (first sync, after a gap)
    released: set[bytes]  # rows the releases deleted
    quotas: dict[str, int | None]  # bucket -> share granted (None: given back)


class LocalLeases:
    """The leases this process granted, and what it knows of the cluster's (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 fresh_seconds: float = FRESH_SECONDS, horizon_ms: int = DEFAULT_HORIZON_MS) -> None:
        self.clock = clock
        self.monotonic = monotonic
        self.fresh_seconds = fresh_seconds
        self._lock = threading.Lock()
        self._leased: dict[bytes, float] = {}  # digest -> until
        self._latest = 0.0  # the latest end of a lease granted here
        # heap: (until, ticket, bucket, digests, sizes, counted in the bucket's share)
        self._expiry: list[tuple[float, int, str, tuple[bytes, ...], Sequence[int], bool]] = []
        self._ticket = itertools.count()
        self._used: dict[str, int] = {}  # capped bucket -> bytes of the chunks leased here (its share's use)
        self._pending: _Pending = []  # grants not written yet, one entry per grant call
        self._releases: list[bytes] = []
        self._claimed: dict[bytes, tuple[int, float]] = {}  # digest -> (REMOVING | REMOVED, expires_at)
        self._claim_order: deque[tuple[float, bytes]] = deque()  # (expires_at, digest) as learnt
        self._known = -1  # the lease_log position applied; -1: never synced
        self._synced: float | None = None  # monotonic time the last successful sync was taken
        self.horizon_ms = horizon_ms  # announced by the last successful sync
        self._default_horizon_ms = horizon_ms
        self._horizon_wanted = horizon_ms
        self._long_at = 0.0  # monotonic time a lease longer than the default horizon was last asked for
        self._quotas: dict[str, Quota] = {}
        self._demand: dict[str, tuple[int, int]] = {}  # bucket -> (bytes wanted beyond the share, cap)
        self._caps: dict[str, int] = {}  # bucket -> its cap as the last grant saw it
        self._rebalanced: dict[str, float] = {}  # bucket -> monotonic time of its last rebalance

    # -- the hot path (event loop) ---------------------------------------------------------------

    def grant(self, bucket: str, digests: Sequence[bytes], sizes: Sequence[int], granted_ms: int,
              cap: int | None, *, recheck: bool) -> LeaseGrant | Wait:
        """Lease ``digests`` (of ``sizes`` bytes) for ``granted_ms`` (> 0), all or nothing against this
        process's share of ``cap``. ``recheck``: lease chunks removed lately too (the caller re-checks
        the tiers); without it such a lookup waits. Never blocks; the caller must not change the
        sequences afterwards."""
        synced = self._synced
        if synced is None:
            return Wait("no sync yet")
        if self.monotonic() - synced > self.fresh_seconds:
            return LeaseGrant(refused=REFUSED_UNREACHABLE)
        if granted_ms > self._default_horizon_ms:
            self._long_at = self.monotonic()
            if granted_ms > self.horizon_ms:
                return Wait("a lease past the announced horizon", horizon_ms=granted_ms)
        now = self.clock()
        until = now + granted_ms / 1000
        keys = tuple(digests)
        with self._lock:
            if self._expiry and self._expiry[0][0] <= now:
                self._expire(now)
            gone = rechecked = _EMPTY
            claimed = self._claimed
            if claimed and not claimed.keys().isdisjoint(keys):
                removing: set[bytes] = set()
                removed: set[bytes] = set()
                for digest in keys:
                    state = claimed.get(digest)
                    if state is not None and state[1] > now:
                        (removing if state[0] == REMOVING else removed).add(digest)
                if removed and not recheck:
                    return Wait("chunks removed a moment ago")
                gone, rechecked = frozenset(removing), frozenset(removed)
            leased = self._leased
            fast = not gone and until >= self._latest  # no lease held here ends later: overwrite from C
            new = 0
            if cap is not None:  # the bytes of chunks not leased here yet count against this process's share
                if fast:
                    missing = set(filterfalse(leased.__contains__, keys))
                    if len(missing) == len(keys):
                        new = sum(sizes)
                    elif missing:
                        new = sum(map(dict(zip(keys, sizes, strict=True)).__getitem__, missing))
                else:
                    new = sum(size for digest, size in zip(keys, sizes, strict=True)
                              if digest not in leased and digest not in gone)
                used = self._used.get(bucket, 0)
                quota = self._quotas.get(bucket)
                self._caps[bucket] = cap
                if new and (quota is None or used + new > quota.bytes):
                    if quota is not None and quota.full and self.monotonic() - quota.at < QUOTA_RETRY_SECONDS:
                        return LeaseGrant(refused=_over_cap(used, new, quota.bytes, cap))
                    return Wait("past this process's share of the cap", bucket=bucket, demand=new, cap=cap)
                if new:
                    self._used[bucket] = used + new
            if fast:
                leased.update(zip(keys, repeat(until)))
                count, total = len(keys), sum(sizes)
            else:
                count = total = 0
                for digest, size in zip(keys, sizes, strict=True):
                    if gone and digest in gone:
                        continue
                    if leased.get(digest, 0.0) < until:
                        leased[digest] = until
                    count += 1
                    total += size
            if until > self._latest:
                self._latest = until
            self._pending.append((bucket, keys, sizes, until, gone))
            heapq.heappush(self._expiry, (until, next(self._ticket), bucket, keys, sizes, cap is not None))
        return LeaseGrant(granted_ms=granted_ms, leased=count, leased_bytes=total, gone=gone, recheck=rechecked)

    def leased_here(self, digest: bytes, now: float) -> bool:
        """Whether this process leased ``digest`` past ``now`` and no load through it ended the lease."""
        until = self._leased.get(digest)
        return until is not None and until > now

    def loaded(self, bucket: str, chunks: Sequence[tuple[bytes, int]]) -> None:
        """Chunks (digest, size) of ``bucket`` were read through this process: the leases it granted on
        them end (written by the next sync). Costs a dict lookup per digest while leases are held."""
        if not self._leased:
            return
        with self._lock:
            capped = bucket in self._caps
            for digest, size in chunks:
                if self._leased.pop(digest, None) is not None:
                    self._releases.append(digest)
                    if capped:
                        self._used[bucket] = max(0, self._used.get(bucket, 0) - size)

    def want(self, wait: Wait) -> None:
        """Ask the next sync for what ``wait`` lacks."""
        with self._lock:
            if wait.horizon_ms > self._horizon_wanted:
                self._horizon_wanted = wait.horizon_ms
            if wait.bucket and wait.cap is not None:
                asked, _ = self._demand.get(wait.bucket, (0, 0))
                self._demand[wait.bucket] = (max(asked, wait.demand), wait.cap)

    def wait_refusal(self, wait: Wait) -> LeaseGrant:
        """The answer to a grant that still waits after a sync asked for what it lacked."""
        if wait.bucket and wait.cap is not None:
            quota = self._quotas.get(wait.bucket)
            return LeaseGrant(refused=_over_cap(self._used.get(wait.bucket, 0), wait.demand,
                                                0 if quota is None else quota.bytes, wait.cap))
        return LeaseGrant(refused=REFUSED_UNREACHABLE)

    def _expire(self, now: float) -> None:
        """Forget the leases that ended by ``now``: each grant's heap entry, when its end comes, drops
        the digests no later grant extended (and their bytes from the share they were counted in)."""
        heap, leased = self._expiry, self._leased
        while heap and heap[0][0] <= now:
            _, _, bucket, digests, sizes, capped = heapq.heappop(heap)
            freed = 0
            for digest, size in zip(digests, sizes, strict=True):
                until = leased.get(digest)
                if until is not None and until <= now:
                    del leased[digest]
                    freed += size
            if capped and freed:
                self._used[bucket] = max(0, self._used.get(bucket, 0) - freed)

    # -- the syncer's side (its thread) ----------------------------------------------------------

    def take(self) -> Batch:
        """What the next sync writes: the grants and releases since the last one, the shares to
        rebalance, and the lease_log position known now."""
        mono = self.monotonic()
        with self._lock:
            now = self.clock()
            self._expire(now)
            pending, self._pending = self._pending, []
            releases, self._releases = self._releases, []
            demand, self._demand = self._demand, {}
            seen = self._known
            if self._horizon_wanted > self._default_horizon_ms and mono - self._long_at > HORIZON_KEEP_SECONDS:
                self._horizon_wanted = self._default_horizon_ms  # no long lease asked for lately: back down
            horizon = self._horizon_wanted
            live = [digest for digest in releases if digest not in self._leased]  # not leased again since
            asks: dict[str, QuotaAsk] = {}
            for bucket, cap in self._caps.items():
                extra, cap = demand.get(bucket, (0, cap))
                if extra or (bucket in self._quotas and mono - self._rebalanced.get(bucket, 0.0) >= QUOTA_SECONDS):
                    asks[bucket] = QuotaAsk(cap, self._used.get(bucket, 0), extra)
            for bucket, (extra, cap) in demand.items():
                asks.setdefault(bucket, QuotaAsk(cap, self._used.get(bucket, 0), extra))
        merged: dict[str, dict[bytes, tuple[float, int]]] = {}  # bucket -> digest -> (latest end, bytes)
        latest: dict[str, float] = {}
        for bucket, digests, held, until, gone in pending:
            if until <= now:
                continue
            grants = merged.setdefault(bucket, {})
            if not gone and until >= latest.get(bucket, 0.0):  # the common case, from C
                grants.update(zip(digests, zip(repeat(until), held, strict=False), strict=True))
                latest[bucket] = until
                continue
            for digest, size in zip(digests, held, strict=True):
                if not (gone and digest in gone) and grants.get(digest, _NEVER)[0] < until:
                    grants[digest] = (until, size)
        parts: list[bytes] = []
        sizes: list[int] = []
        untils: list[float] = []
        bucket_of: list[int] = []
        for number, grants in enumerate(merged.values(), start=1):  # from C
            parts.append(b"".join(grants))
            ends, held_bytes = zip(*grants.values(), strict=True) if grants else ((), ())
            untils.extend(ends)
            sizes.extend(held_bytes)
            bucket_of.extend(repeat(number, len(grants)))
        blob = b"".join(parts)
        cancelled = {digest for digest in live if any(digest in grants for grants in merged.values())}
        return Batch(seen, blob, sizes, untils, bucket_of, list(merged), live, cancelled, horizon, asks, mono, now,
                     pending, releases, demand)

    def requeue(self, batch: Batch) -> None:
        """A sync failed: its grants, releases and demands go out with the next one."""
        with self._lock:
            self._pending[:0] = batch.raw_pending
            self._releases[:0] = batch.raw_releases
            for bucket, (extra, cap) in batch.raw_demand.items():
                asked, _ = self._demand.get(bucket, (0, cap))
                self._demand[bucket] = (max(asked, extra), cap)

    def apply(self, batch: Batch, result: SyncResult) -> bool:
        """A sync of ``batch`` succeeded: learn its claims, shares and horizon. Returns whether it
        learnt of new claims (the next sync, which acknowledges them, should go at once)."""
        mono = self.monotonic()
        with self._lock:
            claimed, order = self._claimed, self._claim_order
            learnt = result.view is not None
            if result.view is not None:
                claimed.clear()
                order.clear()
                for digest, kind, expires in sorted(result.view, key=lambda row: row[2]):
                    claimed[digest] = (kind, expires)
                    order.append((expires, digest))
            for _, digest, kind, expires in result.log:
                if kind == RELEASED:
                    claimed.pop(digest, None)
                else:
                    claimed[digest] = (kind, expires)
                    order.append((expires, digest))
                    learnt = learnt or kind == REMOVING
            self._known = max(self._known, result.head)
            self._synced = batch.sent
            self.horizon_ms = batch.horizon_ms
            for bucket, granted in result.quotas.items():
                self._rebalanced[bucket] = mono
                ask = batch.quotas[bucket]
                if granted is None:
                    self._quotas.pop(bucket, None)
                    self._caps.pop(bucket, None)
                else:
                    self._quotas[bucket] = Quota(granted, granted < ask.used + ask.demand, mono)
            now = self.clock()
            while order and order[0][0] <= now:
                _, digest = order.popleft()
                state = claimed.get(digest)
                if state is not None and state[1] <= now:
                    del claimed[digest]
        return learnt

    def known(self) -> int:
        return self._known

    def report(self) -> dict[str, Any]:
        """For the admin stats."""
        mono = self.monotonic()
        return {"leased_here": len(self._leased), "unwritten_grants": len(self._pending),
                "claims_known": len(self._claimed), "log_position": self._known, "horizon_ms": self.horizon_ms,
                "synced_s_ago": None if self._synced is None else round(mono - self._synced, 3),
                "quotas": {bucket: {"bytes": q.bytes, "used": self._used.get(bucket, 0), "full": q.full}
                           for bucket, q in self._quotas.items()}}


def _over_cap(used: int, new: int, share: int, cap: int) -> str:
    return (f"the bucket's leased bytes would pass its cap ({used} leased through this process, {new} asked, "
            f"its share {share} of the cap {cap}); answered without a lease")
