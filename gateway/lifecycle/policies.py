"""The eviction policies by name: what a bucket's ``eviction_policy`` names and the lifecycle runs.

``default`` is the policy a bucket gets unless it names another (``gateway.buckets``).
"""

from __future__ import annotations

from typing import Any

from gateway.lifecycle.policy import (
    FIFOPolicy,
    HitDensityPolicy,
    LFUPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    SampledPolicy,
)
from gateway.lifecycle.policy_reuse import ReusePolicy

POLICIES: dict[str, type[SampledPolicy[Any]]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "prefix-lru": PrefixLRUPolicy,
    "hit-density": HitDensityPolicy,
    "reuse": ReusePolicy,
    "default": ReusePolicy,
}


def make_policy(name: str, **options: int) -> SampledPolicy[Any]:
    """Build the policy registered under ``name`` (``default`` included); KeyError names the choices."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(**options)
