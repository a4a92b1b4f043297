"""CPU staging prefetcher: fetch a request's chunks from kvgw ahead of use, serve them from memory.

``stage(keys)`` returns at once. In the background it asks the gateway how many leading keys are
present (``prefix``, skipped when the caller already knows) and streams those chunks with one
batch-get into a bounded ``StagingBuffer``. A later ``get(key)`` takes a staged chunk from memory;
for a chunk still in flight it waits for that fetch instead of fetching it again. A miss returns
None and the caller fetches the chunk itself.

Where staged bytes live is the ``StagingSink``'s business: ``BytesSink`` keeps bytearrays; the LMCache
connector's sink lands payloads straight in LMCache ``MemoryObj``s, so a staged hit hands LMCache
the very object it would have allocated, without a copy.

Memory: a payload's bytes are reserved in the buffer (evicting least recently staged, unused chunks
of other requests if needed) before the sink allocates anything, so staged plus in-flight bytes
never exceed the limit. A request stages a prefix: keys of one ``stage`` call (including ones staged
by an earlier call for the same request, which LMCache makes at lookup and again at retrieve) never
evict each other, and the first payload that does not fit ends the fetch, since a prefix reader
cannot use what comes after a gap. With ``expected_size`` the prefetcher does not even ask for chunks
it has no room for. ``get`` hands the payload over and drops it from the buffer (a one-shot handoff).

Threading: all methods are safe from any thread or event loop. State sits behind one lock held only
for bookkeeping; fetches, sink calls and copies run on the source's I/O loop (``ChunkSource.spawn``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvgw_client.framing import BatchItem, BufferProvider, Destination, ItemStatus
from kvgw_client.loop import wait_shared

T = TypeVar("T")
H = TypeVar("H")


class ChunkSource(Protocol):
    """What the prefetcher needs from a client (``KvgwClient`` provides it)."""

    def spawn(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]: ...

    async def prefix(self, keys: Sequence[str], *, quiet: bool = ..., timeout: float | None = ...) -> int: ...

    def batch_get(
        self, keys: Sequence[str], *, into: BufferProvider | None = ..., quiet: bool = ...
    ) -> AsyncIterator[BatchItem]: ...


class StagingSink(Protocol[H]):
    """Where staged payloads live. Called on the source's I/O thread, never under the prefetcher's lock.

    ``open`` gives the destination of a ``length``-byte payload and a handle for it (None: cannot
    allocate now; the payload is refused). ``seal`` is called once the payload arrived and verified and
    says whether it is usable (if not, the sink has released it). ``drop`` releases a handle that will
    never be handed out (sealed or not).
    """

    def open(self, key: str, length: int) -> tuple[Destination, H] | None: ...

    def seal(self, handle: H, length: int) -> bool: ...

    def drop(self, handle: H) -> None: ...


class BytesSink:
    """Staged payloads as bytearrays."""

    def open(self, key: str, length: int) -> tuple[Destination, bytearray]:
        buf = bytearray(length)
        return memoryview(buf), buf

    def seal(self, handle: bytearray, length: int) -> bool:
        return True

    def drop(self, handle: bytearray) -> None:
        pass


@dataclass(slots=True)
class _Entry(Generic[H]):
    size: int
    group: int  # the fetch that reserved it
    request: int  # the latest stage call that wanted it: that call's reservations never evict it
    data: H | None = None  # None while reserved (payload in flight)


class StagingBuffer(Generic[H]):
    """An LRU of payloads under a hard byte limit, with reservations for payloads in flight.

    Not thread-safe; the owner locks. Reserved entries are never evicted; neither are entries the
    reserving request wants.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("staging limit must be positive")
        self.limit = limit
        self.used = 0
        self._entries: OrderedDict[str, _Entry[H]] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def is_ready(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.data is not None

    def reserved_by(self, key: str, group: int) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.data is None and entry.group == group

    def adopt(self, key: str, request: int) -> bool:
        """Make an entry (ready or in flight) part of ``request``, so its reservations never evict it."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.request = request
        self._entries.move_to_end(key)
        return True

    def room_for(self, request: int) -> int:
        """Bytes ``request`` could reserve: free space plus ready entries other requests staged."""
        evictable = sum(e.size for e in self._entries.values() if e.data is not None and e.request != request)
        return self.limit - self.used + evictable

    def _make_room(self, need: int, request: int) -> list[tuple[str, int, H]] | None:
        if need <= 0:
            return []
        victims: list[str] = []
        freed = 0
        for k, entry in self._entries.items():
            if entry.data is None or entry.request == request:
                continue
            victims.append(k)
            freed += entry.size
            if freed >= need:
                break
        if freed < need:
            return None
        evicted: list[tuple[str, int, H]] = []
        for k in victims:
            entry = self._entries.pop(k)
            self.used -= entry.size
            assert entry.data is not None
            evicted.append((k, entry.size, entry.data))
        return evicted

    def reserve(self, key: str, size: int, group: int) -> list[tuple[str, int, H]] | None:
        """Reserve ``size`` bytes for ``key``. Returns the (key, size, data) of entries evicted to make
        room, or None (and evicts nothing) when the reservation cannot fit."""
        if key in self._entries:
            raise KeyError(f"{key!r} is already staged")
        if size > self.limit:
            return None
        evicted = self._make_room(self.used + size - self.limit, group)
        if evicted is None:
            return None
        self._entries[key] = _Entry(size, group, group)
        self.used += size
        return evicted

    def resize(self, key: str, size: int, group: int) -> list[tuple[str, int, H]] | None:
        """Change the size of ``group``'s reservation of ``key`` (the payload turned out to differ from
        the expected size); None (nothing changed) when it cannot grow that much."""
        entry = self._entries[key]
        if entry.data is not None or entry.group != group:
            raise KeyError(f"{key!r} is not reserved by this fetch")
        if size > self.limit:
            return None
        evicted = self._make_room(self.used - entry.size + size - self.limit, entry.request)
        if evicted is None:
            return None
        self.used += size - entry.size
        entry.size = size
        return evicted

    def commit(self, key: str, data: H, size: int) -> None:
        entry = self._entries[key]
        if entry.data is not None or size != entry.size:
            raise ValueError("commit does not match the reservation")
        entry.data = data
        self._entries.move_to_end(key)

    def release(self, key: str) -> tuple[int, H | None]:
        """Drop an entry (reserved or ready); returns its size (0 if absent) and its data."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0, None
        self.used -= entry.size
        return entry.size, entry.data

    def release_reservation(self, key: str, group: int) -> bool:
        """Drop ``key`` if it is still a reservation of ``group``."""
        entry = self._entries.get(key)
        if entry is None or entry.data is not None or entry.group != group:
            return False
        del self._entries[key]
        self.used -= entry.size
        return True

    def take(self, key: str) -> tuple[int, H] | None:
        """Remove and return a ready payload with its size; None if absent or still in flight."""
        entry = self._entries.get(key)
        if entry is None or entry.data is None:
            return None
        del self._entries[key]
        self.used -= entry.size
        return entry.size, entry.data

    def clear(self) -> tuple[int, list[H]]:
        """Drop everything; returns the bytes and the data of the ready payloads dropped."""
        ready = [e for e in self._entries.values() if e.data is not None]
        self._entries.clear()
        self.used = 0
        return sum(e.size for e in ready), [e.data for e in ready if e.data is not None]


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    staged_hits: int  # gets served from memory (including ones that waited for an in-flight fetch)
    misses: int  # gets of keys that were not staged, or whose fetch failed
    prefetched_bytes: int  # payload bytes that landed in the buffer
    used_bytes: int  # of those, bytes handed to a get
    wasted_bytes: int  # bytes prefetched but never used: evicted, discarded, or dropped at close
    evictions: int
    refused: int  # chunks not staged for lack of room (the limit, or the sink could not allocate)
    staged_now: int  # bytes in the buffer (ready and reserved)


class Prefetcher(Generic[H]):
    def __init__(self, source: ChunkSource, limit_bytes: int, sink: StagingSink[H]) -> None:
        self._source = source
        self._sink = sink
        self._lock = threading.Lock()
        self._buffer: StagingBuffer[H] = StagingBuffer(limit_bytes)
        self._pending: dict[str, cf.Future[bool]] = {}
        self._tasks: set[cf.Future[None]] = set()
        self._group = 0
        self._closed = False
        self._hits = self._misses = self._prefetched = self._used = 0
        self._wasted = self._evictions = self._refused = 0

    @property
    def limit(self) -> int:
        return self._buffer.limit

    # ------------------------------------------------------------ public

    def stage(self, keys: Sequence[str], *, present: int | None = None, expected_size: int | None = None) -> int:
        """Start fetching the present leading part of ``keys``; never blocks.

        ``present``: how many leading keys the caller already knows to be stored (skips the prefix
        call). ``expected_size``: the size of a chunk, when the caller knows it; keys beyond what the
        buffer can hold are then not fetched at all. Keys already staged or in flight are not fetched
        again. Returns how many keys were scheduled (before knowing which are present).
        """
        keys = list(keys if present is None else keys[:present])
        evicted: list[tuple[str, int, H]] = []
        with self._lock:
            if self._closed or not keys:
                return 0
            self._group += 1
            group = self._group
            for key in keys:
                self._buffer.adopt(key, group)
            fresh = [k for k in dict.fromkeys(keys) if k not in self._pending and k not in self._buffer]
            if expected_size is not None and expected_size > 0:
                for n, key in enumerate(fresh):  # reserve now, so fetches in flight are accounted for
                    made = self._buffer.reserve(key, expected_size, group)
                    if made is None:
                        self._refused += len(fresh) - n
                        fresh = fresh[:n]
                        break
                    evicted += made
                self._note_evicted(evicted)
            mine: dict[str, cf.Future[bool]] = {k: cf.Future() for k in fresh}
            self._pending.update(mine)
        self._drop_all([data for _, _, data in evicted])
        if not mine:
            return 0
        try:
            task = self._source.spawn(self._fetch(keys, mine, group, present is not None))
        except Exception:
            self._settle(mine, group)
            raise
        with self._lock:
            self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return len(fresh)

    def ready(self, key: str) -> bool:
        """Whether ``key`` is staged and landed (a get would not wait)."""
        with self._lock:
            return self._buffer.is_ready(key)

    def tracks(self, key: str) -> bool:
        """Whether ``key`` is staged or in flight (a get would not go to the network)."""
        with self._lock:
            return key in self._pending or self._buffer.is_ready(key)

    def take_ready(self, keys: Sequence[str]) -> list[H] | None:
        """All of ``keys`` if every one is staged and landed (now the caller's), else None and nothing
        taken: the no-wait path for a get whose chunks are already in memory."""
        with self._lock:
            if not keys or len(set(keys)) != len(keys) or not all(self._buffer.is_ready(k) for k in keys):
                return None
            taken = [self._take(k) for k in keys]
        return [h for h in taken if h is not None]

    async def get(self, key: str) -> H | None:
        """The staged payload of ``key`` (now the caller's), waiting for its fetch if it is in flight;
        None on a miss."""
        with self._lock:
            data = self._take(key)
            pending = self._pending.get(key) if data is None else None
        if data is None and pending is not None:
            ok = await wait_shared(pending)
            if ok:
                with self._lock:
                    data = self._take(key)
        if data is None:
            with self._lock:
                self._misses += 1
        return data

    def discard(self, keys: Sequence[str]) -> None:
        """Forget staged payloads of ``keys`` (counted as wasted); in-flight ones are left alone."""
        dropped = []
        with self._lock:
            for key in keys:
                if self._buffer.is_ready(key):
                    size, data = self._buffer.release(key)
                    self._wasted += size
                    dropped.append(data)
        self._drop_all(dropped)

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
            size, dropped = self._buffer.clear()
            self._wasted += size
        self._drop_all(dropped)
        for task in tasks:
            task.cancel()
        for future in pending:
            with contextlib.suppress(cf.InvalidStateError):
                future.set_result(False)

    # ------------------------------------------------------------ internals (locked or I/O loop)

    def _note_evicted(self, evicted: list[tuple[str, int, H]]) -> None:
        for _, size, _ in evicted:
            self._evictions += 1
            self._wasted += size

    def _drop_all(self, handles: Sequence[H | None]) -> None:
        for handle in handles:
            if handle is not None:
                self._sink.drop(handle)

    def _take(self, key: str) -> H | None:
        taken = self._buffer.take(key)
        if taken is None:
            return None
        self._hits += 1
        self._used += taken[0]
        return taken[1]

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
        """On the source's loop: prefix (unless known), then one batch-get of the fresh present keys,
        ended early by the first payload that cannot be staged."""
        try:
            present = len(keys) if known else await self._source.prefix(keys, quiet=True)
            wanted = set(keys[:present])
            self._settle({k: f for k, f in mine.items() if k not in wanted}, group)
            fetch = [k for k in mine if k in wanted]
            if not fetch:
                return
            handles: dict[int, H] = {}
            items = self._source.batch_get(fetch, into=self._provider(fetch, mine, group, handles), quiet=True)
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for item in items:
                    if not self._landed(fetch, mine, group, handles, item):
                        with self._lock:
                            self._refused += len(fetch) - item.index
                        break
        finally:
            self._settle(mine, group)  # whatever did not land; a no-op for the rest

    def _provider(
        self, fetch: list[str], mine: dict[str, cf.Future[bool]], group: int, handles: dict[int, H]
    ) -> BufferProvider:
        def into(index: int, length: int) -> Destination | None:
            key = fetch[index]
            with self._lock:
                if self._closed or self._pending.get(key) is not mine[key]:
                    return None
                if self._buffer.reserved_by(key, group):
                    evicted = self._buffer.resize(key, length, group)
                else:
                    evicted = self._buffer.reserve(key, length, group)
                if evicted is None:
                    return None
                self._note_evicted(evicted)
            self._drop_all([data for _, _, data in evicted])
            opened = self._sink.open(key, length)
            if opened is None:
                with self._lock:
                    self._buffer.release_reservation(key, group)
                return None
            dest, handles[index] = opened
            return dest

        return into

    def _landed(
        self, fetch: list[str], mine: dict[str, cf.Future[bool]], group: int, handles: dict[int, H], item: BatchItem
    ) -> bool:
        """Settle one item; False when it was refused for lack of room (the rest is not worth staging)."""
        key = fetch[item.index]
        future = mine[key]
        handle = handles.pop(item.index, None)
        usable = item.ok and handle is not None and self._sink.seal(handle, item.length)
        ok = False
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
                if usable and not self._closed:
                    assert handle is not None
                    self._buffer.commit(key, handle, item.length)
                    self._prefetched += item.length
                    ok = True
            if not ok:
                self._buffer.release_reservation(key, group)
        if not ok and handle is not None and (usable or not item.ok):
            self._sink.drop(handle)  # unsealed, or sealed but no longer wanted
        with contextlib.suppress(cf.InvalidStateError):
            future.set_result(ok)
        return item.status is not ItemStatus.REFUSED
