"""Engine hints: what each hint (``kvgw_client.wire.Hint``) and retention class does to a chunk's marks.

A hint names chunks by key; the service sets and clears their marks (``backends.index.MARK_*``, one
byte of the index record, so nothing is kept in memory per chunk) and publishes the change to the
cluster feed, so the lifecycle leader's index sees hints given to any gateway. What the marks mean to
eviction and admission is ``gateway.lifecycle.policy``'s business:

- ``pin``: never evicted or demoted until ``unpin`` (TTL still applies); pinned bytes count toward the
  capacity, so a bucket full of pinned chunks evicts nothing and declines new writes under pressure.
- ``session-ended``: evicted before anything but partial tails, unless read again (a read clears it).
- ``ended``: the request finished; the policy learns how often such chunks are read again (a read
  clears it).
- ``shared`` / ``one-off`` / ``normal``: the retention class; shared chunks are a class of their own
  to the policy, one-off chunks go early and are declined first under pressure.
"""

from __future__ import annotations

from backends.index import (
    MARK_ENDED,
    MARK_ONE_OFF,
    MARK_PINNED,
    MARK_SESSION_ENDED,
    MARK_SHARED,
)
from gateway.errors import InvalidRequest
from kvgw_client.wire import Hint, Retention

HINT_MARKS: dict[Hint, tuple[int, int]] = {  # hint -> (marks set, marks cleared)
    Hint.ENDED: (MARK_ENDED, 0),
    Hint.SESSION_ENDED: (MARK_ENDED | MARK_SESSION_ENDED, 0),
    Hint.SHARED: (MARK_SHARED, MARK_ONE_OFF),
    Hint.NORMAL: (0, MARK_SHARED | MARK_ONE_OFF),
    Hint.ONE_OFF: (MARK_ONE_OFF, MARK_SHARED),
    Hint.PIN: (MARK_PINNED, 0),
    Hint.UNPIN: (0, MARK_PINNED),
}

RETENTION_MARKS: dict[Retention, int] = {
    Retention.SHARED: MARK_SHARED,
    Retention.NORMAL: 0,
    Retention.ONE_OFF: MARK_ONE_OFF,
}


def parse_hint(raw: object) -> Hint:
    """The hint a request names; InvalidRequest (listing the hints) for anything else."""
    try:
        return Hint(raw)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidRequest(f'"hint" must be one of {", ".join(h.value for h in Hint)}') from None


def parse_retention(raw: str | None) -> int:
    """The marks of an ``X-Kvgw-Retention`` header value (0 when absent); InvalidRequest otherwise."""
    if raw is None:
        return 0
    try:
        return RETENTION_MARKS[Retention(raw.strip().lower())]
    except ValueError:
        raise InvalidRequest(f"X-Kvgw-Retention must be one of {', '.join(r.value for r in Retention)}") from None
