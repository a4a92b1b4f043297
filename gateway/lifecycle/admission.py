"""Admission under pressure: which new chunks a full tier does not take.

A tier at its watermarks makes room for every new chunk by evicting another. A chunk that will not be
read again is better not stored at all: nothing is evicted for it, and the write costs the engine
nothing (its KV stays in its own memory). ``decide`` is the rule, applied on every gateway's write path
(``gateway.service``) while the bucket's filesystem tier is at its low watermark or above:

1. A chunk whose hints say nothing will read it again (``X-Kvgw-Retention: one-off``; marks set by
   ``session-ended``) is declined: its predicted reuse is none, below anything it would evict.
2. A chunk whose parent (``X-Kvgw-Parent``) the lifecycle evicted (the index remembers it as a ghost) is
   declined: a prefix lookup stops at the missing parent, so nothing would ever find the chunk. A parent
   merely not indexed yet (its PUT still in flight, on this or another gateway) does not count.

What was measured and left out: declining a never-read chunk whose learnt hit density at age 0 is below
that of recent victims (the eviction policy's own comparison, moved to the door) declined most
requests on the Mooncake traces and lost up to 90% of the hit rate (BENCHMARKS.md, ``kvgw bench
trace``): a new chunk's density counts only its next read, and on these traces the next read of a
new chunk comes later than the tier's turnover, so the comparison says no to chains that would have
been read many times. Eviction already gives such chunks the lowest priority once they are stored.

A declined write answers 507 ``Declined`` (``gateway.errors.Declined``) with the reason.
"""

from __future__ import annotations

from gateway.lifecycle.policy import EARLY_MARKS

ONE_OFF = "one-off"
NO_PARENT = "parent-evicted"
REASONS = (ONE_OFF, NO_PARENT)


def decide(*, marks: int, parent_evicted: bool) -> str | None:
    """Why a new chunk is not admitted at the watermarks (one of ``REASONS``), or None to admit it."""
    if marks & EARLY_MARKS:
        return ONE_OFF
    if parent_evicted:
        return NO_PARENT
    return None
