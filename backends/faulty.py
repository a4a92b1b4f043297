"""A fault-injecting tier: wraps any ``Tier`` and makes chosen operations fail, slow down or hang.

Why it exists: the service's answers to a full disk, a dead NFS server or an S3 endpoint that stops
answering are its most important behaviours and the hardest to provoke with real storage. With no
fault injected the wrapper is transparent (the tier contract suite runs through it unchanged)::

    tier = FaultyTier(MemoryTier())
    full = tier.inject(Fault("publish", error=errno.ENOSPC, times=1))   # the next publish: StorageFull
    gate = asyncio.Event()
    tier.inject(Fault("read", hang=gate, digest=d))                      # reads of d wait for gate.set()
    await full.triggered.wait()                                          # ...after the fault has fired
    tier.clear()

What a caller must know:

- ``error`` is raised as the real tiers would raise it, through their own translation: an int is an
  errno, mapped exactly as the POSIX tier maps an ``OSError`` with it (``ENOSPC``/``EDQUOT`` →
  ``StorageFull``, ``EIO``/``ESTALE``/``ETIMEDOUT`` → ``TierUnavailable``, ``ENOENT`` →
  ``ChunkNotFound``, others → ``BackendError``); any other foreign exception (``TimeoutError``,
  a botocore ``ClientError``) is mapped as the S3 tier maps it (``TimeoutError`` →
  ``TierUnavailable``); a ``BackendError`` instance is raised as it is. An exception class is
  instantiated with a message naming the operation. The foreign exception is the ``__cause__``, as at
  the real boundaries. The POSIX mapping is the one the POSIX tier uses
  (``backends.fileio.translate_oserror``), so they cannot drift.
- A fault fires before the wrapped operation runs, in this order: ``delay`` (through the tier's
  ``sleep``, injectable so tests need no wall clock), then ``hang`` (until the event is set; the wait
  is cancellable), then ``error``. A fault without ``error`` lets the operation run afterwards. A
  failed ``publish`` discards the wrapped staged write first, as real tiers clean their staging on a
  failed publish: nothing becomes visible. A failed ``write`` leaves the caller to ``discard``.
- Counting: every call that matches a rule's ``op``, ``digest`` and ``when`` counts; the first
  ``after`` matching calls pass, then the rule fires ``times`` times (None: for ever). ``stream`` and
  ``scan`` make one call when opened and one more before each piece or entry after the first, so
  ``after=N`` lets exactly N pieces through and then fails the iteration. ``stat_many`` matches a
  ``digest`` rule if the digest is among those asked (the whole call fails, like a real I/O error).
- Every matching rule counts the call; those due fire in injection order, and the first error ends it.
- Not faultable: ``discard`` and ``close`` (cleanup paths that must run). The wrapper hides
  ``FileLocator`` (a wrapped POSIX tier is served through ``read``/``stream``, never located).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from backends.base import ChunkMeta, StagedChunk, Tier
from backends.errors import BackendError
from backends.fileio import translate_oserror
from backends.s3_guard import translate as _translate_foreign

__all__ = ["OPS", "Fault", "FaultyStagedChunk", "FaultyTier", "injected_error"]

OPS = frozenset({
    "stage", "write", "publish", "read", "stream", "stat", "stat_many", "delete", "quarantine", "scan",
    "cleanup_staging", "usage",
})

_WHAT = {  # the operation names the real tiers put in their messages
    "stage": "stage chunk", "write": "write staged chunk", "publish": "publish chunk", "read": "read chunk",
    "stream": "stream chunk", "stat": "stat chunk", "stat_many": "stat chunks", "delete": "delete chunk",
    "quarantine": "quarantine chunk", "scan": "scan chunk directory", "cleanup_staging": "clean staging area",
    "usage": "measure tier usage",
}

ErrorSpec = int | BaseException | type[BaseException]


@dataclass(eq=False)
class Fault:
    """One injection rule (see the module docstring). The last three fields are its record so far."""

    op: str | tuple[str, ...]  # operation name(s), from OPS
    error: ErrorSpec | None = None  # errno, foreign exception, or BackendError (class or instance)
    delay: float = 0.0  # seconds passed to the tier's sleep function
    hang: asyncio.Event | None = None  # block until set (or until the caller is cancelled)
    digest: bytes | None = None  # only calls about this chunk
    when: Callable[[str, bytes | None], bool] | None = None  # only calls (op, digest or None) it accepts
    after: int = 0  # matching calls let through before the rule fires
    times: int | None = None  # how many times it fires; None: every matching call after ``after``
    calls: int = field(default=0, init=False)  # matching calls seen
    fired: int = field(default=0, init=False)
    triggered: asyncio.Event = field(default_factory=asyncio.Event, init=False)  # set when it first fires

    def __post_init__(self) -> None:
        ops = (self.op,) if isinstance(self.op, str) else self.op
        unknown = set(ops) - OPS
        if unknown or not ops:
            raise ValueError(f"unknown tier operation(s) {sorted(unknown)}; choose from {sorted(OPS)}")
        if self.after < 0 or (self.times is not None and self.times < 0) or self.delay < 0:
            raise ValueError("after, times and delay must not be negative")
        self._ops = frozenset(ops)

    def _matches(self, op: str, digests: tuple[bytes, ...]) -> bool:
        if op not in self._ops:
            return False
        if self.digest is not None and self.digest not in digests:
            return False
        if self.when is None:
            return True
        return any(self.when(op, d) for d in digests) if digests else self.when(op, None)

    def _count(self) -> bool:
        """Count one matching call; True if the rule fires on it."""
        self.calls += 1
        if self.calls <= self.after or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        self.triggered.set()
        return True


def injected_error(error: ErrorSpec, what: str) -> BackendError:
    """The backend error a real tier raises for ``error`` (its ``__cause__`` set to the foreign one)."""
    what = f"{what} (injected)"
    cause: BaseException
    if isinstance(error, int):
        cause = os_error = OSError(error, os.strerror(error))  # ENOENT gives a FileNotFoundError, as os does
        translated = translate_oserror(os_error, what)
    else:
        cause = error(what) if isinstance(error, type) else error
        if isinstance(cause, BackendError):
            return cause
        translated = _translate_foreign(cause, what)
    translated.__cause__ = cause
    return translated


class FaultyTier:
    """A ``Tier`` that forwards to ``inner`` except where an injected ``Fault`` says otherwise."""

    def __init__(self, inner: Tier, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 name: str | None = None) -> None:
        """``sleep`` serves ``Fault.delay``: pass a fake that records or advances a test clock."""
        self.inner = inner
        self.name = inner.name if name is None else name
        self.sleep = sleep
        self.faults: list[Fault] = []
        self.calls: Counter[str] = Counter()  # operations attempted, by name, faulted or not

    def inject(self, fault: Fault) -> Fault:
        """Add a rule; returns it, so the test can watch ``fired`` / ``triggered``."""
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every rule (operations already hanging keep waiting for their event)."""
        self.faults.clear()

    async def check(self, op: str, *digests: bytes) -> None:
        """Apply the rules due for one call of ``op`` (used by the wrapper's methods)."""
        self.calls[op] += 1
        due = [fault for fault in self.faults if fault._matches(op, digests) and fault._count()]
        for fault in due:
            if fault.delay:
                await self.sleep(fault.delay)
            if fault.hang is not None:
                await fault.hang.wait()
            if fault.error is not None:
                raise injected_error(fault.error, _WHAT[op])

    async def stage(self, digest: bytes) -> FaultyStagedChunk:
        await self.check("stage", digest)
        return FaultyStagedChunk(self, digest, await self.inner.stage(digest))

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        await self.check("read", digest)
        return await self.inner.read(digest, offset, length, checksum=checksum)

    async def stream(self, digest: bytes, offset: int, length: int, window: int
                     ) -> AsyncIterator[bytes | memoryview]:
        await self.check("stream", digest)
        pieces = self.inner.stream(digest, offset, length, window)
        try:
            first = True
            async for piece in pieces:
                if not first:
                    await self.check("stream", digest)
                first = False
                yield piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]

    async def stat(self, digest: bytes) -> ChunkMeta:
        await self.check("stat", digest)
        return await self.inner.stat(digest)

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        await self.check("stat_many", *digests)
        return await self.inner.stat_many(digests)

    def absent_now(self, digests: list[bytes]) -> bool:
        return False  # its faults are injected where it waits: ask stat_many

    async def delete(self, digest: bytes) -> bool:
        await self.check("delete", digest)
        return await self.inner.delete(digest)

    async def quarantine(self, digest: bytes) -> bool:
        await self.check("quarantine", digest)
        return await self.inner.quarantine(digest)

    async def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        await self.check("scan")
        entries = self.inner.scan()
        try:
            first = True
            async for entry in entries:
                if not first:
                    await self.check("scan")
                first = False
                yield entry
        finally:
            await entries.aclose()  # type: ignore[attr-defined]

    async def cleanup_staging(self, older_than: float) -> int:
        await self.check("cleanup_staging")
        return await self.inner.cleanup_staging(older_than)

    async def usage(self) -> int:
        await self.check("usage")
        return await self.inner.usage()

    async def close(self) -> None:
        await self.inner.close()


class FaultyStagedChunk:
    """The wrapped tier's staged write, with ``write`` and ``publish`` faultable."""

    def __init__(self, tier: FaultyTier, digest: bytes, inner: StagedChunk) -> None:
        self._tier = tier
        self._digest = digest
        self.inner = inner

    async def write(self, data: bytes | memoryview) -> None:
        await self._tier.check("write", self._digest)
        await self.inner.write(data)

    async def publish(self, meta: ChunkMeta) -> bool:
        try:
            await self._tier.check("publish", self._digest)
        except BackendError:
            await self.inner.discard()
            raise
        return await self.inner.publish(meta)

    async def discard(self) -> None:
        await self.inner.discard()
