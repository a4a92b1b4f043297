"""The lifecycle ledgers: usage per (bucket, tier) and the eviction policies, with no per-chunk state.

What each tier holds is in the index, not here: the index keeps bytes and chunks per (bucket, tier) in
the same write transactions that change entries (``ChunkIndex.usage``), the TTL order
(``ChunkIndex.due``), chain links and the ghosts of evicted chunks. ``Ledgers`` keeps only one sampled
eviction policy per (bucket, tier) (``gateway.lifecycle.policy``: a small candidate pool and, for
``default``, reuse statistics) and answers usage from the index.

Usage comes in two kinds, both behind ``UsageSource``:

- ``Ledgers.usage``: what this gateway's index holds (exact for its own changes at once; with the
  cluster feed applying other gateways' changes, the whole tier as of the feed position);
- the cluster-wide ledger ``gateway.cluster.usage.UsageView`` (``tier_usage`` in the catalog), which the
  lifecycle leader enforces capacity against when the cluster is on.

``Ledgers`` is also the local ``ChunkEvents`` sink: nothing to count (the index counts), except that a
prefix chain learnt from the order of keys in a lookup is recorded in the index (``chained``). Reads
reach the policies as index observations (``learn``), wherever they were made: this gateway's reads,
direct-read touches, and other gateways' reads applied by the feed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import xxhash

from backends.catalog.store import BucketPolicy
from backends.index import OBS_READ, ChunkIndex, Observation
from backends.tiers import TierId
from gateway.access import Directory
from gateway.chunks import ChunkInfo, RemovedReason, StoredReason
from gateway.lifecycle.policies import POLICIES, make_policy
from gateway.lifecycle.policy import SampledPolicy

log = logging.getLogger("kvgw.lifecycle")

CHAINS_REMEMBERED = 4096


class UsageSource(Protocol):
    """Bytes a tier holds for a bucket, as the lifecycle enforces capacity against them."""

    def usage(self, bucket: str, tier: TierId) -> int: ...

    async def refresh(self) -> None:
        """Read the shared state now (the lifecycle calls it after it evicted, before it decides again)."""
        ...


def at_low_watermark(usage: UsageSource, bucket: BucketPolicy) -> bool:
    """Whether the bucket's filesystem tier is at its low watermark or above (it has no room to spare:
    the lifecycle evicts for every new chunk), as ``usage`` last read it; False without a capacity.
    Where admission under pressure starts (``ChunkService.admit``)."""
    capacity = bucket.capacity_bytes
    return capacity is not None and usage.usage(bucket.name, TierId.FS) >= capacity * bucket.low_watermark


class LargerUsage:
    """The larger of two usage sources: the shared ledger and what the leader's own index holds.

    Each errs its own way: the shared ledger (``tier_usage``) lags by its refresh and is off by events
    lost in a crash until it is recounted from the tiers; the index lags by the feed and misses chunks it
    was never told of. Capacity is a limit, so the leader trusts whichever says more.
    """

    def __init__(self, shared: UsageSource, local: UsageSource) -> None:
        self.shared = shared
        self.local = local

    def usage(self, bucket: str, tier: TierId) -> int:
        return max(self.shared.usage(bucket, tier), self.local.usage(bucket, tier))

    async def refresh(self) -> None:
        await self.shared.refresh()


class Ledgers:
    """Per (bucket, tier): its eviction policy; usage from the index. The local ``ChunkEvents`` sink."""

    def __init__(self, directory: Directory, index: ChunkIndex) -> None:
        self._directory = directory
        self._index = index
        self._policies: dict[tuple[str, TierId], SampledPolicy[bytes]] = {}
        self._chains: OrderedDict[int, None] = OrderedDict()  # hashes of chains recorded lately

    # -- policies ------------------------------------------------------------------------------

    def policy(self, bucket: str, tier: TierId) -> SampledPolicy[bytes]:
        """The policy of (bucket, tier), made anew when the bucket's eviction policy changed."""
        name = self._policy_of(bucket).eviction_policy
        policy = self._policies.get((bucket, tier))
        if policy is None or not _named(policy, name):
            try:
                policy = make_policy(name)
            except KeyError:
                log.warning("bucket %s names unknown eviction policy %r; using lru", bucket, name)
                policy = make_policy("lru")
            self._policies[(bucket, tier)] = policy
        return policy

    def count(self) -> int:
        """How many (bucket, tier) policies exist."""
        return len(self._policies)

    def status(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Each (bucket, tier) policy's ``status()``, by bucket and tier label."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (bucket, tier), policy in sorted(self._policies.items()):
            out.setdefault(bucket, {})[TierId(tier).label] = policy.status()
        return out

    def export(self) -> list[tuple[str, int, str, Any]]:
        """What each policy learnt that is worth keeping: (bucket, tier, policy name, state)
        (``gateway.lifecycle.state``)."""
        out: list[tuple[str, int, str, Any]] = []
        for (bucket, tier), policy in sorted(self._policies.items()):
            state = policy.export()
            if state is not None:
                out.append((bucket, int(tier), policy.name, state))
        return out

    def restore(self, saved: Mapping[tuple[str, int], tuple[str, Any, str]]) -> int:
        """Hand saved states to the policies of the same name (making them as needed); how many took
        theirs. A state of another policy than the bucket's current one is left alone."""
        restored = 0
        for (bucket, tier), (name, state, member) in sorted(saved.items()):
            try:
                policy = self.policy(bucket, TierId(tier))
            except ValueError:
                continue
            if policy.name == name and policy.restore(state):
                restored += 1
                log.info("lifecycle: %s (%s tier) goes on from what %s learnt (%s)", bucket, TierId(tier).label,
                         member or "a previous leader", name)
        return restored

    def _policy_of(self, bucket: str) -> BucketPolicy:
        for policy in self._directory.buckets():
            if policy.name == bucket:
                return policy
        return BucketPolicy(bucket, 0)

    def learn(self, observations: Iterable[Observation]) -> int:
        """Hand reads, returns and forgotten evictions to the policies that learn from them."""
        learnt = 0
        policies: dict[tuple[str, TierId], SampledPolicy[bytes]] = {}
        for seen in observations:
            # a read is served from the filesystem copy if there is one; returns and ghosts name their tier
            tier = TierId(seen.tiers) if seen.kind != OBS_READ else TierId.FS if seen.tiers & TierId.FS else TierId.S3
            policy = policies.get((seen.bucket, tier))
            if policy is None:
                policy = policies[(seen.bucket, tier)] = self.policy(seen.bucket, tier)
            if policy.learns:
                policy.learn(seen)
                learnt += 1
        return learnt

    # -- usage (UsageSource) -------------------------------------------------------------------

    def usage(self, bucket: str, tier: TierId) -> int:
        """Bytes this gateway's index holds for ``bucket`` in ``tier``."""
        return self._index.usage(bucket, int(tier))[0]

    async def refresh(self) -> None:
        return None  # the index's counters are current

    def usage_report(self) -> dict[str, dict[str, int]]:
        """Bytes and chunks per bucket and tier, as this gateway's index holds them."""
        out: dict[str, dict[str, int]] = {}
        for (bucket, tier), (size, chunks) in sorted(self._index.usage_all().items()):
            label = TierId(tier).label
            out.setdefault(bucket, {})[f"{label}_bytes"] = size
            out[bucket][f"{label}_chunks"] = chunks
        return out

    # -- events from the service and the mover (ChunkEvents) ----------------------------------

    def stored(self, bucket: str, digest: bytes, tier: TierId, size: int, expires: float,
               parent: bytes | None, now: float, *, reason: StoredReason = "stored",
               info: ChunkInfo | None = None) -> None:
        return None  # the index counted it in the transaction that indexed it

    def read(self, bucket: str, digest: bytes, tier: TierId, now: float) -> None:
        return None  # the index observes the read when it records it

    def removed(self, bucket: str, digest: bytes, tier: TierId, *, reason: RemovedReason = "deleted",
                info: ChunkInfo | None = None) -> None:
        return None

    def marked(self, bucket: str, digest: bytes, set_marks: int, clear_marks: int, now: float) -> None:
        return None  # the index holds the marks; the policies read them there

    def chained(self, bucket: str, digests: list[bytes]) -> None:
        """A client named these keys in prefix order (prefix / batch-get calls): record the links.

        Clients look the same chains up again and again; a chain recorded lately (a bounded memo of
        chain hashes, ``CHAINS_REMEMBERED``) costs one hash, not an index read per key."""
        if len(digests) < 2:
            return
        memo = self._chains
        mark = xxhash.xxh3_64_intdigest(b"".join(digests))
        if mark in memo:
            memo.move_to_end(mark)
            return
        memo[mark] = None
        if len(memo) > CHAINS_REMEMBERED:
            memo.popitem(last=False)
        self._index.link_chain(digests)


def _named(policy: SampledPolicy[Any], name: str) -> bool:
    """Whether ``policy`` is the one ``name`` stands for (``default`` is another policy's alias)."""
    cls = POLICIES.get(name)
    return policy.name == (cls.name if cls is not None else name)
