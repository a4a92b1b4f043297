"""The request path's patience with a networked tier: a per-call budget carried in a context variable, and
the view of the S3 tier that the chunk service holds.

Why it exists: the S3 tier's own budgets are made for background work (a 30 s operation deadline,
retries seconds apart), which is right for the lifecycle engine and wrong for a client waiting on an
``exists``: with the endpoint hung, every lookup that missed the index waited 30 s. A call made while a
client waits has a budget of its own instead:

- ``request_budget(timeout)``: inside the block, every call a networked tier makes must get its *first
  answer* (a HEAD's reply, a GET's headers) within ``timeout`` seconds of starting, all attempts and
  back-offs included; a transfer that has its answer (a GET's body) then continues under the tier's own
  budgets. A tier that honours the budget (``backends.s3``) ends a call that ran out with
  ``TierUnavailable`` and counts it for its circuit breaker like an error, so a hung endpoint trips the
  breaker as a dead one does. Tasks created inside the block inherit the budget (asyncio copies the
  context into a new task): a promotion that readers share runs under its first reader's, and marks it
  ``unavailable`` when S3 did not answer, so that its reader does not try again. Work started
  outside any block (the lifecycle engine, write-through, prefetch, uploads) keeps the tier's budgets.
- ``RequestPathTier``: the service's view of the S3 tier. ``stat`` / ``stat_many`` (lookups: the footer
  read behind exists, prefix, HEAD and the pre-write check on an index miss) run under
  ``lookup_timeout``; ``read``, the opening of ``stream`` and ``delete`` under ``request_timeout``;
  writes (``stage``, the staged chunk), ``quarantine`` (a server-side copy) and the background
  operations (``scan``, ``usage``, ``cleanup_staging``) are forwarded unchanged, since a transfer takes
  what its bytes need. Lookups and deletes also get a deadline of the view's own, so that no tier,
  honouring the budget or not, holds a request longer than its budget allows (``lookup_timeout`` per
  round of ``lookup_batch`` footer reads, plus one; three ``request_timeout`` for a delete; plus the
  S3 tier's ``connect_timeout``, which its first call may take to connect): past it they raise
  ``TierUnavailable``.

What the caller does with ``TierUnavailable`` is the service's rule (``gateway.service``): a non-strict
lookup answers "absent", a strict one 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from backends.base import ChunkMeta, StagedChunk, Tier
from backends.errors import TierUnavailable
from backends.s3_settings import S3TierSettings

T = TypeVar("T")

__all__ = ["RequestBudget", "RequestPathTier", "current_budget", "request_budget"]


@dataclass(eq=False, slots=True)
class RequestBudget:
    timeout: float  # seconds from the start of one tier call to its first answer, all attempts included
    unavailable: bool = False  # set by a tier when a call under this budget found it unavailable (or silent)


_budget: ContextVar[RequestBudget | None] = ContextVar("kvgw_request_budget", default=None)


def current_budget() -> RequestBudget | None:
    """The budget of the request path this code runs on, or None (background work)."""
    return _budget.get()


@contextlib.contextmanager
def request_budget(timeout: float) -> Iterator[RequestBudget]:
    """Give every tier call made inside the block (and in tasks it creates) ``timeout`` seconds to its first
    answer. Nested blocks keep the tighter budget."""
    outer = _budget.get()
    budget = RequestBudget(timeout if outer is None else min(timeout, outer.timeout))
    token = _budget.set(budget)
    try:
        yield budget
    finally:
        _budget.reset(token)


class RequestPathTier:
    """A ``Tier`` that runs the calls a waiting client makes under request-path budgets (module docstring)."""

    def __init__(self, inner: Tier, *, lookup_timeout: float, request_timeout: float, lookup_batch: int = 16,
                 slack: float = 0.0) -> None:
        """``slack``: what the tier may take beyond a budget before the backstop cuts (the S3 tier's first
        call allows ``connect_timeout`` for connecting)."""
        self.inner = inner
        self.name = inner.name
        self.lookup_timeout = lookup_timeout
        self.request_timeout = request_timeout
        self._lookup_batch = max(1, lookup_batch)
        self._slack = slack

    @classmethod
    def for_s3(cls, inner: Tier, settings: S3TierSettings | None) -> RequestPathTier:
        """The view with the S3 tier's request-path settings (their defaults when ``settings`` is None, as
        for a test double standing in for S3)."""
        if settings is None:
            fields = S3TierSettings.model_fields
            return cls(inner, lookup_timeout=float(fields["lookup_timeout"].default),
                       request_timeout=float(fields["request_timeout"].default))
        return cls(inner, lookup_timeout=settings.lookup_timeout, request_timeout=settings.request_timeout,
                   lookup_batch=settings.stat_concurrency, slack=settings.connect_timeout)

    async def _bounded(self, what: str, call: Awaitable[T], timeout: float, limit: float) -> T:
        """``call`` under the budget ``timeout``, cut at ``limit`` seconds whatever the tier does."""
        with request_budget(timeout):
            try:
                async with asyncio.timeout(limit):
                    return await call
            except TimeoutError as exc:
                raise TierUnavailable(f"{what}: no answer within {limit:.3g} s (request path)") from exc

    def _lookup_limit(self, count: int) -> float:
        return self.lookup_timeout * (1 + math.ceil(count / self._lookup_batch)) + self._slack

    # -- lookups and other small calls: budget and backstop ------------------------------------

    async def stat(self, digest: bytes) -> ChunkMeta:
        return await self._bounded("stat chunk", self.inner.stat(digest), self.lookup_timeout,
                                   self._lookup_limit(1))

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        if not digests:
            return []
        return await self._bounded("stat chunks", self.inner.stat_many(digests), self.lookup_timeout,
                                   self._lookup_limit(len(digests)))

    def absent_now(self, digests: list[bytes]) -> bool:
        return self.inner.absent_now(digests)

    async def delete(self, digest: bytes) -> bool:
        return await self._bounded("delete chunk", self.inner.delete(digest), self.request_timeout,
                                   3 * self.request_timeout + self._slack)

    # -- reads: the first answer under the budget, the transfer under the tier's own ---------------

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        with request_budget(self.request_timeout):
            return await self.inner.read(digest, offset, length, checksum=checksum)

    async def stream(self, digest: bytes, offset: int, length: int, window: int
                     ) -> AsyncIterator[bytes | memoryview]:
        pieces = self.inner.stream(digest, offset, length, window)
        try:
            with request_budget(self.request_timeout):  # left before yielding: the caller's context is its own
                try:
                    first = await anext(pieces)
                except StopAsyncIteration:
                    return
            yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]

    # -- unchanged: writes and background operations ---------------------------------------------

    async def stage(self, digest: bytes) -> StagedChunk:
        return await self.inner.stage(digest)

    async def quarantine(self, digest: bytes) -> bool:
        """A server-side copy of the whole chunk: a transfer, on the tier's own budgets."""
        return await self.inner.quarantine(digest)

    def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        return self.inner.scan()

    async def cleanup_staging(self, older_than: float) -> int:
        return await self.inner.cleanup_staging(older_than)

    async def usage(self) -> int:
        return await self.inner.usage()

    async def close(self) -> None:
        await self.inner.close()
