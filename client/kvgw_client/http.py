"""The one client of kvgw's native chunk API, shared by the LMCache connector, the L2 adapter, the
CPU staging prefetcher and ``kvgw bench``. Its failure policy is in ``kvgw_client.policy``, its
calls for plain threads in ``kvgw_client.blocking``.

Why aiohttp: LMCache already depends on it (nothing new in the inference process), its C HTTP parser
and streaming body reads carry multi-megabyte chunks with little overhead, and it accepts a streamed
request body with an explicit Content-Length, so a PUT sends LMCache's buffer in 1 MiB slices without
copying it. httpx has a sync client too, but that would be a second pool and a second code path;
here sync callers reach the same async core through ``IoLoop.call`` (see ``kvgw_client.loop``).

Threading: every method may be called from any thread or event loop. The work runs on the client's
I/O loop (one keep-alive pool, one health state); an awaiting caller's loop only waits on a future,
and ``client.blocking`` blocks only the calling thread. The exception: a plain thread's lookup
(``client.blocking.exists`` / ``prefix``) makes its first attempt itself, on a blocking connection
(``lookup_now``), and only a failure goes on to the I/O loop. Callbacks a caller passes (buffer providers,
``on_item``) run on the I/O thread and must not block.

Failure policy (``CallPolicy``): retryable failures (connection, timeout, 500/502/503/504, 429) are
retried with jittered backoff, a streamed body never once bytes reached the caller; failures that
say something about the gateway open a circuit after N in a row, then a probe decides when to try
again; every failure is counted and logged once per burst. ``quiet=True`` turns any gateway-side
failure into the call's neutral answer (no keys, no data, ``PutOutcome.FAILED``, LOST items) instead
of an exception; programming errors still raise. A malformed answer (JSON of the wrong shape, bad
framing) is a failure like any other. Data is never handed out unverified: size against
Content-Length or the frame length, and xxh3-64 against X-Kvgw-Checksum or the frame checksum.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import enum
import functools
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import aiohttp
import xxhash
from yarl import URL

from kvgw_client import keys as keyrules
from kvgw_client import wire
from kvgw_client.blocking import BlockingClient
from kvgw_client.calls import BlockingCalls
from kvgw_client.changes import ChangePage, parse_change_page
from kvgw_client.config import ClientSettings
from kvgw_client.direct import DirectReader, Location, ReadResult, parse_locations
from kvgw_client.endpoint import Endpoint
from kvgw_client.errors import (
    ClientClosed,
    KvgwClientError,
    ProtocolError,
    Rejected,
    Unavailable,
)
from kvgw_client.framing import (
    BatchItem,
    BatchReader,
    BufferProvider,
    Destination,
    ItemStatus,
    PayloadWriter,
    byte_view,
    destination_views,
)
from kvgw_client.health import CircuitState, Counters
from kvgw_client.leases import HeldLeases
from kvgw_client.loop import IoLoop, refuse_on_an_event_loop
from kvgw_client.policy import CallPolicy, error_for, error_from, translate, translated
from kvgw_client.response import Collect, Head
from kvgw_client.stream import BatchSink, StreamConnection, StreamPool, post_request
from kvgw_client.wire import Hint, Retention
from kvgw_client.wire import encode_key as encode_key

T = TypeVar("T")

log = logging.getLogger("kvgw.client")

Buffer = bytes | bytearray | memoryview
Payload = Buffer | Sequence[Buffer]
"""A chunk body: one buffer, or several sent back to back (LMCache's metadata header and tensor)."""

_WRITE_SLICE = 1 << 20
_BRIDGE_DEPTH = 4
_TOUCH_AFTER_S = 0.25  # at most this long between a direct read and the touch that reports it
MAX_JSON_ANSWER = 64 << 20  # a bucket call's JSON answer longer than this is refused (a locate of 1024 keys: ~0.2 MB)


class PutOutcome(enum.StrEnum):
    STORED = "stored"  # 201: this write created the chunk
    EXISTED = "existed"  # 200 + X-Kvgw-Existed: the key was already stored (first write wins)
    DECLINED = "declined"  # 507 + X-Kvgw-Declined: admission under pressure did not store it (no failure)
    FAILED = "failed"  # only with quiet=True: the write did not happen or its fate is unknown


def _check_keys(keys: Sequence[str]) -> None:
    """``_check_key`` for many keys, at the cost of ``keys.plainly_valid`` when all are plainly valid."""
    if not keyrules.plainly_valid(keys):
        for key in keys:
            _check_key(key)


def _check_key(key: str) -> None:
    try:
        keyrules.validate_key(key)
    except keyrules.InvalidKeyError as exc:
        raise Rejected(400, wire.ErrorCode.INVALID_KEY, f"{key[:80]!r}: {exc}", None) from exc


def _payload_views(data: Payload) -> list[memoryview]:
    if isinstance(data, bytes | bytearray | memoryview):
        return [byte_view(data)]
    return [byte_view(part) for part in data]


async def _slices(views: list[memoryview]) -> AsyncIterator[memoryview]:
    for view in views:
        for start in range(0, len(view), _WRITE_SLICE):
            yield view[start : start + _WRITE_SLICE]


def _batches(keys: list[str], size: int) -> Iterator[tuple[int, list[str]]]:
    for start in range(0, len(keys), size):
        yield start, keys[start : start + size]


def _maybe_timeout(seconds: float | None) -> contextlib.AbstractAsyncContextManager[object]:
    return asyncio.timeout(seconds) if seconds is not None else contextlib.nullcontext()


class _Refused(Exception):
    """A buffer provider refused a destination (``read_remembered`` gives up)."""


@dataclass(slots=True)
class _End:
    error: BaseException | None


class _Credit:
    """Flow control of the cross-loop batch bridge: the producer's semaphore lives on the I/O loop."""

    sem: asyncio.Semaphore | None = None

    def release(self) -> None:
        if self.sem is not None:
            self.sem.release()


VERIFYING = {wire.H_VERIFY: wire.VERIFY_XXH3}
"""Sent on every read: this client checks each chunk against its checksum (``PayloadWriter.digest``, the
batch reader's frames), so the gateway sends the bytes unverified, from the page cache by sendfile."""


class KvgwClient:
    def __init__(
        self,
        settings: ClientSettings,
        *,
        io: IoLoop | None = None,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self._io = io if io is not None else IoLoop()
        self._owns_io = io is None
        self.counters = Counters()
        self._log = logger or log
        self._lease_refusals: set[str] = set()  # reasons already logged
        self._leases = HeldLeases(clock)  # read leases granted to this client's lookups
        self._background: set[asyncio.Future[Any]] = set()  # touches of direct reads and damage reports
        self._untouched: dict[str, None] = {}  # keys read directly and not reported yet, in read order
        self._touch_timer: asyncio.TimerHandle | None = None
        self._policy = CallPolicy(
            settings, logger or log, self.counters, probe=self._probe_once, is_closed=lambda: self._closed,
            clock=clock, rand=rand,
        )
        self._session: aiohttp.ClientSession | None = None
        self._endpoint = Endpoint.of(settings.url, settings.ssl_context())
        self._streams: dict[str, StreamPool] = {}  # connections by use: "bulk" (batch-get), "calls" (JSON calls)
        self._calls = BlockingCalls(self._endpoint)  # lookups made on callers' threads
        self._write_gate: asyncio.Semaphore | None = None
        self._closed = False
        base = settings.url.rstrip("/")
        self._probe_url = URL(base + settings.health.probe_path, encoded=True)
        self._bucket_url = f"{base}{wire.API_PREFIX}/buckets/{quote(settings.bucket, safe='')}"
        self._bucket_path = URL(self._bucket_url, encoded=True).raw_path
        self._batch_get_path = f"{self._bucket_path}/batch-get"
        self._headers = {"User-Agent": "kvgw-client/0.1"}
        if settings.access_key is not None:
            self._headers["Authorization"] = f"Bearer {settings.access_key}:{settings.secret_key}"
        self._direct = (None if settings.direct_read_root is None
                        else DirectReader(settings.direct_read_root, settings.direct_read_threads))
        self.blocking = BlockingClient(self)

    # ------------------------------------------------------------------ state

    @property
    def io(self) -> IoLoop:
        return self._io

    @property
    def health(self) -> CircuitState:
        return self._policy.circuit.state

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, object]:
        """Counters (calls, retries, bytes, item statuses), failures by ``op.kind``, circuit state."""
        return {
            "circuit": str(self._policy.circuit.state),
            "circuit_opened": self._policy.circuit.opened,
            "counters": self.counters.snapshot(),
            "failures": self._policy.failures.counts(),
        }

    def spawn(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Run background work on the I/O loop (the prefetcher's fetches)."""
        return self._io.submit(coro)

    # ------------------------------------------------------------------ public API

    async def exists(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> list[bool]:
        """Which of ``keys`` are stored. quiet: all False on failure."""
        keys = list(keys)
        if not keys:
            return []
        return await self._io.run(
            self._policy.op(
                "exists", lambda: self._exists(keys), quiet=quiet, fallback=[False] * len(keys), deadline=timeout
            )
        )

    async def prefix(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> int:
        """How many leading ``keys`` are all stored. quiet: 0 on failure."""
        keys = list(keys)
        if not keys:
            return 0
        return await self._io.run(
            self._policy.op("prefix", lambda: self._prefix(keys), quiet=quiet, fallback=0, deadline=timeout)
        )

    async def touch(self, keys: Sequence[str], *, quiet: bool = False, timeout: float | None = None) -> int:
        """Count reads done elsewhere (a cache tier in front of kvgw) for eviction: how many of ``keys``
        were stored. quiet: 0 on failure."""
        keys = list(keys)
        if not keys:
            return 0
        return await self._io.run(
            self._policy.op("touch", lambda: self._touch(keys), quiet=quiet, fallback=0, deadline=timeout)
        )

    async def put(
        self,
        key: str,
        data: Payload,
        *,
        parent: str | None = None,
        ttl: int | None = None,
        retention: Retention | None = None,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> PutOutcome:
        """Store a chunk (write-once). ``data`` is read until this returns, and not after.

        DECLINED: the gateway's admission did not store it (the tier is full of chunks more likely to
        be read again); not a failure (nothing is logged or counted as one), the caller treats the chunk
        as not stored. ``retention``: the chunk's retention class (``X-Kvgw-Retention``)."""
        return await self._io.run(
            self._policy.op(
                "put", lambda: self._put(key, data, parent, ttl, retention), quiet=quiet,
                fallback=PutOutcome.FAILED, deadline=timeout,
            )
        )

    async def hint(self, hint: Hint | str, keys: Sequence[str], *, quiet: bool = False,
                   timeout: float | None = None) -> int:
        """Tell the gateway something about the chunks under ``keys`` (``Hint``: a request or session
        ended, a retention class, pin / unpin), for its eviction and admission. Returns how many of the
        keys are stored (the others are ignored). quiet: 0 on failure. Hints are advice: a lost hint
        costs hit rate, never data, so engine integrations send them quiet and do not wait."""
        hint = Hint(hint)
        keys = list(keys)
        if not keys:
            return 0
        return await self._io.run(
            self._policy.op("hint", lambda: self._hint(hint, keys), quiet=quiet, fallback=0, deadline=timeout)
        )

    async def get(self, key: str, *, quiet: bool = False, timeout: float | None = None) -> bytearray | None:
        """A chunk's verified bytes, or None if absent (quiet: also on failure)."""
        item = await self._io.run(
            self._policy.op("get", lambda: self._get(key, None), quiet=quiet, fallback=None, deadline=timeout)
        )
        return item.data if item is not None and item.ok else None

    async def get_into(
        self, key: str, into: BufferProvider, *, quiet: bool = False, timeout: float | None = None
    ) -> ItemStatus:
        """Copy a chunk straight into ``into(0, length)``. OK, MISSING or REFUSED; quiet: LOST on failure
        (then the buffer, if one was handed out, holds garbage)."""
        item = await self._io.run(
            self._policy.op("get", lambda: self._get(key, into), quiet=quiet, fallback=None, deadline=timeout)
        )
        return ItemStatus.LOST if item is None else item.status

    async def delete(self, key: str, *, quiet: bool = False, timeout: float | None = None) -> bool:
        """Delete a chunk (root credentials only); False if it was absent (quiet: or on failure)."""
        return await self._io.run(
            self._policy.op("delete", lambda: self._delete(key), quiet=quiet, fallback=False, deadline=timeout)
        )

    async def ping(self) -> bool:
        """Probe the gateway's readiness; never raises. A success closes an open circuit."""
        if self._closed:
            return False
        return await self._io.run(self._ping())

    async def batch_get(
        self, keys: Sequence[str], *, into: BufferProvider | None = None, quiet: bool = False
    ) -> AsyncIterator[BatchItem]:
        """Stream one BatchItem per key, in key order, as frames arrive.

        Without ``into`` each OK item carries its payload; with ``into`` payloads go straight into the
        buffers it returns (called on the I/O thread). A failure turns the remaining items LOST;
        unless ``quiet``, it is then raised after the last item.
        """
        keys = list(keys)
        if self._io.in_loop():
            async for item in self._iter_batch(keys, into, quiet):
                yield item
            return
        consumer = asyncio.get_running_loop()
        queue: asyncio.Queue[BatchItem | _End] = asyncio.Queue()
        credit = _Credit()

        async def produce() -> None:
            sem = credit.sem = asyncio.Semaphore(_BRIDGE_DEPTH)
            end = _End(None)
            try:
                async for item in self._iter_batch(keys, into, quiet):
                    await sem.acquire()
                    consumer.call_soon_threadsafe(queue.put_nowait, item)
            except BaseException as exc:
                end = _End(exc)
                raise
            finally:
                with contextlib.suppress(RuntimeError):
                    consumer.call_soon_threadsafe(queue.put_nowait, end)

        future = self._io.submit(produce())
        try:
            while True:
                got = await queue.get()
                if isinstance(got, _End):
                    if got.error is not None and not isinstance(got.error, asyncio.CancelledError):
                        raise got.error
                    return
                self._io.call_soon(credit.release)
                yield got
        finally:
            if not future.done():
                future.cancel()

    async def batch_get_into(
        self,
        keys: Sequence[str],
        into: BufferProvider,
        *,
        on_item: Callable[[BatchItem], None] | None = None,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> list[ItemStatus]:
        """Fetch ``keys`` into caller buffers; ``on_item`` sees each item on the I/O thread as it
        completes. Returns every key's status (quiet: failures are LOST, never raised).

        ``timeout`` bounds the whole call: items complete by then keep their status, the rest are LOST.
        No buffer is written after this returns (the stream is cut on the I/O loop, between frames'
        bytes, before the statuses are handed back)."""
        return await self._io.run(self._batch_into(list(keys), into, on_item, quiet, timeout))

    async def read_remembered(self, keys: Sequence[str], into: BufferProvider) -> list[BatchItem] | None:
        """Read ``keys`` from the files remembered for them, on the calling loop, whichever loop and
        thread that is: when this client holds a read lease covering every key and a ``locate`` found its
        file (``HeldLeases.located``). No hop to the client's I/O loop and back (two thread wake-ups per
        load, BENCHMARKS.md "kvgw bench lmcache"). Every read is verified as ``batch_get_into``'s direct
        reads are, and reported to the gateway by the same coalesced touch (sent from the I/O loop).

        None when not every key is remembered, a destination is refused or any read fails: then nothing
        ``into`` handed out holds valid bytes (the caller frees it) and the caller takes the ordinary
        path, ``batch_get_into``, which tries the files again and fetches what fails through the gateway.

        The lease book belongs to the I/O loop; reading it from another thread is safe because each step
        is one dict lookup (atomic under the GIL), and a stale answer costs one failed read at most."""
        if self._direct is None or self._closed or not keys:
            return None
        located = self._leases.located(keys, self.settings.lease_ms)
        if located is None:
            return None

        def draw() -> Iterator[tuple[Location, Destination]]:
            for index, loc in enumerate(located):
                dest = into(index, loc.size)
                if dest is None:
                    raise _Refused()
                yield loc, dest

        try:
            results = await self._direct.read_all(draw())
        except _Refused:
            return None
        if any(result is not ReadResult.OK for result in results):
            self.counters.add("direct.remembered_retried")  # by the ordinary path, which reports it
            return None
        self.counters.add("direct.remembered")
        self.counters.add("direct.ok", len(located))
        self.counters.add("direct.bytes", sum(loc.size for loc in located))
        self._io.call_soon(self._touch_soon, list(keys))
        return [BatchItem(index, ItemStatus.OK, loc.size) for index, loc in enumerate(located)]

    async def list_keys(
        self,
        prefix: str = "",
        *,
        after: str | None = None,
        limit: int = 1000,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> tuple[list[str], bool]:
        """One page of the bucket's keys under ``prefix``, strictly after ``after``, in UTF-8 byte
        order: ``(keys, truncated)``; continue with ``after=keys[-1]`` while ``truncated``.
        quiet: ``([], False)`` on failure."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return await self._io.run(
            self._policy.op(
                "list", lambda: self._list(prefix, after, limit), quiet=quiet, fallback=([], False),
                deadline=timeout,
            )
        )

    async def changes(
        self,
        prefix: str = "",
        *,
        after: int | None = None,
        limit: int = 1000,
        quiet: bool = False,
        timeout: float | None = None,
    ) -> ChangePage | None:
        """One page of the bucket's change stream under ``prefix`` after cursor ``after`` (None: from now
        on; ``kvgw_client.changes``). quiet: None on failure."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        body: dict[str, object] = {"prefix": prefix, "after": after, "limit": limit}
        return await self._io.run(
            self._policy.op(
                "changes", lambda: self._post_doc("changes", "changes", body, parse_change_page), quiet=quiet,
                fallback=None, deadline=timeout,
            )
        )

    async def put_many(
        self,
        keys: Sequence[str],
        bodies: Sequence[Payload],
        *,
        parents: Sequence[str | None] | None = None,
        ttl: int | None = None,
        retention: Retention | Sequence[Retention | None] | None = None,
        timeout: float | None = None,
    ) -> list[PutOutcome]:
        """Store a run of chunks, all in flight at once (``write_concurrency`` at a time), each naming
        its parent (``parents``, e.g. ``ParentMap.parents_of_run``): the engines' stores. Quiet: a
        chunk that failed is ``PutOutcome.FAILED``, one admission declined ``DECLINED``; nothing raises
        for the gateway's sake. ``retention``: one class for every chunk, or one per chunk. Each body
        is read until this returns, and not after."""
        if parents is None:
            parents = [None] * len(keys)
        classes = (list(retention) if retention is not None and not isinstance(retention, str)
                   else [retention] * len(keys))
        if not len(keys) == len(bodies) == len(parents) == len(classes):
            raise ValueError(f"{len(keys)} keys, {len(bodies)} bodies, {len(parents)} parents and "
                             f"{len(classes)} retention classes")
        return await self._io.run(self._put_many(list(keys), list(bodies), list(parents), ttl, classes, timeout))

    async def _put_many(self, keys: list[str], bodies: list[Payload], parents: list[str | None], ttl: int | None,
                        classes: list[Retention | None], timeout: float | None) -> list[PutOutcome]:
        return list(await asyncio.gather(*(
            self.put(k, b, parent=p, ttl=ttl, retention=r, quiet=True, timeout=timeout)
            for k, b, p, r in zip(keys, bodies, parents, classes, strict=True)
        )))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ClientClosed):
            await self._io.run(self._shutdown())
        if self._owns_io:
            if self._io.in_loop():
                self._io.close()
            else:
                await asyncio.to_thread(self._io.close)

    def close(self) -> None:
        """Close from a plain thread (waits) or from an event loop thread (does not wait)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        with contextlib.suppress(ClientClosed, cf.TimeoutError, cf.CancelledError):
            if on_loop:
                self._io.submit(self._shutdown())
            else:
                self._io.call(self._shutdown(), timeout=5.0)
        if self._owns_io:
            self._io.close(timeout=0.0 if on_loop else 5.0)

    # ------------------------------------------------------------------ operations (I/O loop)

    def _chunk_url(self, key: str) -> URL:
        return URL(f"{self._bucket_url}/chunks/{encode_key(key)}", encoded=True)

    async def _exists(self, keys: list[str]) -> list[bool]:
        _check_keys(keys)
        out: list[bool] = []
        for _, part in _batches(keys, self.settings.max_keys_per_call):
            parse, hits = EXISTS.reading(part)
            found: list[bool] = await self._lookup("exists", part, parse, hits)
            out.extend(found)
        return out

    async def _prefix(self, keys: list[str]) -> int:
        _check_keys(keys)
        total = 0
        for _, part in _batches(keys, self.settings.max_keys_per_call):
            parse_length, first = PREFIX.reading(part)
            length = await self._lookup("prefix", part, parse_length, first)
            total += length
            if length < len(part):
                break
        return total

    def lookup_now(self, kind: _LookupKind[T], keys: list[str], *, quiet: bool, timeout: float | None) -> T:
        """``exists`` / ``prefix`` for a plain thread (``KvgwClient.blocking``), its first attempt made
        on the calling thread over a blocking connection (``kvgw_client.calls``): no hand-off to the I/O
        loop and back, which cost such a lookup more than the gateway's answer did.

        Only a call the client can make in one request while the call policy is calm (circuit closed,
        no failure since the last success) goes this way; anything else, and a first attempt that
        failed, goes to the I/O loop as before, the failure counted there as the call's first attempt
        (retries, circuit and accounting as for any call). The caller's ``timeout`` covers both."""
        if not keys:
            return kind.fallback(keys)
        op = kind.op
        if (self._closed or len(keys) > self.settings.max_keys_per_call or not self._policy.calm
                or not keyrules.plainly_valid(keys)):
            return self._io.call(self._policy.op(op, lambda: kind.whole(self, keys), quiet=quiet,
                                                 fallback=kind.fallback(keys), deadline=timeout))
        refuse_on_an_event_loop()
        self.counters.add(f"{op}.calls")
        started = time.monotonic()
        parse, hits = kind.reading(keys)
        body, read = self._lookup_call(op, keys, parse, hits)
        limit = self.settings.timeouts.control if timeout is None else min(timeout, self.settings.timeouts.control)
        try:
            return self._post_now(op, op, body, read, limit)
        except KvgwClientError as exc:
            failed = exc
        spent = time.monotonic() - started
        rest: Callable[[], Awaitable[T]]
        if timeout is not None and spent >= timeout:
            rest = _deadline_passed  # the caller's deadline ended the attempt: one failure, the deadline's
        else:
            def rest() -> Awaitable[T]:
                return self._policy.attempts(op, lambda: self._post_attempt(op, op, body, read), failed=failed)
        return self._io.call(self._policy.op(op, rest, quiet=quiet, fallback=kind.fallback(keys), deadline=timeout,
                                             spent=spent, counted=True))

    def _touch_soon(self, keys: list[str]) -> None:
        """Report reads done without the gateway (direct reads of remembered files) in the background.

        Reports are coalesced: the keys read within ``_TOUCH_AFTER_S`` (a quarter of the lease at most)
        go in one ``touch``. One call per load cost each load a request's worth of the client's loop and
        the gateway's CPU beside the reads (``kvgw bench lmcache``: (f) / (v) 0.81-0.85 with a touch per
        load, 0.90-0.93 coalesced, alternating runs). Waiting is safe: these keys are leased (that is
        why no ``locate`` was asked), so the lifecycle cannot remove them before the report lands; a
        failure is counted by the call policy and otherwise ignored (it costs eviction accuracy only)."""
        self._untouched.update(dict.fromkeys(keys))
        if self._touch_timer is None:
            self._touch_timer = asyncio.get_running_loop().call_later(self._touch_delay(), self._touch_now)

    def _touch_delay(self) -> float:
        return min(_TOUCH_AFTER_S, self.settings.lease_ms / 4000)

    def _touch_now(self) -> None:
        keys = self._take_untouched()
        if not keys:
            return
        task = asyncio.ensure_future(self._policy.op("touch", lambda: self._touch(keys), quiet=True, fallback=0,
                                                     deadline=self.settings.timeouts.control))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _take_untouched(self) -> list[str]:
        if self._touch_timer is not None:
            self._touch_timer.cancel()
            self._touch_timer = None
        keys, self._untouched = list(self._untouched), {}
        return keys

    async def _touch(self, keys: list[str], *, closing: bool = False) -> int:
        """``closing``: one attempt each, outside the call policy (which refuses calls once the client is
        closed): the last report, sent while closing."""
        _check_keys(keys)
        total = 0
        for _, part in _batches(keys, self.settings.max_keys_per_call):
            parse = functools.partial(_count_in, "touch", "touched", len(part))
            if closing:
                total += await self._post_attempt("touch", "touch", {"keys": part}, parse)
            else:
                total += await self._post_json("touch", "touch", part, parse)
        return total

    async def _hint(self, hint: Hint, keys: list[str]) -> int:
        _check_keys(keys)
        total = 0
        for _, part in _batches(keys, self.settings.max_keys_per_call):
            parse = functools.partial(_count_in, "hints", "applied", len(part))
            total += await self._post_doc("hint", "hints", {"hint": hint.value, "keys": part}, parse)
        return total

    async def _post_json(self, op: str, endpoint: str, keys: list[str], parse: Callable[[object], T]) -> T:
        """POST ``{"keys": keys}``; ``parse`` checks the answer's shape inside the attempt, so a malformed
        answer is counted, logged and trips the circuit like any other failure."""
        return await self._post_doc(op, endpoint, {"keys": keys}, parse)

    async def _lookup(self, op: str, keys: list[str], parse: Callable[[object], T],
                      hits: Callable[[T], Iterable[str]]) -> T:
        """A lookup (``exists``, ``prefix``, ``locate``: the endpoint is ``op``), with the lease
        ``_lookup_call`` asks for."""
        body, read = self._lookup_call(op, keys, parse, hits)
        return await self._post_doc(op, op, body, read)

    def _lookup_call(self, op: str, keys: list[str], parse: Callable[[object], T],
                     hits: Callable[[T], Iterable[str]]) -> tuple[dict[str, object], Callable[[object], T]]:
        """What a lookup sends and how its answer is read. It read-leases what it finds (``hits`` of the
        parsed answer) for the settings' ``lease_ms``, unless leases this client already holds cover
        every key (``HeldLeases``: a load's ``locate`` right after its lookup asks for none). A lease the
        gateway refused is counted (``lease_refused``) and logged once per reason."""
        lease_ms = self.settings.lease_ms
        if lease_ms == 0 or self._leases.covers(keys, lease_ms):
            return {"keys": keys}, parse
        sent_at = self._leases.now()

        def read(doc: object) -> T:
            value = parse(doc)
            self._leases.granted(hits(value), sent_at, self._granted_ms(op, doc))
            return value

        return {"keys": keys, "lease_ms": lease_ms}, read

    async def _post_doc(self, op: str, endpoint: str, body: dict[str, object], parse: Callable[[object], T]) -> T:
        """POST the JSON ``body`` to a bucket call and ``parse`` its JSON answer, as one attempt of the
        call policy (retries, circuit, failure counting)."""
        return await self._policy.attempts(op, lambda: self._post_attempt(op, endpoint, body, parse))

    async def _post_attempt(self, op: str, endpoint: str, body: dict[str, object], parse: Callable[[object], T]) -> T:
        """One POST of a JSON ``body`` on a stream connection (``kvgw_client.stream``, as batch-get's):
        no aiohttp request cycle on the lookup path. The answer is read whole (up to
        ``MAX_JSON_ANSWER`` bytes) before the connection goes back to the pool."""
        pool = self._stream_pool("calls")
        request = self._post_request(endpoint, body)
        answer = Collect(MAX_JSON_ANSWER)
        async with translate(op), asyncio.timeout(self.settings.timeouts.control):
            conn, head = await pool.request(request, lambda _head: answer)
            try:
                await conn.done
            finally:
                if not conn.done.done():
                    conn.abort()  # cancelled or timed out mid-answer: the connection cannot be reused
                pool.release(conn)
        return _json_answer(op, head, answer, parse)

    def _post_now(self, op: str, endpoint: str, body: dict[str, object], parse: Callable[[object], T],
                  timeout: float) -> T:
        """``_post_attempt`` on the calling thread, over a blocking connection (``kvgw_client.calls``)."""
        answer = Collect(MAX_JSON_ANSWER)
        try:
            head = self._calls.exchange(self._post_request(endpoint, body), lambda _head: answer, timeout)
        except Exception as exc:
            err = translated(op, exc)
            if err is None:
                raise
            raise err from exc
        return _json_answer(op, head, answer, parse)

    def _post_request(self, endpoint: str, body: dict[str, object]) -> bytes:
        return post_request(self._endpoint.authority, f"{self._bucket_path}/{endpoint}", json.dumps(body).encode(),
                            self._headers)

    def _granted_ms(self, op: str, doc: object) -> int:
        """How long a lookup's answer says its hits are leased; a refusal is counted (logged once per
        reason), never an error: the lookup's answer stands, only unprotected against eviction."""
        lease = doc.get("lease") if isinstance(doc, dict) else None
        refused = lease.get("refused") if isinstance(lease, dict) else "the gateway granted no lease"
        if refused is None:
            granted = lease.get("granted_ms") if isinstance(lease, dict) else None
            return granted if isinstance(granted, int) and not isinstance(granted, bool) and granted > 0 else 0
        self.counters.add("lease_refused")
        if str(refused) not in self._lease_refusals:
            self._lease_refusals.add(str(refused))
            self._log.warning("kvgw %s: no read lease: %s", op, refused)
        return 0

    async def _put(self, key: str, data: Payload, parent: str | None, ttl: int | None,
                   retention: Retention | None) -> PutOutcome:
        _check_key(key)
        views = _payload_views(data)
        length = sum(len(v) for v in views)
        hasher = xxhash.xxh3_64()
        for view in views:
            hasher.update(view)
        headers = {
            "Content-Type": wire.CHUNK_CONTENT_TYPE,
            "Content-Length": str(length),
            wire.H_CHECKSUM: hasher.hexdigest(),
        }
        if parent is not None:
            _check_key(parent)
            headers[wire.H_PARENT] = encode_key(parent)
        if ttl is not None:
            if ttl <= 0:
                raise ValueError("ttl must be a positive number of seconds")
            headers[wire.H_TTL] = str(int(ttl))
        if retention is not None:
            headers[wire.H_RETENTION] = Retention(retention).value
        url = self._chunk_url(key)

        async def attempt() -> PutOutcome:
            async with (
                self._writer_slot(),
                translate("put"),
                _maybe_timeout(self.settings.timeouts.transfer),
                self._http().put(url, data=_slices(views), headers=headers) as resp,
            ):
                if resp.status == 201:
                    return PutOutcome.STORED
                if resp.status == 200:
                    existed = resp.headers.get(wire.H_EXISTED, "").lower() == "true"
                    return PutOutcome.EXISTED if existed else PutOutcome.STORED
                if resp.status == 507 and wire.H_DECLINED in resp.headers:
                    return PutOutcome.DECLINED
                raise await error_from(resp)

        outcome = await self._policy.attempts("put", attempt)
        self.counters.add("put.bytes", length)
        self.counters.add(f"put.{outcome}")
        return outcome

    async def _get(self, key: str, into: BufferProvider | None) -> BatchItem:
        _check_key(key)
        url = self._chunk_url(key)
        self._leases.forget((key,))
        handed_out = False  # once the caller's buffer holds bytes, another attempt would ask for a new one

        async def attempt() -> BatchItem:
            try:
                return await transfer()
            except KvgwClientError as exc:
                if handed_out:
                    exc.retryable = False
                raise

        async def transfer() -> BatchItem:
            nonlocal handed_out
            async with (
                translate("get"),
                _maybe_timeout(self.settings.timeouts.transfer),
                self._http().get(url, headers=VERIFYING) as resp,
            ):
                if resp.status == 404:
                    err = await error_from(resp)
                    if isinstance(err, Rejected) and err.code == wire.ErrorCode.NO_SUCH_CHUNK:
                        return BatchItem(0, ItemStatus.MISSING)
                    raise err
                if resp.status != 200:
                    raise await error_from(resp)
                length, expected = self._chunk_headers(resp)
                data: bytearray | None = None
                if into is None:
                    data = bytearray(length)
                    writer = PayloadWriter([memoryview(data)], length)
                else:
                    dest = into(0, length)
                    handed_out = True
                    if dest is None:
                        return BatchItem(0, ItemStatus.REFUSED, length)
                    views = destination_views(dest)
                    if sum(len(v) for v in views) != length:
                        raise ValueError(f"buffer provider returned the wrong size for {length} bytes")
                    writer = PayloadWriter(views, length)
                async for chunk in resp.content.iter_any():
                    if len(chunk) > writer.remaining:
                        raise ProtocolError("get: more body bytes than Content-Length")
                    writer.write(memoryview(chunk))
                if writer.remaining:
                    raise Unavailable(f"get: body cut short, {writer.remaining} of {length} bytes missing")
                if expected is not None and writer.digest() != expected:
                    self._report_damaged([key])
                    raise ProtocolError(f"get {key[:80]!r}: payload checksum mismatch (reported to the gateway)")
                self.counters.add("get.bytes", length)
                return BatchItem(0, ItemStatus.OK, length, data)

        return await self._policy.attempts("get", attempt)

    def _chunk_headers(self, resp: aiohttp.ClientResponse) -> tuple[int, int | None]:
        raw_length = resp.headers.get("Content-Length")
        if raw_length is None or not raw_length.isdigit():
            raise ProtocolError("get: response has no valid Content-Length")
        length = int(raw_length)
        if length > self.settings.max_chunk_bytes:
            raise ProtocolError(f"get: {length} bytes exceeds max_chunk_bytes")
        raw_sum = resp.headers.get(wire.H_CHECKSUM)
        if raw_sum is None:
            if self.settings.require_checksum:
                raise ProtocolError(f"get: response has no {wire.H_CHECKSUM}")
            return length, None
        try:
            if len(raw_sum) != 16:
                raise ValueError(raw_sum)
            return length, int(raw_sum, 16)
        except ValueError as exc:
            raise ProtocolError(f"get: malformed {wire.H_CHECKSUM} {raw_sum[:40]!r}") from exc

    async def _delete(self, key: str) -> bool:
        _check_key(key)
        url = self._chunk_url(key)

        async def attempt() -> bool:
            async with (
                translate("delete"),
                asyncio.timeout(self.settings.timeouts.control),
                self._http().delete(url) as resp,
            ):
                if resp.status in (200, 204):
                    return True
                err = await error_from(resp)
                if resp.status == 404 and isinstance(err, Rejected) and err.code == wire.ErrorCode.NO_SUCH_CHUNK:
                    return False
                raise err

        return await self._policy.attempts("delete", attempt)

    async def _batch_into(
        self,
        keys: list[str],
        into: BufferProvider,
        on_item: Callable[[BatchItem], None] | None,
        quiet: bool,
        timeout: float | None = None,
    ) -> list[ItemStatus]:
        statuses = [ItemStatus.LOST] * len(keys)
        try:
            async with _maybe_timeout(timeout):
                async for item in self._iter_batch(keys, into, quiet):
                    statuses[item.index] = item.status
                    if on_item is not None:
                        on_item(item)
        except TimeoutError as exc:
            err = Unavailable(f"batch_get: not complete within {timeout}s", timeout=True)
            self._policy.note_failure("batch_get", err)
            if not quiet:
                raise err from exc
        return statuses

    async def _list(self, prefix: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        body: dict[str, object] = {"prefix": prefix, "limit": limit}
        if after is not None:
            body["after"] = after

        def parse(doc: object) -> tuple[list[str], bool]:
            keys = doc.get("keys") if isinstance(doc, dict) else None
            truncated = doc.get("truncated") if isinstance(doc, dict) else None
            if (not isinstance(keys, list) or len(keys) > limit or not all(isinstance(k, str) for k in keys)
                    or not isinstance(truncated, bool)):
                raise ProtocolError(f"list: expected keys and truncated, got {str(doc)[:200]}")
            return keys, truncated

        return await self._post_doc("list", "list", body, parse)

    async def _iter_batch(
        self, keys: list[str], into: BufferProvider | None, quiet: bool
    ) -> AsyncIterator[BatchItem]:
        """The batch-get core: one item per key in order, failures as LOST, raise at the end."""
        self.counters.add("batch_get.calls")
        error: KvgwClientError | None = None
        try:
            _check_keys(keys)
        except KvgwClientError as exc:
            error = exc
            self._policy.note_failure("batch_get", exc)
        for offset, part in _batches(keys, self.settings.max_keys_per_call):
            if error is not None:
                for i in range(len(part)):
                    yield BatchItem(offset + i, ItemStatus.LOST)
                continue
            async for item in self._iter_part(list(range(offset, offset + len(part))), part, into):
                if isinstance(item, KvgwClientError):
                    error = item
                else:
                    self.counters.add(f"batch_get.{item.status}")
                    if item.status is ItemStatus.CORRUPT:
                        self._policy.failures.failure("batch_get", "corrupt", f"frame {item.index}: checksum mismatch")
                    yield item
        if error is not None and not quiet:
            raise error

    async def _iter_part(
        self, positions: list[int], keys: list[str], into: BufferProvider | None
    ) -> AsyncIterator[BatchItem | KvgwClientError]:
        """Items of one call's keys (``positions`` are their indices in the caller's list): read
        directly from the tier directory where configured and possible, the rest through batch-get."""
        if self._direct is None:
            async for got in self._iter_http(positions, keys, into):
                yield got
            return
        done, rest, into = await self._read_direct(positions, keys, into)
        ready = sorted(done)
        if rest:
            async for got in self._iter_http([positions[j] for j in rest], [keys[j] for j in rest], into):
                if isinstance(got, BatchItem):
                    while ready and ready[0] < got.index:
                        yield done.pop(ready.pop(0))
                yield got
        for position in ready:
            yield done[position]

    async def _read_direct(
        self, positions: list[int], keys: list[str], into: BufferProvider | None
    ) -> tuple[dict[int, BatchItem], list[int], BufferProvider | None]:
        """Locate ``keys`` and read the file copies. Returns the finished items by position, the
        indices into ``keys`` left for batch-get, and the buffer provider batch-get must use: it hands
        back the buffer a failed direct read already took, so no position is ever given two.

        Keys all leased and located before (``HeldLeases.located``) are read without asking: no round
        trip before the first byte; the reads are reported to the gateway afterwards (``touch``, in the
        background), so they count for eviction as a ``locate`` would have counted them."""
        assert self._direct is not None
        located: Sequence[Location | None] | None = self._leases.located(keys, self.settings.lease_ms)
        if located is not None:
            self.counters.add("direct.located_before")
            self._touch_soon(keys)
        else:
            parse = functools.partial(parse_locations, count=len(keys), max_size=self.settings.max_chunk_bytes)
            try:
                located = await self._lookup("locate", keys, parse,
                                             lambda value: _where(keys, [loc is not None for loc in value]))
            except KvgwClientError:  # counted and logged by the call policy; batch-get decides the items
                return {}, list(range(len(keys))), into
            self._leases.remember_locations(keys, located)
        done: dict[int, BatchItem] = {}
        rest: list[int] = []
        jobs: list[tuple[int, Location, Destination]] = []

        def draw() -> Iterator[tuple[Location, Destination]]:
            """The reads, each destination taken just before its read starts (``read_all`` reads the
            first while this takes the next one)."""
            for j, loc in enumerate(located):
                if loc is None:
                    done[positions[j]] = BatchItem(positions[j], ItemStatus.MISSING)
                elif loc.path is None:
                    rest.append(j)
                else:
                    dest = memoryview(bytearray(loc.size)) if into is None else into(positions[j], loc.size)
                    if dest is None:
                        done[positions[j]] = BatchItem(positions[j], ItemStatus.REFUSED, loc.size)
                    else:
                        jobs.append((j, loc, dest))
                        yield loc, dest

        results = await self._direct.read_all(draw())
        taken: dict[int, tuple[int, Destination]] = {}
        damaged: list[str] = []
        for (j, loc, dest), result in zip(jobs, results, strict=True):
            if result is ReadResult.OK:
                data = dest.obj if into is None and isinstance(dest, memoryview) else None
                assert data is None or isinstance(data, bytearray)
                done[positions[j]] = BatchItem(positions[j], ItemStatus.OK, loc.size, data)
                self.counters.add("direct.ok")
                self.counters.add("direct.bytes", loc.size)
                continue
            self.counters.add(f"direct.{result.value}")
            self._policy.failures.failure("direct_read", result.value,
                                          f"{self._direct.root}/{loc.path}: fetching through the gateway")
            rest.append(j)
            if result is ReadResult.MISMATCH:
                damaged.append(keys[j])
            if into is not None:
                taken[positions[j]] = (loc.size, dest)
        if damaged:  # reported before the fetch, so the gateway answers from another copy (or a miss)
            await self._report_damaged_now(damaged)
        rest.sort()
        if not taken or into is None:
            return done, rest, into
        provider = into

        def reuse(position: int, length: int) -> Destination | None:
            if position not in taken:
                return provider(position, length)
            size, dest = taken.pop(position)
            return dest if size == length else None

        return done, rest, reuse

    async def _iter_http(
        self, positions: list[int], keys: list[str], into: BufferProvider | None
    ) -> AsyncIterator[BatchItem | KvgwClientError]:
        """One batch-get call's items, read from a ``stream.StreamConnection``: each payload is received
        from the socket straight into its destination and hashed there (one copy per byte)."""
        shifted = None if into is None else (lambda index, length: into(positions[index], length))
        reader = BatchReader(len(keys), into=shifted, max_length=self.settings.max_chunk_bytes)
        sink = BatchSink(reader)
        pool = self._stream_pool()
        request = post_request(self._endpoint.authority, self._batch_get_path, json.dumps({"keys": keys}).encode(),
                               {**self._headers, **VERIFYING})
        self._leases.forget(keys)

        async def open_stream() -> StreamConnection:
            errors = Collect()
            async with translate("batch_get"), asyncio.timeout(self.settings.timeouts.control):
                conn, head = await pool.request(request, lambda head: sink if _is_batch(head) else errors)
                if _is_batch(head):
                    return conn
                try:
                    if head.status == 200:
                        conn.abort()
                        raise ProtocolError(f"batch_get: unexpected content type {head.headers.get('content-type')!r}")
                    await conn.done
                finally:
                    pool.release(conn)
                raise error_for(head.status, head.reason, head.headers.get(wire.H_REQUEST_ID), errors.data)

        failure: KvgwClientError | None = None
        damaged: list[str] = []
        try:
            conn = await self._policy.attempts("batch_get", open_stream)
        except KvgwClientError as exc:
            failure = exc
        else:
            done = conn.done  # this answer's end (the connection is ours until released below)
            done.add_done_callback(lambda _: sink.event.set())
            watch = _ReadWatch(sink.event, conn, self.settings.timeouts.read)
            clean = False
            try:
                async with translate("batch_get"):
                    while True:
                        finished = reader.error is not None or done.done()  # no item comes after
                        for item in sink.take():
                            if item.status is ItemStatus.CORRUPT:
                                damaged.append(keys[item.index])
                            yield BatchItem(positions[item.index], item.status, item.length, item.data)
                        if finished:
                            break
                        await watch.wait()
                    if reader.error is None:
                        done.result()  # a broken connection raises here
                    clean = reader.complete and reader.error is None
                if reader.error is not None:
                    raise ProtocolError(f"batch_get: {reader.error}")
                if not reader.complete:
                    raise Unavailable("batch_get: stream ended before its trailer")
            except KvgwClientError as exc:
                failure = exc
                self._policy.note_failure("batch_get", exc)
            finally:
                watch.close()
                if not clean:
                    conn.abort()  # the rest of this answer cannot be trusted or is not wanted
                pool.release(conn)
            self.counters.add("batch_get.bytes", reader.bytes_received)
            self.counters.add("batch_get.bytes_copied", sink.fed)  # the rest went straight to its destination
        if damaged:
            self._report_damaged(damaged)
        for item in reader.close():
            yield BatchItem(positions[item.index], item.status)
        if failure is not None:
            yield failure

    def _stream_pool(self, use: Literal["bulk", "calls"] = "bulk") -> StreamPool:
        """The keep-alive connections (``kvgw_client.stream``) for one ``use``: ``bulk`` for batch-get
        streams, ``calls`` for the small JSON calls, each with ``pool_size`` connections, so a lookup
        never waits for a connection behind a full set of long batch-gets."""
        pool = self._streams.get(use)
        if pool is None:
            if self._closed:
                raise ClientClosed()
            pool = self._streams[use] = StreamPool(self._endpoint, connections=self.settings.pool_size,
                                                   connect_timeout=self.settings.timeouts.connect)
        return pool

    def _report_damaged(self, keys: list[str]) -> None:
        """``_report_damaged_now``, in the background (the read that found the damage goes on)."""
        task = asyncio.ensure_future(self._report_damaged_now(keys))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _report_damaged_now(self, keys: list[str]) -> None:
        """Tell the gateway which chunks arrived with bytes that do not match their checksum (one call):
        it verifies its copy and quarantines it if damaged, so the next read is served from another
        tier or is a miss. Best effort: a report that fails changes nothing."""
        self.counters.add("damaged_reported", len(keys))
        with contextlib.suppress(KvgwClientError, aiohttp.ClientError, OSError, TimeoutError):
            await self._post_attempt("damaged", "damaged", {"keys": keys}, lambda doc: doc)

    async def _ping(self) -> bool:
        ok = await self._probe_once()
        if ok:
            self._policy.recovered()
        return ok

    async def _probe_once(self) -> bool:
        try:
            async with asyncio.timeout(self.settings.timeouts.control):
                async with self._http().get(self._probe_url) as resp:
                    await resp.read()
                    return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError, KvgwClientError):
            return False

    async def _shutdown(self) -> None:
        self._policy.stop_probing()
        unreported = self._take_untouched()
        if unreported:  # reads not reported yet: now rather than never; best effort, as every touch
            with contextlib.suppress(KvgwClientError, aiohttp.ClientError, OSError, TimeoutError):
                await self._touch(unreported, closing=True)
        if self._background:  # touches still in flight: brief, and losing one costs eviction accuracy only
            await asyncio.wait(set(self._background), timeout=self.settings.timeouts.control)
        if self._direct is not None:
            self._direct.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        for pool in self._streams.values():
            pool.close()
        self._streams.clear()
        self._calls.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._closed:
                raise ClientClosed()
            t = self.settings.timeouts
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.settings.pool_size, limit_per_host=self.settings.pool_size, keepalive_timeout=30.0,
                    ssl=self.settings.ssl_context(),
                ),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.read),
                headers=self._headers,
                auto_decompress=False,
            )
        return self._session

    @contextlib.asynccontextmanager
    async def _writer_slot(self) -> AsyncIterator[None]:
        """Bounds concurrent PUTs so reads always find a free connection in the pool."""
        if self._write_gate is None:
            self._write_gate = asyncio.Semaphore(self.settings.write_concurrency)
        async with self._write_gate:
            yield


def _is_batch(head: Head) -> bool:
    """A 200 carrying a batch-get stream."""
    return head.status == 200 and head.headers.get("content-type", "").split(";")[0].strip() == wire.BATCH_CONTENT_TYPE


class _ReadWatch:
    """Waits on a stream's ``event`` that end in TimeoutError once the connection has read nothing for
    ``read_timeout`` s. One timer per stream, re-armed from the connection's last read when it fires,
    instead of a timeout per wait: a batch of small frames wakes its reader once per few frames."""

    def __init__(self, event: asyncio.Event, conn: StreamConnection, read_timeout: float) -> None:
        self._event, self._conn, self._read_timeout = event, conn, read_timeout
        self._loop = asyncio.get_running_loop()
        self._stalled = False
        self._timer = self._loop.call_later(read_timeout, self._check)

    def _check(self) -> None:
        idle = self._loop.time() - self._conn.last_read
        if idle >= self._read_timeout:
            self._stalled = True
            self._event.set()
        else:
            self._timer = self._loop.call_later(self._read_timeout - idle, self._check)

    async def wait(self) -> None:
        await self._event.wait()
        if self._stalled:
            raise TimeoutError(f"nothing read for {self._read_timeout:g} s")

    def close(self) -> None:
        self._timer.cancel()


def _where(keys: Sequence[str], flags: Sequence[bool]) -> list[str]:
    """The keys whose flag is set (a lookup's hits)."""
    return [key for key, flag in zip(keys, flags, strict=True) if flag]


def _first(keys: Sequence[str], length: int) -> Sequence[str]:
    """The first ``length`` keys (a prefix lookup's hits)."""
    return keys[:length]


def _count_in(op: str, field: str, n: int, doc: object) -> int:
    """``doc[field]``, a count in 0..n (prefix's length, touch's count); ProtocolError otherwise."""
    value = doc.get(field) if isinstance(doc, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= n:
        raise ProtocolError(f"{op}: expected \"{field}\" in 0..{n}, got {str(doc)[:200]}")
    return value


def _exists_found(keys: Sequence[str], doc: object) -> list[bool]:
    """``exists``' answer for ``keys``: one boolean per key; ProtocolError otherwise."""
    value = doc.get("exists") if isinstance(doc, dict) else None
    if not isinstance(value, list) or len(value) != len(keys) or not set(map(type, value)) <= {bool}:
        raise ProtocolError(f"exists: expected {len(keys)} booleans, got {str(doc)[:200]}")
    return value


def _prefix_length(keys: Sequence[str], doc: object) -> int:
    """``prefix``' answer for ``keys``: how many leading keys are stored."""
    return _count_in("prefix", "length", len(keys), doc)


def _json_answer(op: str, head: Head, answer: Collect, parse: Callable[[object], T]) -> T:
    """A bucket call's JSON answer, read whole into ``answer``: ``parse``d, or the error it stands for."""
    if head.status != 200:
        raise error_for(head.status, head.reason, head.headers.get(wire.H_REQUEST_ID), answer.data)
    if answer.truncated:
        raise ProtocolError(f"{op}: answer longer than {MAX_JSON_ANSWER} bytes")
    try:
        doc = json.loads(answer.data)
    except ValueError as exc:
        raise ProtocolError(f"{op}: response is not JSON") from exc
    return parse(doc)


async def _deadline_passed() -> Any:
    raise TimeoutError()


@dataclass(frozen=True)
class _LookupKind(Generic[T]):
    """A lookup a plain thread may make on its own thread (``KvgwClient.lookup_now``): its op, how its
    answer for some keys is read (``parse``), which keys that answer found (``hits``: they are leased),
    what a quiet failure answers, and the whole call as the I/O loop makes it."""

    op: Literal["exists", "prefix"]
    parse: Callable[[Sequence[str], object], T]
    hits: Callable[[Sequence[str], T], Iterable[str]]
    fallback: Callable[[Sequence[str]], T]
    whole: Callable[[KvgwClient, list[str]], Awaitable[T]]

    def reading(self, keys: Sequence[str]) -> tuple[Callable[[object], T], Callable[[T], Iterable[str]]]:
        return functools.partial(self.parse, keys), functools.partial(self.hits, keys)


EXISTS: _LookupKind[list[bool]] = _LookupKind("exists", _exists_found, _where, lambda keys: [False] * len(keys),
                                              KvgwClient._exists)
PREFIX: _LookupKind[int] = _LookupKind("prefix", _prefix_length, _first, lambda keys: 0, KvgwClient._prefix)
