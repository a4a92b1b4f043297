"""The read leases this client holds, so a lookup that follows another does not pay for a second one,
and a direct read under a lease needs no lookup at all.

An engine looks a prefix up (leasing its hits, ``lease_ms``) and then loads it; with direct reads the
load itself starts with a ``locate``, a lookup too. Asking for the lease again there costs a catalog
transaction on the gateway (about a millisecond on SQLite, a round trip on PostgreSQL) for chunks
already leased a moment ago. So the client remembers, per key, until when the gateway holds a lease it
was granted, and asks for none while every key of a call stays leased for at least half the lease
length: the earlier lease covers the load that follows.

The remembered end is conservative: it is counted from when the request was sent, and the gateway
starts its lease on receipt, later. A lease ends early when the chunk is loaded through the gateway
that granted it (``gateway.leases``), so a key is forgotten as soon as a load of it through the gateway
is sent (``forget``). Leases are shared per chunk on the gateway, so another client's load can end one
early as well; that was so before this memory existed (the lease is a guard against eviction, not a
reservation), and a direct read that then finds its file gone falls back to batch-get.

Direct reads (``direct_read_root``) start with a ``locate``; what it answered is remembered with the
lease (``remember_locations``), and a later direct read of keys that are all leased and located reads
the files without asking (``located``), as LMCache's own disk backend reads from its in-memory map of
files. That is safe because a chunk's file path follows from its key, the lifecycle leaves a leased
chunk where it is, and every direct read verifies size and checksum: a file deleted or rewritten under
the same key fails the check and the read falls back to batch-get (``forget`` drops what it knew).

Thread safe: the client's I/O loop and the lookups callers' threads make themselves
(``KvgwClient.lookup_now``) share it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvgw_client.direct import Location

REMEMBERED = 32_768  # keys; the oldest grants are forgotten first (the next lookup asks again)


class HeldLeases:
    """Per key, the monotonic time until which a lease granted to this client holds on the gateway."""

    def __init__(self, clock: Callable[[], float], *, remembered: int = REMEMBERED) -> None:
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()
        self._files: dict[str, Location] = {}  # of leased keys, where a locate found their file
        self._remembered = remembered
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock()

    def covers(self, keys: Sequence[str], lease_ms: int) -> bool:
        """Whether every key stays leased for at least half of ``lease_ms`` from now: then a lookup of
        ``keys`` needs no lease of its own. False for no keys (nothing to save)."""
        with self._lock:
            return self._covers(keys, lease_ms)

    def _covers(self, keys: Sequence[str], lease_ms: int) -> bool:
        if not keys or lease_ms <= 0:
            return False
        needed = self._clock() + lease_ms / 2000
        until = self._until
        return all(until.get(key, 0.0) >= needed for key in keys)

    def granted(self, keys: Iterable[str], sent_at: float, granted_ms: int) -> None:
        """The gateway leased ``keys`` for ``granted_ms`` in answer to a request sent at ``sent_at``."""
        with self._lock:
            if granted_ms <= 0:
                return
            end = sent_at + granted_ms / 1000
            until = self._until
            for key in keys:
                if until.get(key, 0.0) < end:
                    until[key] = end
                    until.move_to_end(key)
            while len(until) > self._remembered:
                self._files.pop(until.popitem(last=False)[0], None)

    def remember_locations(self, keys: Sequence[str], locations: Sequence[Location | None]) -> None:
        """A ``locate`` answered ``locations`` for ``keys``: kept for the keys leased now that have a file."""
        with self._lock:
            until, files = self._until, self._files
            for key, location in zip(keys, locations, strict=True):
                if location is not None and location.path is not None and key in until:
                    files[key] = location

    def located(self, keys: Sequence[str], lease_ms: int) -> list[Location] | None:
        """Where every key's file is, if all are covered (``covers``) and were located; else None."""
        with self._lock:
            if not self._covers(keys, lease_ms):
                return None
            found: list[Location] = []
            for key in keys:
                location = self._files.get(key)
                if location is None:
                    return None
                found.append(location)
            return found

    def forget(self, keys: Iterable[str]) -> None:
        """Drop what is known of ``keys``: a load through the gateway is being sent (it ends their leases
        there), or a direct read of a remembered file failed."""
        with self._lock:
            until, files = self._until, self._files
            if until:
                for key in keys:
                    until.pop(key, None)
                    files.pop(key, None)

    def __len__(self) -> int:
        return len(self._until)
