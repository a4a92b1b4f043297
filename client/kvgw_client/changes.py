"""The client side of kvgw's change stream (``POST /v1/buckets/{bucket}/changes``, README "Change
stream"): which chunks of a bucket under a key prefix were stored and removed, after a cursor.

``KvgwClient.changes`` reads one page; ``ChangeFollower`` follows the stream in the background on the
client's I/O loop and hands every page's changes to a callback, keeping the cursor so it continues
exactly where it stopped (after a failure too: a page that failed is asked again, nothing skipped).

A change is ``stored`` (a client wrote the chunk) or ``removed`` (no tier of kvgw holds it any more:
deleted, evicted, expired, quarantined). A page with ``reset`` says the follower was behind the feed's
retention: changes were missed, and what a consumer built from earlier pages may be stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvgw_client.errors import KvgwClientError, ProtocolError

log = logging.getLogger("kvgw.client")

OPS = ("stored", "removed")


@dataclass(frozen=True, slots=True)
class Change:
    seq: int
    op: str  # "stored" | "removed"
    key: str
    at: float
    size: int


@dataclass(frozen=True, slots=True)
class ChangePage:
    changes: list[Change]
    cursor: int  # ask for the next page with after=cursor
    head: int  # the feed's head when the page was read: cursor < head means more is waiting
    reset: bool  # the cursor asked for had been trimmed from the feed: changes were missed

    @property
    def more(self) -> bool:
        return self.cursor < self.head


def parse_change_page(doc: object) -> ChangePage:
    """The ``changes`` answer, checked (ProtocolError otherwise)."""
    if not isinstance(doc, dict):
        raise ProtocolError(f"changes: expected an object, got {str(doc)[:200]}")
    raw, cursor, head, reset = doc.get("changes"), doc.get("cursor"), doc.get("head"), doc.get("reset")
    if (not isinstance(raw, list) or not _is_count(cursor) or not _is_count(head)
            or not isinstance(reset, bool)):
        raise ProtocolError(f"changes: expected changes, cursor, head and reset, got {str(doc)[:200]}")
    out: list[Change] = []
    for item in raw:
        if not isinstance(item, dict):
            raise ProtocolError("changes: malformed change")
        seq, op, key, at, size = (item.get(f) for f in ("seq", "op", "key", "at", "size"))
        if (not _is_count(seq) or op not in OPS or not isinstance(key, str)
                or not isinstance(at, int | float) or isinstance(at, bool) or not _is_count(size)):
            raise ProtocolError(f"changes: malformed change {str(item)[:200]}")
        assert isinstance(seq, int) and isinstance(op, str) and isinstance(size, int)
        out.append(Change(seq, op, key, float(at), size))
    assert isinstance(cursor, int) and isinstance(head, int)
    return ChangePage(out, cursor, head, reset)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


PageReader = Callable[[int | None], Awaitable[ChangePage]]
"""``after -> page``: one read of the stream (``KvgwClient.changes`` with the prefix bound)."""


class ChangeFollower:
    """Follows the change stream from ``after`` (None: from now on) and calls ``on_page(page)`` for every
    page read, on the I/O loop that runs ``run`` (it must not block). Reads again at once while the feed
    has more (``page.more``), else after ``poll_seconds``; a failed read is retried after
    ``poll_seconds`` from the same cursor (the client's call policy counts and logs it)."""

    def __init__(self, read: PageReader, on_page: Callable[[ChangePage], None], *, poll_seconds: float = 0.5,
                 after: int | None = None) -> None:
        if poll_seconds <= 0:
            raise ValueError("poll_seconds must be positive")
        self._read = read
        self._on_page = on_page
        self.poll_seconds = poll_seconds
        self.cursor = after
        self.pages = 0
        self.failures = 0
        self._wake: asyncio.Event | None = None

    def wake(self) -> None:
        """Read now rather than at the next poll (call on the follower's loop)."""
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Follow until cancelled."""
        self._wake = asyncio.Event()
        while True:
            more = False
            try:
                page = await self._read(self.cursor)
            except KvgwClientError:
                self.failures += 1
            else:
                self.pages += 1
                self.cursor = page.cursor
                more = page.more
                try:
                    self._on_page(page)
                except Exception:  # a consumer's bug must not stop the stream
                    log.exception("kvgw change stream: the consumer failed on a page; continuing")
            if more:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            self._wake.clear()
