"""kvgw as a secondary tier of vLLM's tiering manager: the parts that need neither vLLM nor torch.

``kvgw_client.vllm.KvgwTier`` is the class vLLM loads; this module holds what it is made of, so each
part is tested without vLLM: its settings (the tier's keys in ``secondary_tiers``), block names, the
per-step lookup batch, the background jobs, and the event queue.

Threads. vLLM calls a tier only under its manager lock, from the scheduler thread or its tier-poll
thread, never concurrently, and every call must return at once. So nothing here waits on the network:
lookups, stores and loads are futures on the kvgw client's own I/O thread (``KvgwClient.spawn``); the
scheduler side only starts them and, at its next call, collects what finished. What the I/O thread
hands back crosses in thread-safe structures (a ``deque`` of finished jobs, ``cf.Future`` results).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgw_client.changes import ChangePage
from kvgw_client.config import ClientSettings, SettingsReader, credentials_from_env, read_client_settings
from kvgw_client.framing import Destination, ItemStatus
from kvgw_client.health import Counters
from kvgw_client.http import KvgwClient, PutOutcome

DEFAULT_BUCKET = "kvcache"
EVENT_MODES = ("all", "own")

VLLM_KEYS = frozenset({"locality", "enable_kv_events"})
"""Keys vLLM's tier factory leaves in the dict for every tier (it removes ``type``, ``module_path``,
``backpressure``): the tier reads them as settings too."""


@dataclass(frozen=True)
class TierSettings:
    """The tier's keys in vLLM's ``secondary_tiers`` entry (docs/vllm.md lists each), with the client's."""

    client: ClientSettings
    prefix: str = ""  # names start with it: vLLM's fs tier's root_dir, the obj tier's prefix
    ttl: int | None = None  # X-Kvgw-TTL on every block
    lookup_timeout: float = 2.0  # deadline of a step's lookup batch: then its keys miss
    io_timeout: float = 30.0  # deadline of one store or load job: then its blocks fail
    load_streams: int = 1  # a load job's blocks go out as this many batch-gets at once (1: one per job)
    answer_ttl: float | None = None  # seconds a lookup's answer is reused; None: half the lease (or 1 s)
    locality: str = "REMOTE"  # KV events' locality: REMOTE (a shared gateway) or LOCAL
    enable_kv_events: bool = False  # report blocks through vLLM's KV events (with enable_kv_cache_events)
    kv_events: str = "all"  # all: own stores, others' stores and kvgw's removals; own: own stores only
    events_per_step: int = 1024  # blocks reported per scheduler step at most (the rest wait)
    events_queue: int = 65_536  # blocks waiting to be reported at most (older ones are dropped, counted)
    events_poll_s: float = 0.5  # how often the change stream is read
    parent_map_size: int = 1 << 16

    @classmethod
    def from_options(cls, options: Mapping[str, object], environ: Mapping[str, str]) -> TierSettings:
        """Every key read and checked; an unknown key is an error (a misspelt key would be ignored)."""
        options = dict(options)
        reader = SettingsReader(options, {"bucket": DEFAULT_BUCKET})
        access_key, secret_key = credentials_from_env(environ)
        client = read_client_settings(reader, access_key=access_key, secret_key=secret_key)
        ttl = reader.get_int("ttl_s", 0)
        answer_ttl = reader.get_optional_float("answer_ttl_s")
        settings = cls(
            client=client,
            prefix=(reader.get_str("prefix", "") or "").strip("/"),
            ttl=ttl if ttl > 0 else None,
            lookup_timeout=reader.get_float("lookup_timeout_s", cls.lookup_timeout),
            io_timeout=reader.get_float("io_timeout_s", cls.io_timeout),
            load_streams=reader.get_int("load_streams", cls.load_streams),
            answer_ttl=answer_ttl,
            locality=(reader.get_str("locality", cls.locality) or cls.locality).upper(),
            enable_kv_events=reader.get_bool("enable_kv_events", cls.enable_kv_events),
            kv_events=(reader.get_str("kv_events", cls.kv_events) or cls.kv_events).lower(),
            events_per_step=reader.get_int("events_per_step", cls.events_per_step),
            events_queue=reader.get_int("events_queue", cls.events_queue),
            events_poll_s=reader.get_float("events_poll_s", cls.events_poll_s),
            parent_map_size=reader.get_int("parent_map_size", cls.parent_map_size),
        )
        unknown = reader.leftover(options)
        if unknown:
            raise ValueError(f"unknown kvgw tier settings: {', '.join(unknown)}")
        if min(settings.lookup_timeout, settings.io_timeout, settings.events_poll_s) <= 0:
            raise ValueError("lookup_timeout_s, io_timeout_s and events_poll_s must be positive")
        if settings.answer_ttl is not None and settings.answer_ttl < 0:
            raise ValueError("answer_ttl_s must not be negative")
        if settings.locality not in ("LOCAL", "REMOTE"):
            raise ValueError(f"locality must be LOCAL or REMOTE, not {settings.locality!r}")
        if settings.kv_events not in EVENT_MODES:
            raise ValueError(f"kv_events must be one of {', '.join(EVENT_MODES)}, not {settings.kv_events!r}")
        if min(settings.events_per_step, settings.events_queue, settings.parent_map_size, settings.load_streams) < 1:
            raise ValueError("events_per_step, events_queue, parent_map_size and load_streams must be at least 1")
        return settings

    @property
    def answer_seconds(self) -> float:
        """How long a lookup's answer stands: half the lease its hits got (they are safe that long)."""
        if self.answer_ttl is not None:
            return self.answer_ttl
        return self.client.lease_ms / 2000 if self.client.lease_ms else 1.0


class BlockNames:
    """kvgw keys of vLLM's blocks: ``<namespace>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin`` with ``h`` the block
    hash in hex, the path vLLM's ``FileMapper`` gives a block (its fs tier's file, its obj tier's object)
    with empty segments dropped, as aws-sdk-cpp drops them from the obj tier's object keys. So blocks
    are shared with vLLM's obj tier writing into the same bucket, and a name says model, layout digest
    and rank as vLLM's own tiers say them. ``namespace`` is ``[<prefix>/]<model>_<sha12>_r<rank>``."""

    def __init__(self, namespace: str) -> None:
        self.namespace = "/".join(part for part in namespace.split("/") if part)
        if not self.namespace:
            raise ValueError("empty block namespace")
        self.prefix = self.namespace + "/"

    def name(self, block_hash: bytes, group: int) -> str:
        h = block_hash.hex()
        return f"{self.prefix}{h[:3]}/{h[3:5]}_g{group}/{h}.bin"

    def parse(self, name: str) -> tuple[bytes, int] | None:
        """(block hash, group) of a name in this namespace; None for any other name."""
        if not name.startswith(self.prefix):
            return None
        parts = name[len(self.prefix) :].split("/")
        if len(parts) != 3 or not parts[2].endswith(".bin"):
            return None
        h = parts[2][: -len(".bin")]
        sub, _, group = parts[1].partition("_g")
        try:
            block_hash = bytes.fromhex(h)
            group_idx = int(group)
        except ValueError:
            return None
        if parts[0] != h[:3] or sub != h[3:5] or group_idx < 0 or not h:
            return None
        return block_hash, group_idx


_PENDING = "pending"
_IN_FLIGHT = "in flight"


class StepLookups:
    """Lookups that never block: the keys asked during one scheduler step go out as one batch at its
    end (``flush``, from the tier's ``on_schedule_end``); until its answer arrives a key answers None
    (vLLM's RETRY); the answer is then reused for ``answer_seconds`` (the lease the lookup took keeps a
    hit loadable that long). A batch that fails or passes its deadline answers every key False (a
    miss), so a dead gateway costs one step's retry, not a stall. Owned by the thread holding vLLM's
    manager lock; ``ask`` returns a future that the I/O thread completes."""

    def __init__(self, ask: Callable[[list[str]], cf.Future[list[bool]]], answer_seconds: float, *,
                 clock: Callable[[], float] = time.monotonic, counters: Counters | None = None) -> None:
        self._ask = ask
        self._answer_seconds = answer_seconds
        self._clock = clock
        self._counters = counters or Counters()
        self._state: dict[str, str | tuple[bool, float]] = {}
        self._pending: list[str] = []
        self._in_flight: list[tuple[cf.Future[list[bool]], list[str]]] = []

    def lookup(self, name: str) -> bool | None:
        self._collect()
        state = self._state.get(name)
        if isinstance(state, tuple):
            found, at = state
            if self._clock() - at <= self._answer_seconds:
                return found
            state = None
        if state is None:
            self._state[name] = _PENDING
            self._pending.append(name)
        return None

    def flush(self) -> int:
        """Send the keys asked since the last flush as one batch; how many were sent."""
        self._collect()
        self._prune()
        names, self._pending = self._pending, []
        if not names:
            return 0
        for name in names:
            self._state[name] = _IN_FLIGHT
        try:
            future = self._ask(names)
        except Exception:  # the client is closed: these keys miss
            future = cf.Future()
            future.set_result([False] * len(names))
        self._in_flight.append((future, names))
        self._counters.add("lookup.batches")
        self._counters.add("lookup.keys", len(names))
        return len(names)

    def learn(self, name: str, found: bool) -> None:
        """What is known of a key without asking (a store or load of it, the change stream): it stands
        for ``answer_seconds``. A key whose batch is in flight keeps waiting for that answer."""
        if self._state.get(name) in (_PENDING, _IN_FLIGHT):
            return
        self._state[name] = (found, self._clock())

    def in_flight(self) -> bool:
        return bool(self._in_flight or self._pending)

    def _collect(self) -> None:
        if not self._in_flight:
            return
        still: list[tuple[cf.Future[list[bool]], list[str]]] = []
        now = self._clock()
        for future, names in self._in_flight:
            if not future.done():
                still.append((future, names))
                continue
            try:
                found = future.result()
            except Exception:  # quiet lookups do not raise; a closed client might
                found = [False] * len(names)
            if len(found) != len(names):
                found = [False] * len(names)
            hits = 0
            for name, hit in zip(names, found, strict=True):
                if self._state.get(name) == _IN_FLIGHT:
                    self._state[name] = (hit, now)
                hits += hit
            self._counters.add("lookup.hits", hits)
        self._in_flight = still

    def _prune(self) -> None:
        """Forget answers past their time (bounded memory)."""
        if len(self._state) < 4096:
            return
        now = self._clock()
        stale = [n for n, s in self._state.items() if isinstance(s, tuple) and now - s[1] > self._answer_seconds]
        for name in stale:
            del self._state[name]


@dataclass(frozen=True, slots=True)
class JobOutcome:
    job_id: int
    store: bool
    ok: list[bool]  # per block, in the job's order
    nbytes: int  # bytes moved by the blocks that succeeded
    seconds: float


class TierJobs:
    """Store and load jobs between vLLM's primary buffer and kvgw, each on the client's I/O loop.

    A store sends the job's blocks as PUTs, all in flight at once, straight from the primary buffer,
    each naming its parent; a load is one batch-get (``streams`` of them at once for a large job, each
    over consecutive blocks) whose frames are written straight into the primary buffer at each block's
    offset (or read from the shared mount, when the client has ``direct_read_root``). vLLM pins a
    job's blocks until it sees the job finish, so the buffer is valid while the job runs; no job
    outlives ``io_timeout`` (a load's stream is cut then, its remaining blocks fail, and nothing is
    written into the buffer afterwards)."""

    def __init__(self, client: KvgwClient, buffer: memoryview, block_bytes: int, *, ttl: int | None,
                 io_timeout: float, streams: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._buffer = buffer
        self._block = block_bytes
        self._ttl = ttl
        self._timeout = io_timeout
        self._streams = max(1, streams)
        self._clock = clock
        self._done: deque[JobOutcome] = deque()
        self._running: dict[int, cf.Future[None]] = {}
        self._lock = threading.Lock()

    def _views(self, offsets: Sequence[int]) -> list[memoryview]:
        return [self._buffer[o : o + self._block] for o in offsets]

    def store(self, job_id: int, names: list[str], offsets: Sequence[int], parents: list[str | None]) -> None:
        self._start(job_id, self._store(job_id, names, self._views(offsets), parents), store=True, count=len(names))

    def load(self, job_id: int, names: list[str], offsets: Sequence[int]) -> None:
        self._start(job_id, self._load(job_id, names, self._views(offsets)), store=False, count=len(names))

    def _start(self, job_id: int, coro: Coroutine[Any, Any, None], *, store: bool, count: int) -> None:
        try:
            future = self._client.spawn(coro)
        except Exception:  # the client is closed: the job fails, reported like any other
            coro.close()
            self.fail(job_id, count, store=store)
            return
        with self._lock:
            self._running[job_id] = future
        future.add_done_callback(lambda _f: self._forget(job_id))

    def fail(self, job_id: int, count: int, *, store: bool) -> None:
        """Report a job that could not start as failed, through ``finished`` like the others."""
        self._done.append(JobOutcome(job_id, store, [False] * count, 0, 0.0))

    def _forget(self, job_id: int) -> None:
        with self._lock:
            self._running.pop(job_id, None)

    async def _store(self, job_id: int, names: list[str], views: list[memoryview], parents: list[str | None]) -> None:
        started = self._clock()
        ok = [False] * len(names)
        try:
            outcomes = await self._client.put_many(names, views, parents=parents, ttl=self._ttl,
                                                   timeout=self._timeout)
            ok = [o is not PutOutcome.FAILED for o in outcomes]
        finally:
            self._finish(job_id, True, ok, started)

    async def _load(self, job_id: int, names: list[str], views: list[memoryview]) -> None:
        started = self._clock()
        ok = [False] * len(names)
        block = self._block
        # consecutive runs, at least 4 blocks each: a stream per 2 blocks would cost more than it gains
        per = max(4, -(-len(names) // self._streams))
        parts = [range(i, min(i + per, len(names))) for i in range(0, len(names), per)]

        async def part(indices: range) -> None:
            def into(index: int, length: int) -> Destination | None:
                # a block of another size is not this model's
                return views[indices[index]] if length == block else None

            statuses = await self._client.batch_get_into([names[i] for i in indices], into, quiet=True,
                                                         timeout=self._timeout)
            for i, status in zip(indices, statuses, strict=True):
                ok[i] = status is ItemStatus.OK

        try:
            await asyncio.gather(*(part(p) for p in parts))
        finally:
            self._finish(job_id, False, ok, started)

    def _finish(self, job_id: int, store: bool, ok: list[bool], started: float) -> None:
        self._done.append(JobOutcome(job_id, store, ok, sum(ok) * self._block, self._clock() - started))

    def finished(self) -> list[JobOutcome]:
        """Jobs finished since the last call (any thread; vLLM's calls it under its lock)."""
        out: list[JobOutcome] = []
        while True:
            try:
                out.append(self._done.popleft())
            except IndexError:
                return out

    def pending(self) -> int:
        with self._lock:
            return len(self._running)

    def close(self) -> None:
        """Let go of vLLM's buffer (after ``drain``: no job may run): vLLM unmaps it at its shutdown."""
        self._buffer.release()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job started so far has finished (its outcome queued); False on timeout."""
        with self._lock:
            futures = list(self._running.values())
        _, not_done = cf.wait(futures, timeout=timeout)
        return not not_done


@dataclass(frozen=True, slots=True)
class BlockEvent:
    names: list[str]
    removed: bool


class EventQueue:
    """Blocks to report through vLLM's KV events, bounded: ``take`` hands out at most ``per_step``
    blocks per call (the rest wait for the next step); past ``limit`` waiting blocks the oldest are
    dropped and counted (``events.dropped``): a router then misses them, as it misses any event of a
    lossy stream. Thread-safe: the I/O thread adds the change stream's, vLLM's thread its own stores."""

    def __init__(self, per_step: int, limit: int, counters: Counters) -> None:
        self._per_step = per_step
        self._limit = limit
        self._counters = counters
        self._queue: deque[tuple[str, bool]] = deque()
        self._lock = threading.Lock()

    def add(self, items: Iterable[tuple[str, bool]]) -> None:
        """``(name, removed)`` pairs, in the order they happened."""
        stored = removed = 0
        with self._lock:
            for name, gone in items:
                self._queue.append((name, gone))
                removed += gone
                stored += not gone
            over = len(self._queue) - self._limit
            for _ in range(max(0, over)):
                self._queue.popleft()
        self._counters.add("events.stored", stored)
        self._counters.add("events.removed", removed)
        if over > 0:
            self._counters.add("events.dropped", over)

    def take(self) -> list[BlockEvent]:
        """Up to ``per_step`` blocks, in arrival order, grouped into runs of one kind."""
        with self._lock:
            n = min(self._per_step, len(self._queue))
            items = [self._queue.popleft() for _ in range(n)]
        out: list[BlockEvent] = []
        for name, removed in items:
            if out and out[-1].removed == removed:
                out[-1].names.append(name)
            else:
                out.append(BlockEvent([name], removed))
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)


class OwnStores:
    """The names this tier stored lately (bounded): the change stream reports them too, and they were
    reported already when their store finished."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._names: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                self._names[name] = None
                self._names.move_to_end(name)
            while len(self._names) > self._limit:
                self._names.popitem(last=False)

    def discard(self, name: str) -> None:
        """``name`` was removed: a later store of it, by anyone, is news again."""
        with self._lock:
            self._names.pop(name, None)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._names


def changes_to_events(page: ChangePage, names: BlockNames, own: OwnStores) -> list[tuple[str, bool]]:
    """``(name, removed)`` of a change-stream page's blocks, in its order: names outside the namespace
    and this tier's own stores (reported when they finished) are left out."""
    out: list[tuple[str, bool]] = []
    for change in page.changes:
        if names.parse(change.key) is None:
            continue
        if change.op == "removed":
            own.discard(change.key)
            out.append((change.key, True))
        elif change.key not in own:
            out.append((change.key, False))
    return out
