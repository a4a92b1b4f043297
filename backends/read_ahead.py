"""Chunks a batch read is about to serve, opened ahead of it by one worker-thread pass.

Why: a batch-get serves each chunk from a mapping (or an open file, for ``sendfile``) made in a worker
thread, so the event loop never waits on the disk. One hand-off per chunk cost the event loop's thread
~0.3-0.4 ms per 8 MiB frame on these VMs (waking a pool thread and being woken back), as much as a
fifth of what sending the frame costs (BENCHMARKS.md, "kvgw bench io", batch-get). Here one pass in one
worker thread opens a batch's chunks in the order they will be sent, and each frame's read takes its
chunk from this store without a hand-off. A chunk that is not ready when its turn comes (the pass is
behind, or failed on it) is opened the ordinary way, and the pass then skips it.

What a caller must know:
- Entries are keyed by ``(digest, form)``: the form says exactly what was opened (a mapping of which
  range, verified against which checksum, or a descriptor), and a read takes only an entry made for
  exactly its own call, so what it gets is what its own open would have returned at that moment.
- ``claim`` hands an entry over (the caller owns it) or marks the key claimed so the pass leaves it.
- Bounded: at most ``limit_bytes`` of chunks opened ahead and not yet taken; a key planned but not
  taken within ``max_age`` seconds is dropped (its entry closed) at the next ``plan``; ``drop`` closes a
  digest's entries at once (its file is deleted or quarantined).
- Thread-safe: the pass runs in a worker thread, claims come from the event loop.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

Form = tuple[Hashable, ...]
"""What was opened: a tier's own description of the call the entry answers."""

Key = tuple[bytes, Form]


class _State(enum.Enum):
    PLANNED = "planned"  # the pass will open it
    OPENING = "opening"  # the pass is opening it now
    READY = "ready"  # opened, waiting for its read
    CLAIMED = "claimed"  # its read came first and opened it itself: the pass leaves it


@dataclass(slots=True)
class _Entry:
    state: _State
    size: int
    planned_at: float
    opened: object = None
    close: Callable[[], None] | None = None
    counted: bool = field(default=False)  # its size counts against the limit


class OpenedAhead:
    """The store a tier's read-ahead pass fills and its reads take from (module docstring)."""

    def __init__(self, *, limit_bytes: int, max_age: float, clock: Callable[[], float]) -> None:
        self.limit_bytes = limit_bytes
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._bytes = 0  # sizes of entries opening or ready
        self.taken = 0  # reads served from here
        self.missed = 0  # planned reads that came before their entry was ready

    def plan(self, keys: Sequence[tuple[Key, int]]) -> None:
        """Announce the reads a pass will open, with their sizes; drops what earlier plans left over."""
        now = self._clock()
        stale: list[_Entry] = []
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.planned_at < now - self.max_age and entry.state is not _State.OPENING:
                    stale.append(self._remove(key))
            for key, size in keys:
                if key not in self._entries:
                    self._entries[key] = _Entry(_State.PLANNED, size, now)
        _close_all(stale)

    def begin(self, key: Key) -> bool:
        """The pass asks to open ``key``: True if it is still planned and fits under the limit (it is
        then OPENING and counted), False if its read came first, or if it does not fit (the key is
        dropped: its read opens it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not _State.PLANNED:
                if entry is not None and entry.state is _State.CLAIMED:
                    del self._entries[key]  # its read came first: nothing more to do for it
                return False
            if self._bytes + entry.size > self.limit_bytes:
                del self._entries[key]
                return False
            entry.state = _State.OPENING
            entry.counted = True
            self._bytes += entry.size
            return True

    def offer(self, key: Key, opened: object, close: Callable[[], None]) -> None:
        """The pass opened ``key``: keep it for its read, or close it if that read came first."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state is _State.OPENING:
                entry.state, entry.opened, entry.close = _State.READY, opened, close
                return
            if entry is not None:  # claimed while opening
                self._remove(key)
        close()

    def abandon(self, key: Key) -> None:
        """The pass could not open ``key`` (its read will, and report why)."""
        with self._lock:
            if key in self._entries:
                self._remove(key)

    def claim(self, key: Key) -> object | None:
        """The read of ``key`` is here: what the pass opened for it (the caller now owns it), or None
        (not planned, or not ready: the caller opens it itself, and the pass will leave it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.state is _State.READY:
                self._remove(key)
                self.taken += 1
                return entry.opened
            if entry.state is not _State.CLAIMED:
                self.missed += 1
                entry.state = _State.CLAIMED
            return None

    def drop(self, digest: bytes) -> None:
        """Close and forget every entry of ``digest`` (its file is going away)."""
        with self._lock:
            dropped = [self._remove(key) for key in [k for k in self._entries if k[0] == digest]]
        _close_all(dropped)

    def clear(self) -> None:
        with self._lock:
            dropped = [self._remove(key) for key in list(self._entries)]
        _close_all(dropped)

    def report(self) -> dict[str, int]:
        """What the admin stats show: reads served from here, planned reads that came too early, and
        what waits now (entries opened and not taken, their bytes)."""
        with self._lock:
            ready = sum(1 for entry in self._entries.values() if entry.state is _State.READY)
            return {"taken": self.taken, "missed": self.missed, "ready": ready, "bytes": self._bytes}

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: Key) -> _Entry:
        entry = self._entries.pop(key)
        if entry.counted:
            self._bytes -= entry.size
            entry.counted = False
        return entry


def _close_all(entries: list[_Entry]) -> None:
    for entry in entries:
        if entry.state is _State.READY and entry.close is not None:
            entry.close()
