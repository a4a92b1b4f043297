"""``kvgw bench lmcache``: the same KV chunks stored and retrieved through LMCache's own storage
paths (0.5.6 or 0.5.7), in one run, against five storage targets on this machine:

    (a) kvgw's connector                   remote-storage plugin, native API, no prefetcher
    (f) kvgw's connector, direct reads     (a) with ``direct_read_root``: chunk files read from kvgw's
                                           fs tier directory (same host), located through the API
    (b) kvgw's connector, prefetcher warm  the lookup staged the request's chunks before the retrieve
    (c) LMCache's S3 connector -> kvgw     kvgw's S3 API (``s3://kvcache.localhost:PORT``)
    (d) LMCache's S3 connector -> moto     ``moto_server``, the same connector and form
    (e) LMCache's local-disk backend       a directory on the same disk as kvgw's data
    (s) a raw socket stream                one request's bytes as one batch-get answers them, written
                                           from memory on one loopback connection (``kvgw bench io``'s
                                           baseline, ``baselines.RawResponder``): what (a) moves at most
    (t) (s), every answer hashed           the same stream, each answer's bytes xxh3-64-hashed once in
                                           (kvgw's client checks every frame it hands over): what any
                                           reader that verifies moves at most; (a) / (t) is what LMCache
                                           and kvgw's client add beyond checking the bytes
    (g) the gateway's batch-get            (a)'s chunks, one batch-get per request as kvgw's client sends
                                           it, read by the load generator: (g) / (s) is the gateway's part
    (k) kvgw's client alone                (a)'s chunks fetched by the connector's client into new
                                           MemoryObjs (``batch_get_into`` from a plain thread): (a) / (k)
                                           is what LMCache's storage manager and the connector add
    (v) (f)'s files, read and verified     the same files, code and checks as (f)'s direct reads
                                           (``DirectReader.read_into``: size and xxh3-64) into the
                                           connector's MemoryObjs, on plain threads: what (f) moves at
                                           most; (f) / (v) is what the connector and client add
    (w) (e)'s files, read and verified     the same for LMCache's disk files, into (e)'s MemoryObjs:
                                           (w) / (e) is what verifying costs, (v) / (w) what kvgw's
                                           file layout costs against LMCache's

Every target is driven by ``gateway.bench.lmcache_engine.Worker``: LMCache's ``StorageManager`` used as
``LMCacheEngine`` uses it (store = ``batched_put``; lookup = ``batched_contains``; retrieve = block
mapping then ``batched_get`` per location). Chunks are ``--chunk-mib`` MiB of bfloat16 KV, requests
``--chunks`` chunks long; every target stores the same contents under its own keys, and the first
retrieve of every request is checked byte for byte.

Measured per target and cache state:

* store MB/s: ``batched_put`` of every request until the backend holds all chunks;
* get MB/s: ``--rounds`` passes of lookup + retrieve per request; only the retrieve is timed;
* get p50 / p99: one chunk per ``batched_get`` call (``location`` given, no lookup), every chunk;
* (s), (t), (g), (k): after each retrieve round of (a), ``--requests`` answers of the stream read with the load
  generator (``baselines.read_streams``), so (a) and its physical limit alternate in the same run;
* (v), (w): after each retrieve round of (f), (e), every request read again that way, alternating
  likewise (so (f) / (v) and (w) / (e) compare rounds of one run; (f) / (e) and (v) / (w) do not).

``--cache warm`` reads what the page cache holds (everything was just written); ``--cache cold``
syncs and drops the page cache of every chunk file (``posix_fadvise(DONTNEED)``, kvgw's chunk
directory and LMCache's disk directory) before each request; moto keeps objects in its own memory,
so (d) is always warm. Targets: (a) >= 70% of (e), (b) >= (e), (c) >= 3x (d), on get MB/s; (a)'s
target is also reported for (f), the same connector configured for a co-located gateway; issue 14's:
warm, (f) >= 0.9x (e) and (a) >= 0.8x (s); cold, (f) >= (e). Cold, (a) / (s) is printed without a
verdict (the stream never reads a disk); (f) / (v), (w) / (e) and (v) / (w) are printed without one:
they say where (f)'s time goes.
Exit status 1 when a target fails or a target could not run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import functools
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from backends.chunkfile import read_meta
from gateway.bench.baselines import RawResponder, batch_request, batch_stream_bytes, read_streams
from gateway.bench.launcher import (
    KvgwProcess,
    add_run_options,
    drop_page_cache,
    files_under,
    moto_server,
    print_report,
    work_directory,
)
from kvgw_client.direct import DirectReader, Location, ReadResult
from kvgw_client.framing import Destination

MiB = 1 << 20
ACCESS_KEY = "KVBENCHLMCACHEACCESS"
SECRET_KEY = "kvgw-bench-lmcache-secret-key-0123456789"
MOTO_KEY = "testing"
BUCKET = "kvcache"
VHOST_DOMAIN = "localhost"  # kvgw's S3 API and moto both take <bucket>.localhost as virtual-hosted


# ---------------------------------------------------------------- servers


@contextlib.contextmanager
def kvgw_server(data_dir: Path, *, fsync: bool) -> Iterator[int]:
    """``kvgw serve`` on its defaults (plus root credentials and ``localhost`` as the S3 base domain)."""
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_S3_API_BASE_DOMAIN": VHOST_DOMAIN}
    server = KvgwProcess(data_dir, extra_args=[] if fsync else ["--no-fsync"], env=env, inherit_kvgw_env=False,
                         log_path=data_dir.parent / "kvgw.log")
    with server:
        yield server.port


@contextlib.contextmanager
def moto(workdir: Path) -> Iterator[int]:
    with moto_server(workdir / "moto.log") as (port, _):
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                     aws_access_key_id=MOTO_KEY, aws_secret_access_key=MOTO_KEY).create_bucket(Bucket=BUCKET)
        yield port


def resolves(name: str) -> bool:
    try:
        return any(info[4][0] == "127.0.0.1" for info in socket.getaddrinfo(name, None))
    except OSError:
        return False


# ---------------------------------------------------------------- measurements


@dataclass
class Result:
    target: str
    label: str
    cache: str
    store_mbps: float = 0.0
    get_mbps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    note: str = ""
    error: str | None = None
    companion_mbps: dict[str, list[float]] = field(default_factory=dict)  # each companion's, one per retrieve round


@dataclass(frozen=True)
class Companion:
    """A baseline measured after each retrieve round of one target, so the two alternate in one run."""

    key: str
    label: str
    note: str
    # (worker, the keys of every request, what to do before each request: drop the page cache when
    # cold) -> MB/s
    measure: Callable[[Any, list[list[Any]], Callable[[], None]], float]


@dataclass
class Target:
    key: str
    label: str
    backend: str  # StorageManager backend name
    make: Callable[[], Any]  # -> lmcache_engine.Worker
    files: Callable[[], list[Path]]  # chunk files whose page cache "cold" drops
    prefetch: bool = False
    always_warm: str = ""  # why "cold" cannot apply
    companions: tuple[Companion, ...] = ()
    results: list[Result] = field(default_factory=list)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))] if ordered else 0.0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from gateway.bench import lmcache_engine as le

        self.le = le
        self.args = args
        self.chunk_bytes = args.chunk_mib * MiB
        self.request_bytes = self.chunk_bytes * args.chunks

    def keys(self, target: Target, request: int) -> list[Any]:
        return self.le.chunk_keys(self.args.chunks, seed=(ord(target.key) << 12) + request)

    def fill(self, objs: list[Any], request: int) -> list[int]:
        """The same contents for request ``request`` in every target."""
        return list(self.le.random_fill_many(objs, seed=request))

    def run(self, target: Target, caches: Sequence[str]) -> None:
        args = self.args
        worker = target.make()
        try:
            digests: list[list[int]] = []
            store_s = 0.0
            for r in range(args.requests):
                keys = self.keys(target, r)
                objs = worker.allocate(args.chunks)
                digests.append(self.fill(objs, r))
                t = time.perf_counter()
                worker.store(keys, objs)
                if not worker.wait_stored(target.backend, keys, timeout=300):
                    raise RuntimeError("stores did not land within 300 s")
                store_s += time.perf_counter() - t
            store_mbps = args.requests * self.request_bytes / max(store_s, 1e-9) / 1e6
            for cache in caches:
                result = Result(target.key, target.label, cache, store_mbps=store_mbps)
                if cache == "cold" and target.always_warm:
                    result.note = target.always_warm
                try:
                    self._retrieve(worker, target, cache, digests, result)
                except Exception as exc:  # report and go on with the next target
                    result.error = f"{type(exc).__name__}: {exc}"
                target.results.append(result)
        finally:
            worker.close()

    def _staged(self, worker: Any, target: Target, keys: list[Any]) -> None:
        """Wait until the lookup's staging is complete: the prefetcher is warm."""
        conn = worker.backend(target.backend).connection.getWrappedConnector()
        names = [conn.name_of(k) for k in keys]
        deadline = time.monotonic() + 60
        while not all(conn.prefetcher.ready(n) for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError("staging did not finish within 60 s")
            time.sleep(0.0005)

    def _retrieve(self, worker: Any, target: Target, cache: str, digests: list[list[int]], result: Result) -> None:
        args, le = self.args, self.le
        elapsed = 0.0
        moved = 0
        for rnd in range(args.rounds):
            for r in range(args.requests):
                keys = self.keys(target, r)
                if cache == "cold":
                    drop_page_cache(target.files())
                if worker.lookup(keys) != len(keys):
                    raise RuntimeError(f"lookup found {worker.lookup(keys)} of {len(keys)} chunks")
                if target.prefetch:
                    self._staged(worker, target, keys)
                t = time.perf_counter()
                got = worker.retrieve(keys, location=target.backend)
                elapsed += time.perf_counter() - t
                try:
                    if len(got) != len(keys):
                        raise RuntimeError(f"retrieved {len(got)} of {len(keys)} chunks")
                    if rnd == 0 and [le.digest(o) for o in got] != digests[r]:
                        raise RuntimeError(f"request {r}: retrieved chunks differ from the stored ones")
                    moved += sum(o.get_size() for o in got)
                finally:
                    le.release(got)
            keys_by_request = [self.keys(target, r) for r in range(args.requests)]
            before_each = (lambda: drop_page_cache(target.files())) if cache == "cold" else (lambda: None)
            for companion in target.companions:
                result.companion_mbps.setdefault(companion.key, []).append(
                    companion.measure(worker, keys_by_request, before_each))
        result.get_mbps = moved / max(elapsed, 1e-9) / 1e6
        latencies: list[float] = []
        for r in range(args.requests):
            keys = self.keys(target, r)
            if cache == "cold":
                drop_page_cache(target.files())
            if target.prefetch:
                worker.lookup(keys)
                self._staged(worker, target, keys)
            for key in keys:
                t = time.perf_counter()
                got = worker.storage.batched_get(keys=[key], location=target.backend)
                latencies.append(time.perf_counter() - t)
                if got[0] is None:
                    raise RuntimeError("a single-chunk get returned nothing")
                le.release(got)
        result.p50_ms = 1000 * statistics.median(latencies)
        result.p99_ms = 1000 * _percentile(latencies, 0.99)


# ---------------------------------------------------------------- report


class Ratio(NamedTuple):
    """One line of the report's ratios: ``num`` / ``den`` on get MB/s, a target when ``need`` is set."""

    num: str
    den: str
    need: float | None
    text: str
    cache: str | None = None  # the one cache state it applies to; None: both
    why: str = ""  # shown instead of a verdict when there is no target


TARGETS = (
    Ratio("a", "e", 0.7, "(a) >= 70% of (e)"),
    Ratio("f", "e", 0.7, "(f) >= 70% of (e)"),
    Ratio("f", "e", 0.9, "(f) >= 0.9x (e)", "warm"),  # issue 14
    Ratio("f", "e", 1.0, "(f) >= (e)", "cold"),  # issue 14
    Ratio("b", "e", 1.0, "(b) >= (e)"),
    Ratio("c", "d", 3.0, "(c) >= 3x (d)"),
    Ratio("a", "s", 0.8, "(a) >= 0.8x (s)", "warm"),  # issue 14
    Ratio("a", "s", None, "(a) / (s)", "cold", "no target: (s) reads no disk"),
    Ratio("a", "t", None, "(a) / (t)", "warm", "no target: (t), the stream verified, bounds any reader that checks"),
    Ratio("t", "s", None, "(t) / (s)", "warm", "no target: what verifying every byte costs the stream"),
    Ratio("g", "s", None, "(g) / (s)", "warm", "no target: the gateway's batch-get against the raw stream"),
    Ratio("k", "t", None, "(k) / (t)", "warm", "no target: kvgw's client against the verified stream"),
    Ratio("a", "k", None, "(a) / (k)", "warm", "no target: what LMCache and the connector's hand-off add"),
    Ratio("f", "v", None, "(f) / (v)", why="no target: (f) against a bare verified read"),
    Ratio("w", "e", None, "(w) / (e)", why="no target: what verifying costs (alternated)"),
    Ratio("v", "w", None, "(v) / (w)", why="no target: kvgw's files against LMCache's, both verified"),
)


def companion_result(companion: Companion, r: Result) -> Result:
    """A companion, measured between ``r``'s rounds, as a row of its own: the median over those rounds."""
    rounds = r.companion_mbps[companion.key]
    return Result(companion.key, companion.label, r.cache, get_mbps=statistics.median(rounds),
                  note=f"median of {len(rounds)}, {companion.note}", error=r.error)


class ReadSide(NamedTuple):
    """What a bare verified read of one target's chunk files needs (found untimed)."""

    root: Path
    threads: int
    locations: list[list[Location]]  # per request, per chunk
    land: Callable[[Location], tuple[Destination, Callable[[], None]] | None]  # a destination and its release


def kvgw_side(worker: Any, keys: list[list[Any]], *, backend: str, root: Path) -> ReadSide:
    """(f)'s files: located by their footers under kvgw's fs tier ``root``; each lands where the
    connector's would (``open_landing``: a new MemoryObj, the metadata header in a small buffer)."""
    conn = worker.backend(backend).connection.getWrappedConnector()
    where: dict[str, Location] = {}
    for path in files_under(root / "chunks"):
        meta = read_meta(str(path))
        where[meta.key] = Location(meta.size, meta.checksum, str(path.relative_to(root)))

    def land(loc: Location) -> tuple[Destination, Callable[[], None]] | None:
        opened = conn.open_landing(loc.size)
        return None if opened is None else (opened[0], opened[1].release)
    return ReadSide(root, conn.client.settings.direct_read_threads,
                    [[where[conn.name_of(k)] for k in request] for request in keys], land)


def disk_side(worker: Any, keys: list[list[Any]], *, root: Path) -> ReadSide:
    """(e)'s files: LMCache's local-disk map says where, their xxh3 is taken once; each lands in a new
    MemoryObj, as (e)'s do; as many threads as (e)'s read pool (LMCache's ``disk_io_threads``)."""
    from gateway.bench import lmcache_engine as le

    disk = worker.backend(le.LOCAL_DISK)
    with disk.disk_lock:
        paths = [[Path(disk.dict[k].path) for k in request] for request in keys]
    locations = [[Location(p.stat().st_size, xxhash.xxh3_64_intdigest(p.read_bytes()), str(p.relative_to(root)))
                  for p in request] for request in paths]

    def land(loc: Location) -> tuple[Destination, Callable[[], None]] | None:
        obj = worker.allocate(1)[0]
        return obj.byte_array, obj.ref_count_down
    return ReadSide(root, disk._read_thread_pool._max_workers, locations, land)


def verified_read_mbps(worker: Any, keys: list[list[Any]], before_each: Callable[[], None], *,
                       side: Callable[[Any, list[list[Any]]], ReadSide]) -> float:
    """A target's chunk files read with the same code and checks as the connector's direct reads
    (``DirectReader.read_into``: size and xxh3-64) into destinations taken as the target takes them, on
    plain threads; no event loop, no client, no LMCache storage manager. MB/s over the requests."""
    files = side(worker, keys)
    reader = DirectReader(str(files.root), threads=1)
    moved, elapsed = 0, 0.0
    try:
        with cf.ThreadPoolExecutor(max_workers=files.threads, thread_name_prefix="bench-verified-read") as pool:
            for r, locs in enumerate(files.locations):
                before_each()
                t = time.perf_counter()
                landings = [files.land(loc) for loc in locs]
                try:
                    if any(landing is None for landing in landings):
                        raise RuntimeError("no memory for a verified read")
                    dests = [landing[0] for landing in landings if landing is not None]
                    results = list(pool.map(reader.read_into, locs, dests))
                    elapsed += time.perf_counter() - t
                finally:
                    for landing in landings:
                        if landing is not None:
                            landing[1]()
                if any(res is not ReadResult.OK for res in results):
                    raise RuntimeError(f"request {r} read back {[res.value for res in results]}")
                moved += sum(loc.size for loc in locs)
    finally:
        reader.close()
    return moved / max(elapsed, 1e-9) / 1e6


def gateway_stream_mbps(worker: Any, keys: list[list[Any]], before_each: Callable[[], None], *,
                        backend: str, address: tuple[str, int], body_bytes: int) -> float:
    """(g): each request's chunks as one batch-get from the gateway, sent as kvgw's client sends it (it
    verifies: the gateway sends the files unverified), read to its end into one buffer by the load
    generator: no kvgw client, no LMCache. (g) / (s) is the gateway against the raw stream."""
    conn = worker.backend(backend).connection.getWrappedConnector()
    requests = [batch_request(BUCKET, [conn.name_of(k) for k in request], credential=(ACCESS_KEY, SECRET_KEY))
                for request in keys]
    moved, elapsed = 0, 0.0
    for request in requests:
        before_each()
        got = read_streams(address, request, body_bytes, count=1)
        if got.errors:
            raise RuntimeError(f"the gateway's batch-get: {got.error_samples[:1]}")
        moved += got.bytes
        elapsed += got.elapsed
    return moved / max(elapsed, 1e-9) / 1e6


def _land(conn: Any, landings: list[Any], index: int, length: int) -> Destination | None:
    """A batch item's destination, as the connector's fetch takes it: a new MemoryObj (kept in ``landings``)."""
    opened = conn.open_landing(length)
    if opened is None:
        return None
    dest: Destination
    dest, landings[index] = opened
    return dest


def client_batch_mbps(worker: Any, keys: list[list[Any]], before_each: Callable[[], None], *,
                      backend: str) -> float:
    """(k): the connector's own client and landings without LMCache: each request's chunks fetched by
    ``KvgwClient.blocking.batch_get_into`` from a plain thread into new MemoryObjs (``open_landing``,
    as the connector's fetch takes them), every frame's xxh3 checked. (a) / (k) is what LMCache's
    storage manager and the connector's hand-off to the client's I/O loop add."""
    from kvgw_client.framing import ItemStatus

    conn = worker.backend(backend).connection.getWrappedConnector()
    moved, elapsed = 0, 0.0
    for request in keys:
        names = [conn.name_of(k) for k in request]
        landings: list[Any] = [None] * len(names)
        into = functools.partial(_land, conn, landings)
        before_each()
        t = time.perf_counter()
        try:
            statuses = conn.client.blocking.batch_get_into(names, into)
            elapsed += time.perf_counter() - t
            if any(status != ItemStatus.OK for status in statuses):
                raise RuntimeError(f"batch_get_into: {[str(s) for s in statuses]}")
            moved += sum(landing.obj.get_size() for landing in landings)
        finally:
            for landing in landings:
                if landing is not None:
                    landing.release()
    return moved / max(elapsed, 1e-9) / 1e6


def report(targets: list[Target], caches: Sequence[str], header: str) -> tuple[str, bool]:
    lines = [header, ""]
    lines.append(f"{'cache':<6}{'target':<44}{'store MB/s':>11}{'get MB/s':>10}{'get p50 ms':>11}{'get p99 ms':>11}")
    by_key: dict[tuple[str, str], Result] = {}
    for cache in caches:
        for t in targets:
            for r in t.results:
                if r.cache != cache:
                    continue
                rows = [r, *(companion_result(c, r) for c in t.companions if r.companion_mbps.get(c.key))]
                for row in rows:
                    by_key[(cache, row.target)] = row
                    name = f"({row.target}) {row.label}"
                    if row.error:
                        lines.append(f"{cache:<6}{name:<44}  error: {row.error}")
                        continue
                    note = f"  ({row.note})" if row.note else ""
                    shown = [f"{v:>{w}.{d}f}" if v else f"{'-':>{w}}" for v, w, d in
                             ((row.store_mbps, 11, 0), (row.get_mbps, 10, 0), (row.p50_ms, 11, 2), (row.p99_ms, 11, 2))]
                    lines.append(f"{cache:<6}{name:<44}{''.join(shown)}{note}")
    lines += ["", "targets (get MB/s):"]
    ok = True
    for cache in caches:
        for line in TARGETS:
            if line.cache not in (None, cache):
                continue
            a, b = by_key.get((cache, line.num)), by_key.get((cache, line.den))
            if a is None or b is None or a.error or b.error or b.get_mbps <= 0:
                lines.append(f"{cache:<6}{line.text:<22} n/a (a target did not run)")
                ok = ok and line.need is None
                continue
            ratio = a.get_mbps / b.get_mbps
            if line.need is None:
                verdict = f"({line.why})"
            else:
                verdict = "PASS" if ratio >= line.need else "FAIL"
                ok = ok and verdict == "PASS"
            p50s = f"   (p50 {a.p50_ms:.2f} vs {b.p50_ms:.2f} ms)" if a.p50_ms and b.p50_ms else ""
            lines.append(f"{cache:<6}{line.text:<22}{a.get_mbps:>8.0f} / {b.get_mbps:<8.0f} = {ratio:5.2f}   "
                         f"{verdict}{p50s}")
    return "\n".join(lines), ok


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench lmcache", description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--chunk-mib", type=int, default=8, help="chunk size in MiB (default 8)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per request (default 16)")
    add_run_options(p, read="retrieve", read_done="retrieved", targets="abcdef", example="afe",
                    no_fsync_note="LMCache's disk never fsyncs", other="LMCache's disk cache")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        from gateway.bench import lmcache_engine as le
    except ImportError as exc:
        print(f"kvgw bench lmcache needs LMCache 0.5.6 or 0.5.7 (.ci/install-lmcache.sh): {exc}", file=sys.stderr)
        return 2
    caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
    with work_directory(args, "kvgw-bench-lmcache-") as workdir:
        kvgw_dir, disk_dir = workdir / "kvgw-data", workdir / "lmcache-disk"
        disk_dir.mkdir(exist_ok=True)
        bench = Bench(args)
        pool_gb = 3.2 * bench.request_bytes / (1 << 30) + 0.1
        vhost = f"{BUCKET}.{VHOST_DOMAIN}"
        targets: list[Target] = []
        moto_error = ""
        with contextlib.ExitStack() as stack:
            port = stack.enter_context(kvgw_server(kvgw_dir, fsync=not args.no_fsync))
            stream_bytes = batch_stream_bytes(args.chunks, bench.chunk_bytes)
            responder = RawResponder(workdir / "stream", {}, {"/batch-get": stream_bytes}).start()
            stack.callback(responder.stop)
            stream_req = batch_request(BUCKET, [f"chunk-{i}" for i in range(args.chunks)])

            def stream_mbps(verify: bool) -> float:
                """(s), or (t) with ``verify``: --requests answers of the stream, as many as one retrieve
                round of (a) reads."""
                got = read_streams(responder.address, stream_req, stream_bytes, count=args.requests, verify=verify)
                if got.errors:
                    raise RuntimeError(f"raw socket stream: {got.error_samples[:1]}")
                return got.bytes_per_s / 1e6
            url = f"http://127.0.0.1:{port}"
            kvgw_files = lambda: files_under(kvgw_dir / "fs" / "chunks")  # noqa: E731

            def kvgw_worker(prefetch: int, direct: bool = False) -> Callable[[], Any]:
                def make() -> Any:
                    settings: dict[str, object] = {"prefetch_bytes": prefetch}
                    if direct:
                        settings["direct_read_root"] = str((kvgw_dir / "fs").resolve())
                    extra = le.kvgw_plugin_extra(url, BUCKET, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                                 **settings)
                    config = le.engine_config(cpu_gb=pool_gb, extra=extra, remote_storage_plugins=[le.KVGW_PLUGIN])
                    return le.Worker(config, le.make_metadata(args.chunk_mib))
                return make

            def s3_worker(endpoint: str, access: str, secret: str) -> Callable[[], Any]:
                def make() -> Any:
                    config = le.engine_config(cpu_gb=pool_gb, extra=le.s3_connector_extra(access, secret),
                                              remote_url=endpoint)
                    return le.Worker(config, le.make_metadata(args.chunk_mib))
                return make

            def disk_worker() -> Any:
                config = le.engine_config(cpu_gb=pool_gb, local_disk=f"file://{disk_dir}/",
                                          max_local_disk_size=2 * args.requests * bench.request_bytes / (1 << 30) + 1)
                return le.Worker(config, le.make_metadata(args.chunk_mib))

            can_vhost = resolves(vhost)
            s3_note = "" if can_vhost else f"{vhost} does not resolve: add '127.0.0.1 {vhost}' to /etc/hosts"
            if "a" in args.only:
                targets.append(Target("a", "kvgw connector", le.REMOTE_KVGW, kvgw_worker(0), kvgw_files,
                                      companions=(
                                          Companion("s", "raw socket stream, same bytes", "from memory, one connection",
                                                    lambda _worker, _keys, _before: stream_mbps(False)),
                                          Companion("t", "(s) with every answer's xxh3", "hashed as it lands",
                                                    lambda _worker, _keys, _before: stream_mbps(True)),
                                          Companion("g", "the gateway's batch-get of (a)'s chunks",
                                                    "load generator, no client",
                                                    functools.partial(gateway_stream_mbps, backend=le.REMOTE_KVGW,
                                                                      address=("127.0.0.1", port),
                                                                      body_bytes=stream_bytes + MiB)),
                                          Companion("k", "kvgw's client, (a)'s chunks and landings",
                                                    "batch_get_into, no LMCache",
                                                    functools.partial(client_batch_mbps, backend=le.REMOTE_KVGW)))))
            if "f" in args.only:
                kvgw_read = functools.partial(kvgw_side, backend=le.REMOTE_KVGW, root=kvgw_dir / "fs")
                verified = functools.partial(verified_read_mbps, side=kvgw_read)
                targets.append(Target("f", "kvgw connector, direct reads", le.REMOTE_KVGW,
                                      kvgw_worker(0, direct=True), kvgw_files,
                                      companions=(Companion("v", "(f)'s files read and verified", "plain threads",
                                                            verified),)))
            if "b" in args.only:
                targets.append(Target("b", "kvgw connector, prefetcher warm", le.REMOTE_KVGW,
                                      kvgw_worker(int(1.25 * bench.request_bytes)), kvgw_files, prefetch=True))
            if "c" in args.only:
                targets.append(Target("c", "LMCache S3 connector -> kvgw S3 API", le.REMOTE_URL,
                                      s3_worker(f"s3://{vhost}:{port}", ACCESS_KEY, SECRET_KEY), kvgw_files))
            if "d" in args.only:
                try:
                    moto_port = stack.enter_context(moto(workdir))
                except Exception as exc:  # no moto: (d) reports why, the rest still runs
                    moto_error = f"moto_server did not start: {exc}"
                    moto_port = 0
                else:
                    moto_error = ""
                targets.append(Target("d", "LMCache S3 connector -> moto", le.REMOTE_URL,
                                      s3_worker(f"s3://{vhost}:{moto_port}", MOTO_KEY, MOTO_KEY), lambda: [],
                                      always_warm="moto keeps objects in memory"))
            if "e" in args.only:
                disk_read = functools.partial(disk_side, root=disk_dir)
                targets.append(Target("e", "LMCache local-disk backend", le.LOCAL_DISK, disk_worker,
                                      lambda: files_under(disk_dir),
                                      companions=(Companion("w", "(e)'s files read and verified", "as (v) reads",
                                                            functools.partial(verified_read_mbps, side=disk_read)),)))
            for target in targets:
                skip = s3_note if target.key in "cd" else ""
                skip = skip or (moto_error if target.key == "d" else "")
                if skip:
                    target.results = [Result(target.key, target.label, c, error=skip) for c in caches]
                    continue
                print(f"running ({target.key}) {target.label} ...", file=sys.stderr, flush=True)
                try:
                    bench.run(target, caches)
                except Exception as exc:
                    target.results = [Result(target.key, target.label, c, error=f"{type(exc).__name__}: {exc}")
                                      for c in caches]
        return print_report(
            lambda header: report(targets, caches, header),
            title=(f"kvgw bench lmcache: {args.requests} requests x {args.chunks} chunks x {args.chunk_mib} MiB "
                   f"({args.requests * bench.request_bytes / MiB:.0f} MiB), {args.rounds} retrieve rounds"),
            engine="LMCache", dist="lmcache", fsync=not args.no_fsync, other="LMCache disk cache",
            kvgw_dir=kvgw_dir, other_dir=disk_dir, workdir=workdir)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
