"""One cap on the chunk bytes that reads hold in memory at once, across all requests.

Whole-chunk reads (a prefaulted mapping of a chunk up to ``whole_read_max_bytes``) and the windows of
streamed chunks both draw from it; file pages mapped for a read count as memory here, as they do in
a container's memory limit. A whole read that does not fit right now streams instead; a stream reserves
two windows (the one being sent and the next: a streamed chunk keeps no more resident) before its
first byte and keeps them to its end, waiting for room in arrival order; so however many clients read
however fast, the gateway holds at most the budget plus its own working set, and streams beyond it
queue instead of growing memory.

Event-loop only (no locks): every call comes from the loop thread.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable

Release = Callable[[], None]


class ReadBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_take(self, n: int) -> Release | None:
        """``n`` bytes now, or None if they do not fit (or others are already waiting)."""
        if self._waiters or self.used + n > self.limit:
            return None
        return self._grant(n)

    async def take(self, n: int) -> Release:
        """``n`` bytes (at most the whole budget), waiting for room in arrival order."""
        n = min(n, self.limit)
        if not self._waiters and self.used + n <= self.limit:
            return self._grant(n)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self._give_back(n)  # granted just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._wake()
            raise
        return self._release_of(n)

    def _grant(self, n: int) -> Release:
        self.used += n
        return self._release_of(n)

    def _release_of(self, n: int) -> Release:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._give_back(n)

        return release

    def _give_back(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            n, future = self._waiters.popleft()
            if not future.done():
                self.used += n
                future.set_result(None)


async def budgeted(pieces: AsyncIterator[bytes | memoryview], budget: ReadBudget, hold: int
                   ) -> AsyncIterator[bytes | memoryview]:
    """``pieces`` (a stream that keeps at most two of its windows resident), once ``hold`` bytes of the
    budget are reserved for it, until it ends. Reserved whole, at the start: a stream never waits for
    budget while holding some, so streams cannot deadlock each other however many wait."""
    release = await budget.take(hold)
    try:
        async for piece in pieces:
            yield piece
    finally:
        release()
