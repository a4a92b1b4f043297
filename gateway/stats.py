"""The gateway's state as one document: ``/v1/admin/stats`` serves it and ``/metrics`` is built from it
(``gateway.metrics.StatsCollector``), so each number has one source.

Cheap enough to build on every scrape: index counters, the lifecycle's running totals, the ledgers'
usage and the cluster's own summary; no storage is touched.
"""

from __future__ import annotations

import os
from typing import Any

from backends.tiers import TierId
from gateway.runtime import Gateway


def gateway_stats(gateway: Gateway) -> dict[str, Any]:
    mover, lifecycle = gateway.mover, gateway.lifecycle
    capacity = {
        policy.name: {TierId.FS.label: policy.capacity_bytes, TierId.S3.label: policy.s3_capacity_bytes}
        for policy in gateway.directory.buckets()
    }
    return {
        "process": {"pid": os.getpid()},  # which worker answered (kvgw serve --workers)
        "chunks_indexed": gateway.index.count(),
        "write_through_pending": gateway.index.pending_count(),
        "usage": gateway.ledgers.usage_report(),
        "capacity": capacity,
        "lifecycle": {k: v for k, v in vars(lifecycle.counted()).items() if isinstance(v, int)},
        "lifecycle_waiting": lifecycle.waiting,  # bucket -> why its usage stays over the watermark
        "lifecycle_leader": gateway.leadership.status(),  # whether this process runs eviction and TTL
        "lifecycle_policies": gateway.ledgers.status(),  # the eviction policies this process runs, what they learnt
        "lifecycle_state": lifecycle.state_status(),  # what they learnt, kept in the catalog
        "s3_breaker": getattr(gateway.tiers.get(TierId.S3), "breaker_state", None),  # closed/open/half-open
        "moved_bytes": dict(mover.moved_bytes),
        "promotions": mover.promotions,
        # chunk files the directory listed but a lookup here missed (another host created them after a
        # lookup here: NFS / FUSE negative caches): retried, and given up on after fs_visibility_seconds
        "fs_hidden": {"seen": gateway.fs.hidden_seen, "refused": gateway.fs.hidden_refused},
        # batch reads' chunks opened ahead in one worker-thread pass (backends.read_ahead)
        "fs_read_ahead": gateway.fs.read_ahead_report(),
        "write_through_skipped": gateway.service.write_through_skipped,
        # native PUTs while a bucket's fs tier was at its low watermark: admitted, or declined and why
        "admission": gateway.service.admission,
        "leases": gateway.leases.report(),  # read leases this process granted, and the lifecycle left
        "cluster": gateway.cluster.stats(),  # usage of the whole tier (all gateways), feed, member
    }
