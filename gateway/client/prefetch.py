"""CPU staging prefetcher: fetch a request's chunks from kvgw ahead of use, serve them from memory.

``stage(keys)`` returns at once. In the background it asks the gateway how many leading keys are
present (``prefix``, skipped when the caller already knows) and streams those chunks with one
batch-get into a bounded ``StagingBuffer``. A later ``get(key)`` takes a staged chunk from memory;
for a chunk still in flight it waits for that fetch instead of fetching it again. A miss returns
None, and the caller fetches the chunk itself (``fallback=True`` does that here).

Memory: a payload's bytes are reserved in the buffer (evicting least recently staged, unused chunks
if needed) before its bytearray is allocated, so staged plus in-flight bytes never exceed the limit.
Chunks of one ``stage`` call never evict each other: a request larger than the buffer stages its
leading part, which is what a prefix-matching reader needs first. ``get`` hands the bytes over and
drops them from the buffer (staging is a one-shot handoff).

Threading: all methods are safe from any thread or event loop. State sits behind one lock held only
for bookkeeping; fetches and copies run on the source's I/O loop (``ChunkSource.spawn``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gateway.client.framing import BatchItem, BufferProvider, ItemStatus
from gateway.client.loop import wait_shared

T = TypeVar("T")


class ChunkSource(Protocol):
    """What the prefetcher needs from a client (``KvgwClient`` provides it)."""

    def spawn(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]: ...

    async def prefix(self, keys: Sequence[str], *, quiet: bool = ..., timeout: float | None = ...) -> int: ...

    async def batch_get_into(
        self,
        keys: Sequence[str],
        into: BufferProvider,
        *,
        on_item: Any = ...,
        quiet: bool = ...,
    ) -> list[ItemStatus]: ...

    async def get(self, key: str, *, quiet: bool = ..., timeout: float | None = ...) -> bytearray | None: ...


@dataclass(slots=True)
class _Entry:
    size: int
    group: int
    data: bytearray | None = None  # None while reserved (payload in flight)


class StagingBuffer:
    """An LRU of payloads under a hard byte limit, with reservations for payloads in flight.

    Not thread-safe; the owner locks. Reserved entries are never evicted; neither are entries of the
    group making a reservation.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("staging limit must be positive")
        self.limit = limit
        self.used = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def is_ready(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.data is not None

    def reserve(self, key: str, size: int, group: int) -> list[tuple[str, int]] | None:
        """Reserve ``size`` bytes for ``key``. Returns the (key, size) of entries evicted to make room,
        or None (and evicts nothing) when the reservation cannot fit."""
        if key in self._entries:
            raise KeyError(f"{key!r} is already staged")
        if size > self.limit:
            return None
        need = self.used + size - self.limit
        victims: list[str] = []
        if need > 0:
            freed = 0
            for k, entry in self._entries.items():
                if entry.data is None or entry.group == group:
                    continue
                victims.append(k)
                freed += entry.size
                if freed >= need:
                    break
            if freed < need:
                return None
        evicted = []
        for k in victims:
            entry = self._entries.pop(k)
            self.used -= entry.size
            evicted.append((k, entry.size))
        self._entries[key] = _Entry(size, group)
        self.used += size
        return evicted

    def commit(self, key: str, data: bytearray) -> None:
        entry = self._entries[key]
        if entry.data is not None or len(data) != entry.size:
            raise ValueError("commit does not match the reservation")
        entry.data = data
        self._entries.move_to_end(key)

    def release(self, key: str) -> int:
        """Drop an entry (reserved or ready); returns its size, 0 if absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self.used -= entry.size
        return entry.size

    def release_reservation(self, key: str, group: int) -> bool:
        """Drop ``key`` if it is still a reservation of ``group``."""
        entry = self._entries.get(key)
        if entry is None or entry.data is not None or entry.group != group:
            return False
        del self._entries[key]
        self.used -= entry.size
        return True

    def take(self, key: str) -> bytearray | None:
        """Remove and return a ready payload; None if absent or still in flight."""
        entry = self._entries.get(key)
        if entry is None or entry.data is None:
            return None
        del self._entries[key]
        self.used -= entry.size
        return entry.data

    def clear(self) -> int:
        """Drop everything; returns the bytes of ready payloads dropped."""
        dropped = sum(e.size for e in self._entries.values() if e.data is not None)
        self._entries.clear()
        self.used = 0
        return dropped


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    staged_hits: int  # gets served from memory (including ones that waited for an in-flight fetch)
    misses: int  # gets for keys not staged, or whose fetch failed
    prefetched_bytes: int  # payload bytes that landed in the buffer
    used_bytes: int  # of those, bytes handed to a get
    wasted_bytes: int  # bytes prefetched but never used: evicted, or dropped at close
    evictions: int
    refused: int  # payloads not staged for lack of room
    staged_now: int  # bytes in the buffer (ready and reserved)


class Prefetcher:
    def __init__(self, source: ChunkSource, limit_bytes: int) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._buffer = StagingBuffer(limit_bytes)
        self._pending: dict[str, cf.Future[bool]] = {}
        self._tasks: set[cf.Future[None]] = set()
        self._group = 0
        self._closed = False
        self._hits = self._misses = self._prefetched = self._used = 0
        self._wasted = self._evictions = self._refused = 0

    # ------------------------------------------------------------ public

    def stage(self, keys: Sequence[str], *, present: int | None = None) -> int:
        """Start fetching the present leading part of ``keys``; never blocks.

        ``present``: how many leading keys the caller already knows to be stored (skips the prefix
        call). Keys already staged or in flight are not fetched again. Returns how many keys were
        scheduled (before knowing which are present).
        """
        keys = list(keys if present is None else keys[:present])
        with self._lock:
            if self._closed or not keys:
                return 0
            fresh = [k for k in dict.fromkeys(keys) if k not in self._pending and k not in self._buffer]
            if not fresh:
                return 0
            self._group += 1
            group = self._group
            mine: dict[str, cf.Future[bool]] = {k: cf.Future() for k in fresh}
            self._pending.update(mine)
        try:
            task = self._source.spawn(self._fetch(keys, mine, group, present is not None))
        except Exception:
            self._settle(mine, group)
            raise
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return len(fresh)

    def tracks(self, key: str) -> bool:
        """Whether ``key`` is staged or in flight (a get would not go to the network)."""
        with self._lock:
            return key in self._pending or self._buffer.is_ready(key)

    async def get(self, key: str, *, fallback: bool = False) -> bytearray | None:
        """The staged payload of ``key``, waiting for its fetch if it is in flight.

        A miss returns None, or with ``fallback`` fetches the chunk from the source (not staged).
        """
        with self._lock:
            data = self._take(key)
            pending = self._pending.get(key) if data is None else None
        if data is None and pending is not None:
            ok = await wait_shared(pending)
            if ok:
                with self._lock:
                    data = self._take(key)
        if data is not None:
            return data
        with self._lock:
            self._misses += 1
        if fallback:
            return await self._source.get(key, quiet=True)
        return None

    def discard(self, keys: Sequence[str]) -> None:
        """Forget staged payloads of ``keys`` (counted as wasted); in-flight ones are left alone."""
        with self._lock:
            for key in keys:
                if self._buffer.is_ready(key):
                    self._wasted += self._buffer.release(key)

    def stats(self) -> PrefetchStats:
        with self._lock:
            return PrefetchStats(
                staged_hits=self._hits,
                misses=self._misses,
                prefetched_bytes=self._prefetched,
                used_bytes=self._used,
                wasted_bytes=self._wasted,
                evictions=self._evictions,
                refused=self._refused,
                staged_now=self._buffer.used,
            )

    def close(self) -> None:
        """Cancel fetches in flight and drop staged payloads (counted as wasted)."""
        with self._lock:
            self._closed = True
            tasks = list(self._tasks)
            pending = list(self._pending.values())
            self._pending.clear()
            self._wasted += self._buffer.clear()
        for task in tasks:
            task.cancel()
        for future in pending:
            with contextlib.suppress(cf.InvalidStateError):
                future.set_result(False)

    # ------------------------------------------------------------ internals (locked or I/O loop)

    def _take(self, key: str) -> bytearray | None:
        data = self._buffer.take(key)
        if data is not None:
            self._hits += 1
            self._used += len(data)
        return data

    def _settle(self, futures: dict[str, cf.Future[bool]], group: int) -> None:
        """Fail the futures of ``futures`` still pending (and drop their reservations), touching
        nothing a later stage call created for the same keys."""
        failed = []
        with self._lock:
            for key, future in futures.items():
                if self._pending.get(key) is future:
                    del self._pending[key]
                    failed.append(future)
                self._buffer.release_reservation(key, group)
        for future in failed:
            with contextlib.suppress(cf.InvalidStateError):
                future.set_result(False)

    def _task_done(self, task: cf.Future[None]) -> None:
        with self._lock:
            self._tasks.discard(task)

    async def _fetch(self, keys: list[str], mine: dict[str, cf.Future[bool]], group: int, known: bool) -> None:
        """On the source's loop: prefix (unless known), then one batch-get of the fresh present keys."""
        try:
            present = len(keys) if known else await self._source.prefix(keys, quiet=True)
            wanted = set(keys[:present])
            self._settle({k: f for k, f in mine.items() if k not in wanted}, group)
            fetch = [k for k in mine if k in wanted]
            if fetch:
                buffers: dict[int, bytearray] = {}
                await self._source.batch_get_into(
                    fetch,
                    self._provider(fetch, mine, group, buffers),
                    on_item=lambda item: self._landed(fetch, mine, group, buffers, item),
                    quiet=True,
                )
        finally:
            self._settle(mine, group)  # whatever did not land; a no-op for the rest

    def _provider(
        self, fetch: list[str], mine: dict[str, cf.Future[bool]], group: int, buffers: dict[int, bytearray]
    ) -> BufferProvider:
        def into(index: int, length: int) -> memoryview | None:
            key = fetch[index]
            with self._lock:
                if self._closed or self._pending.get(key) is not mine[key]:
                    return None
                evicted = self._buffer.reserve(key, length, group)
                if evicted is None:
                    self._refused += 1
                    return None
                for _, size in evicted:
                    self._evictions += 1
                    self._wasted += size
            buf = bytearray(length)
            buffers[index] = buf
            return memoryview(buf)

        return into

    def _landed(
        self,
        fetch: list[str],
        mine: dict[str, cf.Future[bool]],
        group: int,
        buffers: dict[int, bytearray],
        item: BatchItem,
    ) -> None:
        key = fetch[item.index]
        future = mine[key]
        buf = buffers.pop(item.index, None)
        ok = False
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
                if item.ok and buf is not None and not self._closed:
                    self._buffer.commit(key, buf)
                    self._prefetched += len(buf)
                    ok = True
            if not ok:
                self._buffer.release_reservation(key, group)
        with contextlib.suppress(cf.InvalidStateError):
            future.set_result(ok)
