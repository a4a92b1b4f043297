"""Admission under pressure: which new chunks a full tier does not take.

A tier at its watermarks makes room for every new chunk by evicting another. A chunk that will not be
read again is better not stored at all: nothing is evicted for it, and the write costs the engine
nothing (its KV stays in its own memory). ``decide`` is the rule, applied on every gateway's write path
(``gateway.service``) while the bucket's filesystem tier is at its low watermark or above:

A chunk whose hints say nothing will read it again (``X-Kvgw-Retention: one-off``, which LMCache's
connector also sends for the chunks a session's last turn writes) is declined: its predicted reuse is
none, below anything it would evict.

What was measured and left out (BENCHMARKS.md):

* Declining a never-read chunk whose learnt hit density at age 0 is below that of recent victims (the
  eviction policy's own comparison, moved to the door) declined most requests on the Mooncake traces
  and lost up to 90% of the hit rate (``kvgw bench trace``): a new chunk's density counts only its next
  read, and on these traces the next read of a new chunk comes later than the tier's turnover, so the
  comparison says no to chains that would have been read many times. Eviction already gives such chunks
  the lowest priority once they are stored.
* Declining a chunk whose parent (``X-Kvgw-Parent``) the lifecycle evicted (a prefix lookup would stop
  at the hole): engines write a request's chunks all at once, so a parent evicted earlier is often being
  written again in the same batch; ``kvgw bench qa`` saw half of SGLang's page writes under pressure
  declined that way while their parents were in flight. Whether a parent is in flight cannot be told at
  the door when a batch is spread over several gateways.

A declined write answers 507 ``Declined`` (``gateway.errors.Declined``) with the reason.
"""

from __future__ import annotations

from gateway.lifecycle.policy import EARLY_MARKS

ONE_OFF = "one-off"
REASONS = (ONE_OFF,)


def decide(*, marks: int) -> str | None:
    """Why a new chunk is not admitted at the watermarks (one of ``REASONS``), or None to admit it."""
    if marks & EARLY_MARKS:
        return ONE_OFF
    return None
