"""The memory tier: the whole ``Tier`` contract over a dict, for tests that need a tier but not a disk.

Why it exists: the service, the lifecycle engine and fault-injection tests (``backends.faulty``) can run
in-process in milliseconds over a tier that keeps every promise of ``backends.base``, checked by the
same contract suite as the POSIX and S3 tiers (``tests/integration/test_tier_contract.py``).

What a caller must know:

- Storage is a ``MemoryStore``. Tiers built on the same store are "several gateways on one shared
  mount": they see each other's chunks and staging leftovers. A tier built without one gets its own.
- Nothing ever suspends: every ``await`` on this tier completes without yielding to other tasks, so
  publish is atomic without locks and tests are deterministic. To interleave tasks around a tier
  operation, wrap the tier in ``FaultyTier`` and inject a hang or latency.
- ``read`` and ``stream`` return read-only views of the stored bytes (no copy); ``write`` copies its
  argument, so a caller may reuse its buffer at once.
- ``usage`` counts data bytes only (the real tiers also count their metadata footers).
- A chunk whose recorded size disagrees with its bytes, or whose metadata was damaged
  (``MemoryStore.damage``, the analogue of a cut footer), is unreadable metadata: ``stat`` raises
  ``ChunkCorrupt``, ``stat_many`` and ``scan`` report None; its bytes stay readable, as on disk.
- Errors: ``ChunkNotFound`` for absent chunks, ``ChunkCorrupt`` as above, ``BackendError`` for misuse
  (a negative range, a write after publish, a publish of a write ``cleanup_staging`` removed). Never
  ``StorageFull`` or ``TierUnavailable``: inject those with ``FaultyTier``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from backends.base import ChunkMeta, check_bytes_soon
from backends.errors import BackendError, ChunkCorrupt, ChunkNotFound


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A published chunk: its bytes and its recorded metadata (None: unreadable)."""

    data: bytes
    meta: ChunkMeta | None

    def readable_meta(self) -> ChunkMeta | None:
        """The metadata if it is intact and agrees with the bytes, like a footer that decodes."""
        if self.meta is None or self.meta.size != len(self.data):
            return None
        return self.meta


@dataclass(eq=False)
class MemoryStore:
    """What the memory tiers sharing it hold. Tests may inspect (and damage) it behind the tiers' back."""

    chunks: dict[bytes, StoredChunk] = field(default_factory=dict)
    staging: set[MemoryStagedChunk] = field(default_factory=set)  # writes neither published nor discarded
    quarantined: list[tuple[bytes, StoredChunk]] = field(default_factory=list)

    def damage(self, digest: bytes) -> None:
        """Make a published chunk's metadata unreadable (its bytes stay). ChunkNotFound if absent."""
        stored = self.chunks.get(digest)
        if stored is None:
            raise ChunkNotFound(f"damage chunk: {digest.hex()}")
        self.chunks[digest] = replace(stored, meta=None)


class MemoryStagedChunk:
    """One write in progress: bytes accumulate privately and become visible only at ``publish``."""

    def __init__(self, tier: MemoryTier, digest: bytes) -> None:
        self._tier = tier
        self._digest = digest
        self._buffer = bytearray()
        self._done = False  # published or discarded
        self.last_write = tier.clock()

    @property
    def owner(self) -> MemoryTier:
        return self._tier

    @property
    def size(self) -> int:
        return len(self._buffer)

    def _check_open(self, what: str) -> None:
        if self._done:
            raise BackendError(f"{what}: the staged chunk was already published or discarded")
        if self not in self._tier.store.staging:
            raise BackendError(f"{what}: the staged chunk was removed by cleanup_staging")

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open("write staged chunk")
        self._buffer += data
        self.last_write = self._tier.clock()

    async def publish(self, meta: ChunkMeta) -> bool:
        """Create-if-absent; the staging entry is gone afterwards whatever the answer."""
        self._check_open("publish chunk")
        store = self._tier.store
        self._finish()
        if self._digest in store.chunks:
            return False
        store.chunks[self._digest] = StoredChunk(bytes(self._buffer), meta)
        return True

    async def discard(self) -> None:
        """Drop the staged bytes; a no-op after publish, after discard or after cleanup_staging."""
        if not self._done:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        self._tier.store.staging.discard(self)


class MemoryTier:
    """A ``Tier`` whose chunks live in a ``MemoryStore`` (see the module docstring for the caveats)."""

    def __init__(self, store: MemoryStore | None = None, *, name: str = "memory",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` dates staged writes for ``cleanup_staging`` (inject one to age them in tests)."""
        self.store = store if store is not None else MemoryStore()
        self.name = name
        self.clock = clock
        self.closed = False

    def _get(self, digest: bytes, what: str) -> StoredChunk:
        stored = self.store.chunks.get(digest)
        if stored is None:
            raise ChunkNotFound(f"{what}: {digest.hex()}")
        return stored

    async def stage(self, digest: bytes) -> MemoryStagedChunk:
        staged = MemoryStagedChunk(self, digest)
        self.store.staging.add(staged)
        return staged

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        if offset < 0 or length < 0:
            raise BackendError(f"read chunk: invalid range offset={offset} length={length}")
        data = memoryview(self._get(digest, "read chunk").data)[offset : offset + length]
        await check_bytes_soon(data, checksum)
        return data

    async def stream(self, digest: bytes, offset: int, length: int, window: int
                     ) -> AsyncIterator[bytes | memoryview]:
        if offset < 0 or length < 0 or window < 1:
            raise BackendError(f"stream chunk: invalid range offset={offset} length={length} window={window}")
        view = memoryview(self._get(digest, "stream chunk").data)
        end = min(offset + length, len(view))
        while offset < end:
            n = min(window, end - offset)
            yield view[offset : offset + n]
            offset += n

    async def stat(self, digest: bytes) -> ChunkMeta:
        meta = self._get(digest, "stat chunk").readable_meta()
        if meta is None:
            raise ChunkCorrupt("chunk metadata is missing or damaged", location=digest.hex())
        return meta

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        found = [self.store.chunks.get(digest) for digest in digests]
        return [None if stored is None else stored.readable_meta() for stored in found]

    def absent_now(self, digests: list[bytes]) -> bool:
        chunks = self.store.chunks
        return not any(digest in chunks for digest in digests)

    async def delete(self, digest: bytes) -> bool:
        return self.store.chunks.pop(digest, None) is not None

    async def quarantine(self, digest: bytes) -> bool:
        stored = self.store.chunks.pop(digest, None)
        if stored is None:
            return False
        self.store.quarantined.append((digest, stored))
        return True

    async def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        """Ascending digest order, like the index and the real tiers; a snapshot taken at the start."""
        for digest, stored in sorted(self.store.chunks.items()):
            yield digest, stored.readable_meta()

    async def cleanup_staging(self, older_than: float) -> int:
        """Remove other tiers' staged writes idle for at least ``older_than`` seconds, and every staged
        write of a closed tier (a dead writer). This tier's own writes in progress are never removed."""
        now = self.clock()
        doomed = [
            staged for staged in self.store.staging
            if staged.owner is not self and (staged.owner.closed or now - staged.last_write >= older_than)
        ]
        self.store.staging.difference_update(doomed)
        return len(doomed)

    async def usage(self) -> int:
        return sum(len(stored.data) for stored in self.store.chunks.values())

    async def close(self) -> None:
        """The store outlives the tier; this tier's unfinished writes become a dead writer's leftovers."""
        self.closed = True
