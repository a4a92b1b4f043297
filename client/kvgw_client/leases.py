"""The read leases this client holds, so a lookup that follows another does not pay for a second one.

An engine looks a prefix up (leasing its hits, ``lease_ms``) and then loads it; with direct reads the
load itself starts with a ``locate``, a lookup too. Asking for the lease again there costs a catalog
transaction on the gateway (about a millisecond on SQLite, a round trip on PostgreSQL) for chunks
already leased a moment ago. So the client remembers, per key, until when the gateway holds a lease it
was granted, and asks for none while every key of a call stays leased for at least half the lease
length: the earlier lease covers the load that follows.

The remembered end is conservative: it is counted from when the request was sent, and the gateway
starts its lease on receipt, later. A lease ends early when the chunk is loaded through the gateway
that granted it (``gateway.leases``), so a key is forgotten as soon as a load of it through the gateway
is sent (``loading``). Leases are shared per chunk on the gateway, so another client's load can end one
early as well; that was so before this memory existed (the lease is a guard against eviction, not a
reservation), and a direct read that then finds its file gone falls back to batch-get.

Not thread safe: the client's I/O loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

REMEMBERED = 32_768  # keys; the oldest grants are forgotten first (the next lookup asks again)


class HeldLeases:
    """Per key, the monotonic time until which a lease granted to this client holds on the gateway."""

    def __init__(self, clock: Callable[[], float], *, remembered: int = REMEMBERED) -> None:
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()
        self._remembered = remembered

    def now(self) -> float:
        return self._clock()

    def covers(self, keys: Sequence[str], lease_ms: int) -> bool:
        """Whether every key stays leased for at least half of ``lease_ms`` from now: then a lookup of
        ``keys`` needs no lease of its own. False for no keys (nothing to save)."""
        if not keys or lease_ms <= 0:
            return False
        needed = self._clock() + lease_ms / 2000
        until = self._until
        return all(until.get(key, 0.0) >= needed for key in keys)

    def granted(self, keys: Iterable[str], sent_at: float, granted_ms: int) -> None:
        """The gateway leased ``keys`` for ``granted_ms`` in answer to a request sent at ``sent_at``."""
        if granted_ms <= 0:
            return
        end = sent_at + granted_ms / 1000
        until = self._until
        for key in keys:
            if until.get(key, 0.0) < end:
                until[key] = end
                until.move_to_end(key)
        while len(until) > self._remembered:
            until.popitem(last=False)

    def loading(self, keys: Iterable[str]) -> None:
        """A load of ``keys`` through the gateway is being sent: it ends their leases there."""
        until = self._until
        if until:
            for key in keys:
                until.pop(key, None)

    def __len__(self) -> int:
        return len(self._until)
