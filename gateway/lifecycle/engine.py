"""The lifecycle engine: decides where every chunk lives and when it goes.

It keeps, per (bucket, tier), a ledger: the bytes the tier holds for the bucket and an eviction policy
(``gateway.lifecycle.policy``) ordering them. The service reports every change (``ChunkEvents``); the
engine never looks at storage itself and moves chunks only through the service (copy, demote, drop,
expire), so every move obeys the service's crash-ordering rules:

- demotion: copy to S3, verify size and checksum, switch the index, then delete the local copy;
- write-through: copy to S3, then record the copy and clear the queue entry in one index transaction;
- eviction without S3, TTL reclaim: delete the bytes, then the index entry.

Work is periodic and bounded: each pass (``run_pass``) expires, replicates and evicts at most
``budget`` chunks, with the clock passed in. When S3 is unreachable the engine waits: it never deletes
a chunk it was asked to demote, and write-through entries stay queued (on disk) until S3 is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backends import errors as backend
from backends.catalog.store import BucketPolicy
from backends.index import TIER_FS, TIER_S3, IndexEntry
from gateway.lifecycle.policy import EvictionPolicy, make_policy

if TYPE_CHECKING:
    from gateway.service import ChunkService

log = logging.getLogger("kvgw.lifecycle")

TIER_NAMES = {TIER_FS: "fs", TIER_S3: "s3"}


class TierLedger:
    """What one tier holds for one bucket, as the engine has been told: sizes and eviction order."""

    def __init__(self, policy: EvictionPolicy[Hashable]) -> None:
        self.policy = policy
        self.sizes: dict[bytes, int] = {}
        self.usage = 0

    def add(self, digest: bytes, size: int, now: float) -> None:
        if digest in self.sizes:
            self.policy.touch(digest, now)
            return
        self.sizes[digest] = size
        self.usage += size
        self.policy.insert(digest, max(size, 1), now)

    def discard(self, digest: bytes) -> None:
        size = self.sizes.pop(digest, None)
        if size is not None:
            self.usage -= size
            self.policy.remove(digest)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.sizes


@dataclass
class PassReport:
    expired: int = 0
    replicated: int = 0
    demoted: int = 0
    evicted: int = 0
    waiting_for_s3: bool = False
    errors: list[str] = field(default_factory=list)


class LifecycleEngine:
    def __init__(self, service: ChunkService, *, interval: float = 1.0, budget: int = 256,
                 replication_concurrency: int = 4) -> None:
        self.service = service
        self.interval = interval
        self.budget = budget
        self.replication_concurrency = replication_concurrency
        self._ledgers: dict[tuple[str, int], TierLedger] = {}
        self._expiry: list[tuple[float, bytes]] = []
        self._task: asyncio.Task[None] | None = None
        self._s3_retry_at = 0.0
        self._s3_backoff = 1.0
        self._logged_outage = False
        self.totals = PassReport()

    # -- state ---------------------------------------------------------------------------------

    def ledger(self, bucket: str, tier: int) -> TierLedger:
        ledger = self._ledgers.get((bucket, tier))
        if ledger is None:
            policy_name = self._policy_of(bucket).eviction_policy
            try:
                policy = make_policy(policy_name)
            except KeyError:
                log.warning("bucket %s names unknown eviction policy %r; using lru", bucket, policy_name)
                policy = make_policy("lru")
            ledger = self._ledgers[(bucket, tier)] = TierLedger(policy)
        return ledger

    def usage(self, bucket: str, tier: int) -> int:
        ledger = self._ledgers.get((bucket, tier))
        return 0 if ledger is None else ledger.usage

    def usage_report(self) -> dict[str, dict[str, int]]:
        """Bytes and chunks per bucket and tier, as the ledgers see them."""
        out: dict[str, dict[str, int]] = {}
        for (bucket, tier), ledger in sorted(self._ledgers.items()):
            name = TIER_NAMES[tier]
            out.setdefault(bucket, {})[f"{name}_bytes"] = ledger.usage
            out[bucket][f"{name}_chunks"] = len(ledger.sizes)
        return out

    def _policy_of(self, bucket: str) -> BucketPolicy:
        for policy in self.service.directory.buckets():
            if policy.name == bucket:
                return policy
        return BucketPolicy(bucket, 0)

    def rebuild(self) -> int:
        """Load every indexed chunk into the ledgers (oldest access first) and the expiry heap.

        Blocking; runs once at start-up before requests are served, so no event can interleave.
        """
        index = self.service.index
        entries: list[tuple[float, bytes, IndexEntry]] = []
        after: bytes | None = None
        while page := index.scan(after, limit=4096):
            entries.extend((entry.last_access or entry.created, digest, entry) for digest, entry in page)
            after = page[-1][0]
        entries.sort(key=lambda item: item[0])
        for when, digest, entry in entries:
            for bit in (TIER_FS, TIER_S3):
                if entry.tiers & bit:
                    self.ledger(entry.bucket, bit).add(digest, entry.size, when)
            if entry.expires:
                self._expiry.append((entry.expires, digest))
        heapq.heapify(self._expiry)
        for child, parent in index.scan_parents():
            for (_, _), ledger in self._ledgers.items():
                if child in ledger:
                    ledger.policy.link(child, parent)
        return len(entries)

    # -- events from the service (ChunkEvents) ------------------------------------------------

    def stored(self, bucket: str, digest: bytes, tier: int, size: int, expires: float,
               parent: bytes | None, now: float) -> None:
        ledger = self.ledger(bucket, tier)
        ledger.add(digest, size, now)
        if parent is not None:
            ledger.policy.link(digest, parent)
        if expires:
            heapq.heappush(self._expiry, (expires, digest))

    def read(self, bucket: str, digest: bytes, tier: int, now: float) -> None:
        ledger = self._ledgers.get((bucket, tier))
        if ledger is not None and digest in ledger:
            ledger.policy.touch(digest, now)

    def removed(self, bucket: str, digest: bytes, tier: int) -> None:
        ledger = self._ledgers.get((bucket, tier))
        if ledger is not None:
            ledger.discard(digest)

    def chained(self, bucket: str, digests: list[bytes]) -> None:
        """A client named these keys in prefix order (prefix / batch-get calls): learn the links."""
        for tier in (TIER_FS, TIER_S3):
            ledger = self._ledgers.get((bucket, tier))
            if ledger is None:
                continue
            ledger.policy.link_chain(digests)

    # -- the periodic pass ---------------------------------------------------------------------

    async def start(self) -> None:
        count = await asyncio.to_thread(self.rebuild)
        log.info("lifecycle: %d chunks loaded into %d ledgers", count, len(self._ledgers))
        self._task = asyncio.create_task(self._loop(), name="kvgw-lifecycle")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_pass()
            except Exception:
                log.exception("lifecycle pass failed")

    async def run_pass(self, now: float | None = None) -> PassReport:
        now = self.service.clock() if now is None else now
        report = PassReport()
        budget = self.budget
        budget -= await self._expire(now, budget, report)
        budget -= await self._replicate(now, budget, report)
        for policy in self.service.directory.buckets():
            if budget <= 0:
                break
            budget -= await self._enforce(policy, TIER_FS, policy.capacity_bytes, budget, report)
            budget -= await self._enforce(policy, TIER_S3, policy.s3_capacity_bytes, budget, report)
        for name in ("expired", "replicated", "demoted", "evicted"):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(report, name))
        return report

    async def _expire(self, now: float, budget: int, report: PassReport) -> int:
        done = 0
        while self._expiry and self._expiry[0][0] <= now and done < budget:
            expires, digest = heapq.heappop(self._expiry)
            entry = self.service.index.get(digest)
            if entry is None or entry.expires != expires:
                continue  # deleted, or re-written with another expiry (its own heap item stands)
            try:
                await self.service.expire(digest, entry)
                report.expired += 1
            except backend.TierUnavailable:
                heapq.heappush(self._expiry, (expires, digest))  # absent already; reclaim bytes later
                report.waiting_for_s3 = True
                break
            done += 1
        return done

    def _s3_ready(self, now: float) -> bool:
        return self.service.s3 is not None and now >= self._s3_retry_at

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
        pending = self.service.index.pending(limit=budget)
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
                    if await self.service.replicate(digest):
                        report.replicated += 1
                except backend.TierUnavailable:
                    outage = True
                except Exception as exc:  # keep it queued; count the attempt
                    report.errors.append(f"write-through {digest.hex()}: {exc}")
                    await self.service.index.retry_pending(digest)

        await asyncio.gather(*(one(digest) for digest, _, _ in pending))
        if outage:
            self._s3_failed(now, report, "write-through")
        else:
            self._s3_ok()
        return len(pending)

    async def _enforce(self, policy: BucketPolicy, tier: int, capacity: int | None, budget: int,
                       report: PassReport) -> int:
        """Evict from (bucket, tier) in policy order once usage passes the high watermark.

        Victims are taken out of the ledger in small batches and moved concurrently (demotion to S3
        is network-bound); a victim whose move fails goes back into the ledger.
        """
        ledger = self._ledgers.get((policy.name, tier))
        if capacity is None or ledger is None or ledger.usage <= capacity * policy.high_watermark:
            return 0
        demoting = tier == TIER_FS and self.service.s3 is not None
        width = self.replication_concurrency if demoting else 16
        target = capacity * policy.low_watermark
        done = 0
        while ledger.usage > target and done < budget:
            if demoting and not self._s3_ready(self.service.clock()):
                report.waiting_for_s3 = True
                break
            batch: list[tuple[bytes, IndexEntry]] = []
            while ledger.usage > target and done < budget and len(batch) < width:
                digest = ledger.policy.victim()
                if not isinstance(digest, bytes):
                    break
                done += 1
                entry = self.service.index.get(digest)
                ledger.discard(digest)  # out of the ledger while it moves (or gone behind our back)
                if entry is not None and entry.tiers & tier:
                    batch.append((digest, entry))
            if not batch:
                break
            outcomes = await asyncio.gather(*(self._evict_one(d, e, tier, demoting) for d, e in batch),
                                            return_exceptions=True)
            outage = False
            for (digest, entry), outcome in zip(batch, outcomes, strict=True):
                if outcome is None:
                    if demoting:
                        report.demoted += 1
                    else:
                        report.evicted += 1
                    continue
                if isinstance(outcome, backend.TierUnavailable):
                    outage = True
                else:
                    report.errors.append(f"evict {digest.hex()}: {outcome}")
                self._restore(ledger, tier, digest, entry)
            if outage:
                self._s3_failed(self.service.clock(), report, "demotion")
                break
            if demoting:
                self._s3_ok()
        return done

    async def _evict_one(self, digest: bytes, entry: IndexEntry, tier: int, demoting: bool) -> None:
        if demoting:
            await self.service.demote(digest, entry)
        else:
            await self.service.drop_copy(digest, entry, tier)

    def _restore(self, ledger: TierLedger, tier: int, digest: bytes, entry: IndexEntry) -> None:
        """Put back a victim whose move failed (as just used, so the next pass tries others first)."""
        current = self.service.index.get(digest)
        if current is None or not current.tiers & tier:
            return
        ledger.add(digest, entry.size, self.service.clock())
        parent = self.service.index.parent_of(digest)
        if parent is not None:
            ledger.policy.link(digest, parent)
