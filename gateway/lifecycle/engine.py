"""The lifecycle engine: decides where every chunk lives and when it goes.

One gateway process at a time runs eviction and TTL reclaim for the whole tier: the holder of the
``lifecycle`` lease (``gateway.cluster.leader``). Every process replicates its own write-through queue
(it lives in its index) and hands what its index observed to the policies (the leader's learn; the
others discard). The engine holds nothing per chunk: usage comes from a ``UsageSource`` (the
cluster-wide ledger, or the index's counters), victims from sampled policies over the index
(``gateway.lifecycle.policy`` through ``IndexSource``), expired chunks from the index's expiry order.
It moves chunks only through the tier mover (``gateway.mover``: demote, replicate, drop, expire), so
every move obeys the mover's crash-ordering rules:

- demotion: copy to S3, verify size and checksum, switch the index, then delete the local copy;
- write-through: copy to S3, then record the copy and clear the queue entry in one index transaction;
- eviction without S3, TTL reclaim: delete the bytes, then the index entry.

Work is periodic and bounded: each pass (``run_pass``) expires, replicates and evicts at most
``budget`` chunks, with the clock passed in. Fencing: before each destructive batch (expiry, eviction)
the engine checks that its leadership has at least ``fence_margin`` seconds left, so a leader that lost
its lease (paused, cut off from the catalog) stops before another can have taken over. A leader pass
that finds a tier past its watermark re-reads the shared usage first (one query): the cached view lags
the catalog by up to its refresh interval, which would count the leader's own published evictions
twice. When S3 is
unreachable (the mover raises ``TierUnavailable``) the engine waits: it never deletes a chunk it was
asked to demote, and write-through entries stay queued (on disk) until S3 is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from backends import errors as backend
from backends.catalog.store import BucketPolicy
from backends.index import ChunkIndex, Ghost, IndexEntry
from backends.tiers import TierId
from gateway.access import Directory
from gateway.leases import LeaseBook, LeaseUnavailable
from gateway.lifecycle.index_source import IndexSource
from gateway.lifecycle.ledgers import Ledgers, UsageSource
from gateway.lifecycle.policy import Candidate, SampledPolicy
from gateway.lifecycle.state import PolicyStates
from gateway.mover import TierMover

log = logging.getLogger("kvgw.lifecycle")


@dataclass
class PassReport:
    expired: int = 0
    replicated: int = 0
    demoted: int = 0
    evicted: int = 0
    leased: int = 0  # removals left undone because a read lease held the chunk (gateway.leases)
    waiting_for_s3: bool = False
    leading: bool = True  # this process ran eviction and TTL reclaim in this pass
    errors: list[str] = field(default_factory=list)


class Leader(Protocol):
    """Who may run the destructive half of the lifecycle (``gateway.cluster.leader.Leadership``)."""

    def valid_for(self) -> float: ...

    def is_leader(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...


class _Always:
    def valid_for(self) -> float:
        return float("inf")

    def is_leader(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {"leader": True}


_Victim = tuple[Candidate[bytes], bytes | None, IndexEntry]
_COUNTS = ("expired", "replicated", "demoted", "evicted", "leased")  # candidate, its parent, its entry


class LifecycleEngine:
    def __init__(self, index: ChunkIndex, directory: Directory, mover: TierMover, ledgers: Ledgers, *,
                 usage: UsageSource | None = None, leader: Leader | None = None, leases: LeaseBook | None = None,
                 clock: Callable[[], float] = time.time, interval: float = 1.0, budget: int = 256,
                 replication_concurrency: int = 4, fence_margin: float = 1.0, ghost_history: float = 2.0,
                 rng: random.Random | None = None, states: PolicyStates | None = None,
                 save_seconds: float = 10.0) -> None:
        """``usage``: what capacity is enforced against (default: the ledgers, i.e. this index);
        ``leader``: the lease (default: always leading); ``ghost_history``: evictions the index remembers,
        as a multiple of the chunks it holds (``default`` learns from chunks that come back); ``leases``:
        read leases to respect (every removal is claimed there first, and leased chunks are left);
        ``states``: where the policies' learnt state is kept (``gateway.lifecycle.state``): loaded before
        the first eviction of each leadership, saved every ``save_seconds`` while leading and at ``stop``."""
        self._index = index
        self._directory = directory
        self._mover = mover
        self._ledgers = ledgers
        self._usage: UsageSource = usage if usage is not None else ledgers
        self.leader: Leader = leader if leader is not None else _Always()
        self._leases = leases
        self._clock = clock
        self.interval = interval
        self.budget = budget
        self.replication_concurrency = replication_concurrency
        self.fence_margin = fence_margin
        self.ghost_history = ghost_history
        self._rng = rng if rng is not None else random.Random()
        self._task: asyncio.Task[None] | None = None
        self._s3_retry_at = 0.0
        self._s3_backoff = 1.0
        self._logged_outage = False
        self.totals = PassReport()  # of the passes done
        self._passing: PassReport | None = None  # the pass running now
        self._waiting: dict[tuple[str, TierId], str] = {}  # (bucket, tier) over its watermark: why it stays
        self._draining: set[tuple[str, TierId]] = set()  # passed the high watermark, not yet down to the low
        self._states = states
        self.save_seconds = save_seconds
        self._restored = False  # this leadership has loaded the learnt state
        self._saved_at: float | None = None  # when this leadership last saved it (its clock)
        self._state_error = ""  # the last failure to load or save it (logged once per kind)
        self._lease_trouble = ""  # why the last claim came to nothing

    @property
    def waiting(self) -> dict[str, str]:
        """Buckets whose usage stays over the high watermark, and why (for the admin stats)."""
        out: dict[str, str] = {}
        for (bucket, _), reason in sorted(self._waiting.items()):
            out[bucket] = f"{out[bucket]}; {reason}" if bucket in out else reason
        return out

    # -- the periodic pass ---------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kvgw-lifecycle")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._restored and self.leader.is_leader():  # what this leadership learnt since its last save
            await self.save_state()

    def state_status(self) -> dict[str, Any]:
        """Whether this leadership loaded the learnt state, when it last saved it (unix seconds), the
        last failure to do either."""
        return {"loaded": self._restored, "saved_at": self._saved_at, "error": self._state_error}

    async def load_state(self) -> bool:
        """Give the policies what the last leader saved (once per leadership); False if the catalog could
        not be read (the next pass tries again; the policies meanwhile go on with what they have)."""
        if self._states is None or self._restored:
            return True
        try:
            saved = await self._states.load()
        except Exception as exc:
            self._state_failed("load", exc)
            return False
        self._ledgers.restore(saved)
        self._restored = True
        return True

    async def save_state(self, now: float | None = None) -> None:
        """Keep what the policies learnt in the catalog (best effort: a failure is logged once)."""
        if self._states is None:
            return
        try:
            await self._states.save(self._ledgers.export())
        except Exception as exc:
            self._state_failed("save", exc)
            return
        self._saved_at = self._clock() if now is None else now
        self._state_error = ""

    def _state_failed(self, what: str, exc: Exception) -> None:
        message = f"{what} {type(exc).__name__}: {exc}"
        if not self._state_error.startswith(what):
            log.warning("lifecycle: cannot %s the policies' learnt state in the catalog (%s); retrying",
                        what, message)
        self._state_error = message

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_pass()
            except Exception:
                log.exception("lifecycle pass failed")

    def _fenced(self) -> bool:
        """Whether this process may start a destructive batch: it leads, with time to finish it."""
        return self.leader.valid_for() >= self.fence_margin

    async def run_pass(self, now: float | None = None) -> PassReport:
        now = self._clock() if now is None else now
        report = self._passing = PassReport(leading=self._fenced())
        await self._index.flush()  # this process's reads into the index (and its observations)
        observed = self._index.observations
        seen = [observed.popleft() for _ in range(len(observed))]
        budget = self.budget
        if report.leading:
            await self.load_state()  # before this leadership learns or evicts anything
            await asyncio.to_thread(self._ledgers.learn, seen)
            if self._pressed():
                with contextlib.suppress(Exception):  # unreachable: go on with the view as it is
                    await self._usage.refresh()  # fresh, so this leader's own evictions are not counted twice
            budget -= await self._expire(now, budget, report)
        budget -= await self._replicate(now, budget, report)
        if report.leading:
            for policy in self._directory.buckets():
                if budget <= 0:
                    break
                budget -= await self._enforce(policy, TierId.FS, policy.capacity_bytes, budget, now, report)
                budget -= await self._enforce(policy, TierId.S3, policy.s3_capacity_bytes, budget, now, report)
            if self._states is not None and (self._saved_at is None or now - self._saved_at >= self.save_seconds):
                await self.save_state(now)
        else:
            self._waiting.clear()
            self._draining.clear()
            self._restored = False  # a later leadership loads what the leader in between learnt
            self._saved_at = None
        self._add(self.totals, report)
        self._passing = None
        return report

    @staticmethod
    def _add(into: PassReport, report: PassReport) -> None:
        for name in _COUNTS:
            setattr(into, name, getattr(into, name) + getattr(report, name))

    def counted(self) -> PassReport:
        """What the passes did so far, the one running now included (a pass may wait on claims for a
        while after its first removals: the admin stats show them at once)."""
        out = replace(self.totals)
        if self._passing is not None:
            self._add(out, self._passing)
        return out

    def _pressed(self) -> bool:
        """Whether the usage as last read puts some (bucket, tier) past its high watermark (or still on the
        way down to the low one): only then is the shared usage worth re-reading before deciding."""
        for bucket in self._directory.buckets():
            for tier, capacity in ((TierId.FS, bucket.capacity_bytes), (TierId.S3, bucket.s3_capacity_bytes)):
                if capacity is not None and ((bucket.name, tier) in self._draining or
                                             self._usage.usage(bucket.name, tier) > capacity * bucket.high_watermark):
                    return True
        return False

    async def _expire(self, now: float, budget: int, report: PassReport) -> int:
        """Reclaim the bytes of expired chunks (of any gateway), soonest first, from the index's
        expiry order; a chunk whose reclaim must wait (S3 unreachable) stays first in line."""
        done = 0
        leased: set[bytes] = set()  # expired but read-leased: left, and looked past in the expiry order
        while done < budget:
            due = [(expires, digest) for expires, digest in self._index.due(now, len(leased) + min(16, budget - done))
                   if digest not in leased]
            if not due or not self._fenced():
                break
            done += len(due)
            todo = [(digest, entry) for expires, digest in due
                    if (entry := self._index.get(digest)) is not None and entry.expires == expires]
            claimed = await self._claim(todo, report)
            if claimed is None:
                return done
            for digest, entry in todo:
                if digest not in claimed:
                    leased.add(digest)  # its bytes stay until the lease ends or the load happens
                    continue
                try:
                    await self._mover.expire(digest, entry)
                    report.expired += 1
                    await self._settle(removed=[digest])
                except backend.TierUnavailable:
                    report.waiting_for_s3 = True  # absent already; reclaim bytes later
                    await self._settle(kept=[d for d, _ in todo if d in claimed])
                    return done
                except Exception as exc:
                    report.errors.append(f"expire {digest.hex()}: {exc}")
                    await self._settle(kept=[d for d, _ in todo if d in claimed])
                    return done
        return done

    async def _claim(self, victims: list[tuple[bytes, IndexEntry]], report: PassReport) -> set[bytes] | None:
        """The victims the lease table lets this pass remove (the others are read-leased); all of them
        without a lease table; None when the lease table cannot be read (remove nothing now)."""
        digests = [digest for digest, _ in victims]
        if self._leases is None:
            return set(digests)
        by_bucket: dict[str, list[bytes]] = {}
        for digest, entry in victims:
            by_bucket.setdefault(entry.bucket, []).append(digest)
        claimed: set[bytes] = set()
        try:
            for bucket, members in by_bucket.items():
                claimed |= await self._leases.claim(bucket, members)
        except LeaseUnavailable as exc:
            report.errors.append(f"lease table unreachable, nothing removed: {exc}")
            self._lease_trouble = str(exc)
            await self._settle(kept=list(claimed))
            return None
        if not self._fenced():  # a claim waits for the granting processes: the term may have run short
            self._lease_trouble = "the leadership term ran short while the claim was acknowledged"
            await self._settle(kept=list(claimed))
            return None
        report.leased += len(digests) - len(claimed)
        return claimed

    async def _settle(self, *, removed: list[bytes] | None = None, kept: list[bytes] | None = None) -> None:
        if self._leases is not None:
            await self._leases.settle(removed=removed or (), kept=kept or ())

    def _s3_ready(self, now: float) -> bool:
        return self._mover.has_s3 and now >= self._s3_retry_at

    def _s3_failed(self, now: float, report: PassReport, what: str) -> None:
        report.waiting_for_s3 = True
        self._s3_retry_at = now + self._s3_backoff
        self._s3_backoff = min(self._s3_backoff * 2, 30.0)
        if not self._logged_outage:
            log.warning("lifecycle: S3 unavailable during %s; waiting (nothing is deleted meanwhile)", what)
            self._logged_outage = True

    def _s3_ok(self) -> None:
        self._s3_backoff = 1.0
        if self._logged_outage:
            log.info("lifecycle: S3 reachable again")
            self._logged_outage = False

    async def _replicate(self, now: float, budget: int, report: PassReport) -> int:
        if not self._s3_ready(now) or budget <= 0:
            return 0
        pending = self._index.pending(limit=budget)
        if not pending:
            return 0
        limit = asyncio.Semaphore(self.replication_concurrency)
        outage = False

        async def one(digest: bytes) -> None:
            nonlocal outage
            async with limit:
                if outage:
                    return
                try:
                    if await self._mover.replicate(digest):
                        report.replicated += 1
                except backend.TierUnavailable:
                    outage = True
                except Exception as exc:  # keep it queued; count the attempt
                    report.errors.append(f"write-through {digest.hex()}: {exc}")
                    await self._index.retry_pending(digest)

        await asyncio.gather(*(one(digest) for digest, _, _ in pending))
        if outage:
            self._s3_failed(now, report, "write-through")
        else:
            self._s3_ok()
        return len(pending)

    async def _enforce(self, bucket: BucketPolicy, tier: TierId, capacity: int | None, budget: int, now: float,
                       report: PassReport) -> int:
        """Evict from (bucket, tier) in policy order once usage passes the high watermark, down to the low.

        Victims come from the bucket's sampled policy in small batches, moved concurrently (demotion to
        S3 is network-bound); a victim whose move fails is simply not evicted (a later sample finds it
        again). A chunk whose last copy went is remembered in the index as a ghost.
        """
        key = (bucket.name, tier)
        usage = self._usage.usage(bucket.name, tier) if capacity is not None else 0
        target = 0.0 if capacity is None else capacity * bucket.low_watermark
        # past the high watermark, evict down to the low one, over as many passes as the budget needs
        if capacity is None or usage <= target or (usage <= capacity * bucket.high_watermark
                                                   and key not in self._draining):
            self._waiting.pop(key, None)
            self._draining.discard(key)
            return 0
        self._draining.add(key)
        excess = usage - target
        policy = self._ledgers.policy(bucket.name, tier)
        source = IndexSource(self._index, bucket.name, tier, now, rng=self._rng)
        demoting = tier == TierId.FS and self._mover.has_s3
        width = self.replication_concurrency if demoting else 16
        done = 0
        leased: set[bytes] = set()  # victims a read lease holds: not picked again this pass
        while excess > 0 and done < budget:
            if not self._fenced():
                break
            if demoting and not self._s3_ready(self._clock()):
                report.waiting_for_s3 = True
                self._wait_for_s3(bucket.name, tier, usage, capacity, demoting)
                break
            batch = await asyncio.to_thread(self._pick, policy, source, min(width, budget - done), excess, leased)
            if not batch:
                self._waiting[key] = (f"{tier.label} tier at {usage} of {capacity} bytes, over its high watermark, "
                                      "but this gateway's index holds no chunk of it it may evict "
                                      "(none, or only pinned ones)"
                                      + (f" ({len(leased)} read-leased chunks left alone)" if leased else ""))
                break
            done += len(batch)
            claimed = await self._claim([(c.key, e) for c, _, e in batch], report)
            if claimed is None:
                self._waiting[key] = f"removals wait for the read-lease table: {self._lease_trouble}"
                break
            leased.update(c.key for c, _, _ in batch if c.key not in claimed)
            batch = [victim for victim in batch if victim[0].key in claimed]
            outcomes = await asyncio.gather(*(self._evict_one(c.key, e, tier, demoting) for c, _, e in batch),
                                            return_exceptions=True)
            outage = False
            settle_removed: list[bytes] = []
            gone: list[tuple[Candidate[bytes], bytes | None, bool]] = []
            ghosts: list[tuple[bytes, Ghost]] = []
            for (victim, parent, entry), outcome in zip(batch, outcomes, strict=True):
                if outcome is None:
                    excess -= entry.size
                    usage -= entry.size
                    if demoting:
                        report.demoted += 1
                    else:
                        report.evicted += 1
                    last_copy = not demoting and not entry.tiers & ~tier
                    if last_copy:
                        settle_removed.append(victim.key)
                    if last_copy and self.ghost_history > 0:
                        ghosts.append((victim.key, Ghost(bucket.name, int(tier), entry.size, victim.last_access,
                                                         victim.hits + victim.returned, victim.marks)))
                    gone.append((victim, parent, last_copy and self.ghost_history > 0))
                    continue
                if isinstance(outcome, backend.TierUnavailable):
                    outage = True
                else:
                    report.errors.append(f"evict {victim.key.hex()}: {outcome}")
                policy.forget(victim.key)
            await self._settle(removed=settle_removed,
                               kept=[c.key for c, _, _ in batch if c.key not in settle_removed])
            if ghosts:
                await self._index.remember(ghosts, self.ghost_history)
            if gone:
                await asyncio.to_thread(self._evicted, policy, source, gone, now)
            if outage:
                self._s3_failed(self._clock(), report, "demotion")
                self._wait_for_s3(bucket.name, tier, usage, capacity, demoting)
                break
            self._waiting.pop(key, None)
            if demoting:
                self._s3_ok()
        return done

    def _pick(self, policy: SampledPolicy[bytes], source: IndexSource, count: int, excess: float,
              exclude: set[bytes]) -> list[_Victim]:
        """Up to ``count`` victims covering at most ``excess`` bytes, none of ``exclude`` (worker
        thread: index reads)."""
        batch: list[_Victim] = []
        taken: set[bytes] = set(exclude)
        while len(batch) < count and excess > 0:
            victim = policy.victim(source, source.now, taken)
            if victim is None:
                break
            taken.add(victim.key)
            entry = self._index.get(victim.key)
            if entry is None or not entry.tiers & source.tier:
                continue
            parent = self._index.parent_of(victim.key)
            policy.picked(victim, parent, source, taken)
            batch.append((victim, parent, entry))
            excess -= entry.size
        return batch

    @staticmethod
    def _evicted(policy: SampledPolicy[bytes], source: IndexSource,
                 gone: list[tuple[Candidate[bytes], bytes | None, bool]], now: float) -> None:
        for victim, parent, remembered in gone:
            policy.evicted(victim, parent, source, now, remembered=remembered)

    def _wait_for_s3(self, bucket: str, tier: TierId, usage: int, capacity: int, demoting: bool) -> None:
        """Say why (bucket, tier) stays over its watermark: its eviction needs S3, which is unreachable (the
        mover never drops a copy whose other copy it cannot confirm)."""
        self._waiting[(bucket, tier)] = (
            f"S3 unreachable: {tier.label} tier at {usage} of {capacity} bytes, over its high watermark; "
            f"{'demotion to S3' if demoting else 'eviction'} waits (nothing is deleted meanwhile)")

    async def _evict_one(self, digest: bytes, entry: IndexEntry, tier: TierId, demoting: bool) -> None:
        if demoting:
            await self._mover.demote(digest, entry)
        else:
            await self._mover.drop(digest, entry, tier)
