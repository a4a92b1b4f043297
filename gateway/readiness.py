"""``/readyz``: whether a load balancer should send this gateway requests, what each part's state is, and
the same states as a metric.

The rule: a gateway is taken out of service only for what taking it out can help, a fault of its own.
A fault of something every gateway shares (the filesystem tier's space, the S3 tier, the catalog) would
take every gateway out together, turning a partial outage (reads go on) into a total one; such a gateway
stays ready and says what it cannot do. Each check's value begins with its state:

- ``index``: ``ok``, or ``error: ...`` (not ready): the LMDB index does not answer a read transaction,
  or its directory is not the one opened at start (same device and inode: a removed or replaced
  directory leaves the open environment working on deleted files, which would silently lose every
  update). Lookups cannot be answered: take this gateway out, restart it.
- ``fs``: ``ok``; ``full: ...`` (ready): less free space than ``FULL_BELOW_BYTES`` (or the chunk size
  limit, if smaller), or the tier refuses a new file for lack of space or quota. Reads go on; writes
  answer 507 (the S3 API: 503) until there is room, which the lifecycle makes by evicting. Every gateway
  of a shared NFS tier is full at once, so none is taken out. ``error: ...`` (not ready): no file can
  be created in the tier's staging directory for another reason (the mount is gone, read-only, I/O errors).
- ``catalog``: ``ok``, or ``unreachable: ...`` (ready): the catalog does not answer a query within
  ``catalog_deadline``. Reads and writes go on from the credentials, buckets and index this gateway
  holds; the changes it makes wait in memory (``cluster.feed.queued`` in the admin stats) and writes
  answer 503 past ``KVGW_CLUSTER_MAX_QUEUED_EVENTS``; a credential or bucket created meanwhile is not
  known here. Every gateway shares the catalog; none is taken out.
- ``s3`` (with an S3 tier): ``ok``, or ``down: ...`` (ready) while the S3 tier's circuit breaker is open
  or probing (after ``KVGW_S3__BREAKER_THRESHOLD`` failures in a row): what the filesystem tier holds is
  served, S3-only reads and S3-write-tier buckets answer 503.
- ``rebuild`` (reported only): an index rebuild from the tiers running or done.

``ReadinessCache`` runs the checks at most once per ``max_age`` (1 s) whoever asks (load balancers,
``/metrics``), in worker threads, one run at a time: a catalog that hangs costs one thread, not one per
probe. ``ReadinessCollector`` exports the last result as ``kvgw_ready`` and ``kvgw_readiness{check,
state}`` (1 for each check's current state, 0 for its others).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.tiers import TierId
from gateway.runtime import Gateway

FULL_BELOW_BYTES = 1 << 20
"""The filesystem tier counts as full below this many free bytes (or the chunk size limit, if smaller)."""

STATES = {"index": ("ok", "error"), TierId.FS.label: ("ok", "full", "error"), "catalog": ("ok", "unreachable"),
          TierId.S3.label: ("ok", "down")}
"""Every state each check can be in; the first word of its value."""
FAILING = {("index", "error"), (TierId.FS.label, "error")}
"""The states that take a gateway out of service (its own faults; see the module docstring)."""
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class DirectoryIdentity:
    device: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> DirectoryIdentity | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino)


@dataclass(frozen=True, slots=True)
class Report:
    """One run of the checks: ``checks`` maps each check to its value (state first)."""

    ready: bool
    checks: dict[str, str] = field(default_factory=dict)

    def state(self, check: str) -> str:
        return self.checks.get(check, "").split(":", 1)[0]


def state_of(value: str) -> str:
    return value.split(":", 1)[0]


def judge(checks: dict[str, str]) -> Report:
    """Ready unless a check is in a failing state (``FAILING``)."""
    return Report(not any((name, state_of(value)) in FAILING for name, value in checks.items()), checks)


class Readiness:
    """The checks themselves; built once the gateway is open (it remembers the index directory it opened).
    ``index_and_fs`` and ``catalog`` block: run them in worker threads."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._index_path = gateway.settings.index_path
        self._index_identity = DirectoryIdentity.of(self._index_path)

    def index_and_fs(self) -> dict[str, str]:
        return {"index": self._index(), TierId.FS.label: self._fs()}

    def catalog(self) -> str:
        try:
            self._gateway.catalog.list_buckets()
        except Exception as exc:
            return f"unreachable: {type(exc).__name__}; reads and writes go on from what this gateway holds"
        return "ok"

    def s3(self) -> str | None:
        """The S3 tier as the request path sees it (its breaker); None without an S3 tier."""
        tier = self._gateway.tiers.get(TierId.S3)
        if tier is None:
            return None
        breaker = getattr(tier, "breaker_state", "closed")
        if breaker == "closed":
            return "ok"
        return (f"down: the S3 tier's circuit breaker is {breaker}; filesystem-tier chunks are served, "
                "S3-only reads and S3-tier writes answer 503")

    def rebuild(self) -> str | None:
        """The index's rebuild from the tiers (a new, lost or lagging index): running, or how the last went."""
        cluster = self._gateway.cluster
        if cluster.resyncing:
            return "running: lookups fall through to the tiers; listings and usage complete when it ends"
        last = cluster.last_resync
        if last is None:
            return None
        return f"done: {last.chunks} chunks in {last.seconds:.1f} s"

    def _index(self) -> str:
        if DirectoryIdentity.of(self._index_path) != self._index_identity:
            return f"error: the index directory {self._index_path} was removed or replaced since start (restart)"
        try:
            self._gateway.index.count()
        except Exception as exc:
            return f"error: {type(exc).__name__}: {exc}"
        return "ok"

    def _fs(self) -> str:
        settings = self._gateway.settings
        root = settings.fs_root_path
        staging = root / "staging"
        probe = staging / f".ready-{secrets.token_hex(4)}"
        full = "full: {} bytes free in {}; reads go on, writes answer 507 until there is room"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
            stats = os.statvfs(staging)
        except OSError as exc:
            if exc.errno in OUT_OF_SPACE:
                with contextlib.suppress(OSError):
                    stats = os.statvfs(staging)
                    return full.format(stats.f_bavail * stats.f_frsize, root)
                return full.format(0, root)
            return f"error: cannot write in {staging}: {exc.strerror or exc}"
        free = stats.f_bavail * stats.f_frsize
        if free < min(settings.max_chunk_bytes, FULL_BELOW_BYTES):
            return full.format(free, root)
        return "ok"


class ReadinessCache:
    """The checks' last result, at most ``max_age`` seconds old (``current``), run by one caller at a
    time; a catalog query that takes longer than ``catalog_deadline`` reports the catalog unreachable
    (the query goes on in its thread, and no second one starts until it ends)."""

    def __init__(self, readiness: Readiness, *, max_age: float = 1.0, catalog_deadline: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._readiness = readiness
        self._max_age = max_age
        self._catalog_deadline = catalog_deadline
        self._clock = clock
        self._lock = asyncio.Lock()
        self._at = float("-inf")
        self._catalog_query: asyncio.Future[str] | None = None
        self.last = Report(False, {})

    async def current(self) -> Report:
        async with self._lock:
            if self._clock() - self._at > self._max_age:
                self.last = await self._run()
                self._at = self._clock()
            return self.last

    async def _run(self) -> Report:
        readiness = self._readiness
        if self._catalog_query is None or self._catalog_query.done():
            self._catalog_query = asyncio.ensure_future(asyncio.to_thread(readiness.catalog))
        local = await asyncio.to_thread(readiness.index_and_fs)
        try:
            catalog = await asyncio.wait_for(asyncio.shield(self._catalog_query), self._catalog_deadline)
        except TimeoutError:
            catalog = (f"unreachable: no answer within {self._catalog_deadline:g} s; reads and writes go on "
                       "from what this gateway holds")
        checks = {**local, "catalog": catalog}
        for name, value in ((TierId.S3.label, readiness.s3()), ("rebuild", readiness.rebuild())):
            if value is not None:
                checks[name] = value
        return judge(checks)


class ReadinessCollector(Collector):
    """The last readiness result as metrics: ``kvgw_ready`` and ``kvgw_readiness{check, state}``."""

    def __init__(self, last: Callable[[], Report]) -> None:
        self._last = last

    def collect(self) -> Iterator[Any]:
        report = self._last()
        ready = GaugeMetricFamily("kvgw_ready", "1 while /readyz answers 200 (the last check, at most 1 s old).")
        ready.add_metric([], 1.0 if report.ready else 0.0)
        yield ready
        states = GaugeMetricFamily("kvgw_readiness", "Each readiness check's state: 1 for the current one "
                                   "(fs full: reads go on, writes 507; catalog unreachable, s3 down: still ready).",
                                   labels=["check", "state"])
        for check, possible in STATES.items():
            if check not in report.checks:
                continue
            current = report.state(check)
            for state in possible:
                states.add_metric([check, state], 1.0 if state == current else 0.0)
        yield states
