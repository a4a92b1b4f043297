"""``kvgw bench cluster``: what running many gateways as one tier costs (issue 11, sections 2 and 5).

Rows, each measured on real ``kvgw serve`` processes:

- **memory**: RSS of a gateway holding ``--chunks`` (default 1M) indexed chunks against the same gateway
  holding ``--baseline-chunks`` (100k), per chunk (the difference over the difference in chunks), next to
  the budget of 64 bytes. The chunks are written straight into the index by a loader (8 MiB chunks in
  prefix chains of 64 whose files are empty placeholders, the shared usage ledger set to match), not PUT
  one by one; then
  the gateway starts, serves the same prefix and exists lookups spread over all of them, and its
  lifecycle leader makes the same number of evictions with the sampled ``default`` policy (the bucket's
  capacity is set just under what it holds). Anonymous RSS is the process's own memory; file-backed RSS
  is the LMDB map's pages the kernel keeps for it (page cache: shared, evictable, not the process's).
- **coordination**: 8 MiB PUT latency and 64-key ``prefix`` latency of one gateway with the cluster on
  (change feed, shared usage ledger, membership, lifecycle lease on PostgreSQL) and off
  (``KVGW_CLUSTER_ENABLED=false``, the same catalog), alternated round by round. What a read lease
  adds to a lookup is ``kvgw bench leases``.
- **feed lag**: ``--writers`` clients PUT into gateway A; gateway B's subscriber reports how long each
  event took from A's write to B's index (p50 / p99).
- **workers**: 8 MiB PUT and GET throughput and the server's CPU seconds per GiB (all its processes)
  with ``kvgw serve --workers 1`` and ``2``; the client runs on the same cores.

PostgreSQL comes from ``--pg-url`` (default ``KVGW_TEST_PG_URL`` or the local test database); each run
uses a schema of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.bench import procstat
from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import HttpConnection, LoadRequest, Stats, percentile, request_once, run_load

MiB = 1 << 20
BUCKET = "kvcache"
BUDGET_BYTES_PER_CHUNK = 64
CHAIN = 64
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _target(key: str) -> str:
    return f"/v1/buckets/{BUCKET}/chunks/{key}"


def _stats(server: KvgwProcess) -> dict[str, Any]:
    status, body = request_once(server.address, LoadRequest("GET", "/v1/admin/stats"))
    if status != 200:
        raise RuntimeError(f"stats: {status} {body[:200]!r}")
    doc: dict[str, Any] = json.loads(body)
    return doc


def _server(data_dir: Path, env: dict[str, str], *, workers: int = 1) -> KvgwProcess:
    return KvgwProcess(data_dir, extra_args=["--anonymous-admin", "--workers", str(workers)],
                       env={"KVGW_WORKERS": str(workers), **env}, inherit_kvgw_env=False,
                       log_path=data_dir.parent / f"{data_dir.name}.log")


def _pids(server: KvgwProcess) -> list[int]:
    pids = server.pids()
    return pids + [child for pid in pids for child in procstat.children(pid)]


@contextmanager
def _pg_schema(url: str) -> Iterator[str]:
    """A fresh schema; the URL pins it as search_path (as the tests do)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    schema = f"kvgw_bench_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


# -- memory ----------------------------------------------------------------------------------------


def load_chunks(data_dir: Path, count: int, size: int, *, progress: Callable[[int], None] | None = None) -> float:
    """Write ``count`` chunks of ``size`` bytes into the (stopped) gateway's index, chained ``CHAIN`` long,
    and set the shared usage ledger to match; returns seconds taken. Each chunk's file is an empty
    placeholder (so an eviction removes a file, as it would a real chunk's, and is published as one)."""
    from backends.index import ChunkIndex, IndexEntry
    from backends.posix import PosixTier
    from backends.tiers import TierId
    from gateway.cluster.db import ClusterDB
    from gateway.cluster.resync import TierCount
    from gateway.cluster.usage import write_usage
    from gateway.config import load_settings
    from kvgw_client.keys import chunk_digest

    started = time.monotonic()
    settings = load_settings(data_dir=data_dir)
    index = ChunkIndex(settings.index_path, map_size=settings.index_map_size)
    tier = PosixTier(settings.fs_root_path, fsync=False)
    made: set[str] = set()
    now = time.time()
    batch = 20_000
    try:
        for first in range(0, count, batch):
            items, parents = [], []
            for i in range(first, min(first + batch, count)):
                key = f"chain{i // CHAIN}/block{i % CHAIN}"
                digest = chunk_digest(BUCKET, key)
                path = tier.path_for(digest)
                folder = os.path.dirname(path)
                if folder not in made:
                    os.makedirs(folder, exist_ok=True)
                    made.add(folder)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
                items.append((digest, IndexEntry(BUCKET, key, size, i, now - count + i, 0.0, now - count + i, 0,
                                                 TierId.FS)))
                parents.append(None if i % CHAIN == 0
                               else chunk_digest(BUCKET, f"chain{i // CHAIN}/block{i % CHAIN - 1}"))
            asyncio.run(index.put_many(items, parents))
            if progress is not None:
                progress(min(first + batch, count))
        held = index.usage(BUCKET, int(TierId.FS))
    finally:
        index.close()
    db = ClusterDB(settings.catalog_dsn)
    try:
        write_usage(db, TierCount(totals={(BUCKET, int(TierId.FS)): [held[0], held[1]]}), [int(TierId.FS)],
                    now=time.time(), since=None)
    finally:
        db.close()
    return time.monotonic() - started


def _set_capacity(data_dir: Path, capacity: int) -> None:
    """Set the bucket's capacity, with watermarks 0.999 / 0.997."""
    from dataclasses import replace

    from gateway.config import load_settings
    from gateway.runtime import open_catalog

    catalog = open_catalog(load_settings(data_dir=data_dir))
    try:
        policy = catalog.get_bucket(BUCKET)
        assert policy is not None
        catalog.update_bucket(replace(policy, capacity_bytes=capacity, high_watermark=HIGH, low_watermark=LOW))
    finally:
        catalog.close()


HIGH, LOW = 0.999, 0.997


def capacity_for(chunks: int, size: int, evictions: int) -> int:
    """The capacity over whose high watermark ``chunks`` are and that takes ``evictions`` to reach the
    low one (needs evictions > (HIGH - LOW) / HIGH * chunks)."""
    return int((chunks - evictions) * size / LOW)


def _lookups(server: KvgwProcess, chunks: int, count: int) -> dict[str, float]:
    """``count`` 64-key prefix lookups of random chains, each followed by an exists of 64 random keys."""
    rng = random.Random(1)
    chains = max(1, chunks // CHAIN)
    conn = HttpConnection(server.address)
    lat: list[float] = []
    json_type = [("Content-Type", "application/json")]
    try:
        for _ in range(count):
            chain = rng.randrange(chains)
            body = json.dumps({"keys": [f"chain{chain}/block{b}" for b in range(CHAIN)]}).encode()
            t0 = time.perf_counter()
            status, _ = conn.request(LoadRequest("POST", f"/v1/buckets/{BUCKET}/prefix", body=body, headers=json_type))
            lat.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"prefix: {status}")
            keys = [f"chain{rng.randrange(chains)}/block{rng.randrange(CHAIN)}" for _ in range(64)]
            conn.request(LoadRequest("POST", f"/v1/buckets/{BUCKET}/exists", body=json.dumps({"keys": keys}).encode(),
                                     headers=json_type))
    finally:
        conn.close()
    return {"lookups": len(lat), "prefix_p50_ms": 1000 * percentile(lat, 0.5),
            "prefix_p99_ms": 1000 * percentile(lat, 0.99)}


def _memory(server: KvgwProcess) -> dict[str, int]:
    mem: dict[str, int] = {}
    for pid in _pids(server):
        for name, value in procstat.memory_bytes(pid).items():
            mem[name] = mem.get(name, 0) + value
    return mem


def _held(work: Path, chunks: int, lookups: int, evictions: int, settle: float) -> dict[str, Any]:
    """A gateway holding ``chunks`` indexed chunks, after ``lookups`` lookups and ``evictions`` evictions."""
    data = work / f"mem-{chunks}"
    env = {"KVGW_FSYNC": "false", "KVGW_LIFECYCLE_INTERVAL": "0.5"}
    server = _server(data, env)
    server.start()  # creates the catalog, the index and the feed position
    server.stop()
    size = 8 * MiB
    print(f"  loading {chunks} chunks into the index ...", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"chunks": chunks, "load_s": load_chunks(data, chunks, size)}
    _set_capacity(data, capacity_for(chunks, size, evictions) if evictions else chunks * size * 4)
    out["index_bytes"] = sum(p.stat().st_size for p in (data / "index").iterdir() if p.is_file())
    server = _server(data, env)
    t0 = time.monotonic()
    server.start(timeout=300)
    out["start_s"] = time.monotonic() - t0
    try:
        out["idle"] = _memory(server)
        out["lookups"] = _lookups(server, chunks, lookups)
        deadline = time.monotonic() + 120
        while evictions and _stats(server)["lifecycle"]["evicted"] < evictions * 0.99 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(settle)
        stats = _stats(server)
        out["after"] = _memory(server)
        out["evicted"] = stats["lifecycle"]["evicted"]
        out["evict_s"] = time.monotonic() - t0
        out["leader"] = stats["lifecycle_leader"]["leader"]
        out["chunks_indexed"] = stats["chunks_indexed"]
    finally:
        server.stop()
    return out


def memory_row(work: Path, chunks: int, baseline: int, lookups: int, evictions: int, settle: float) -> dict[str, Any]:
    """The gateway at ``baseline`` and at ``chunks`` indexed chunks, with the same lookups and evictions:
    per-chunk memory is the difference over the difference in chunks."""
    small = _held(work, baseline, lookups, evictions, settle)
    large = _held(work, chunks, lookups, evictions, settle)
    out: dict[str, Any] = {"small": small, "large": large}
    span = chunks - baseline
    for kind in ("RssAnon", "RssFile", "VmRSS"):
        out[f"{kind}_per_chunk"] = (large["after"].get(kind, 0) - small["after"].get(kind, 0)) / span
        out[f"{kind}_idle_per_chunk"] = (large["idle"].get(kind, 0) - small["idle"].get(kind, 0)) / span
    return out


# -- coordination cost, feed lag, workers ------------------------------------------------------------


def _put_latency(server: KvgwProcess, prefix: str, count: int, body: bytes) -> list[float]:
    conn = HttpConnection(server.address)
    lat = []
    try:
        for i in range(count):
            t0 = time.perf_counter()
            status, _ = conn.request(LoadRequest("PUT", _target(f"{prefix}{i}"), body=body, expect=(201,)))
            lat.append(time.perf_counter() - t0)
            if status != 201:
                raise RuntimeError(f"PUT: {status}")
    finally:
        conn.close()
    return lat


def _prefix_latency(server: KvgwProcess, keys: list[str], count: int) -> list[float]:
    req = LoadRequest("POST", f"/v1/buckets/{BUCKET}/prefix", body=json.dumps({"keys": keys}).encode(),
                      headers=[("Content-Type", "application/json")])
    conn = HttpConnection(server.address)
    lat = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            status, _ = conn.request(req)
            lat.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"prefix: {status}")
    finally:
        conn.close()
    return lat


def _summary(lat: list[float]) -> dict[str, float]:
    return {"n": len(lat), "p50_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99),
            "mean_ms": 1000 * statistics.fmean(lat) if lat else 0.0}


def coordination_row(work: Path, pg: str, rounds: int, puts: int, prefixes: int,
                     on_env: dict[str, str] | None = None) -> dict[str, Any]:
    shared = {"KVGW_CATALOG_URL": pg, "KVGW_CATALOG_KEY": _fernet(), "KVGW_FS_ROOT": str(work / "coord-fs")}
    servers = {"on": _server(work / "coord-on", {**shared, **(on_env or {})}),
               "off": _server(work / "coord-off", {**shared, "KVGW_CLUSTER_ENABLED": "false"})}
    body = os.urandom(8 * MiB)
    chain = [f"prefix-chain/{i}" for i in range(64)]
    put_lat: dict[str, list[float]] = {"on": [], "off": []}
    prefix_lat: dict[str, list[float]] = {"on": [], "off": []}
    put_cpu: dict[str, float] = {"on": 0.0, "off": 0.0}
    ratios: list[float] = []  # per round: mean PUT latency on / off
    for server in servers.values():
        server.start()
    try:
        for name, server in servers.items():
            for i, key in enumerate(chain):
                status, _ = request_once(server.address, LoadRequest("PUT", _target(f"{name}-{key}"),
                                                                     body=b"k" * (1000 + i), expect=(201,)))
                if status != 201:
                    raise RuntimeError(f"PUT {key}: {status}")
            _put_latency(server, f"warm-{name}-", 3, body)
        for r in range(rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            means: dict[str, float] = {}
            for name in order:
                pids = _pids(servers[name])
                cpu0 = procstat.total_cpu_seconds(pids)
                lat = _put_latency(servers[name], f"r{r}-{name}-", puts, body)
                put_cpu[name] += procstat.total_cpu_seconds(pids) - cpu0
                put_lat[name] += lat
                means[name] = statistics.fmean(lat)
                prefix_lat[name] += _prefix_latency(servers[name], [f"{name}-{k}" for k in chain], prefixes)
            ratios.append(means["on"] / means["off"])
        on_stats = _stats(servers["on"])
    finally:
        for server in servers.values():
            server.stop()
    return {"put_8mib": {k: _summary(v) for k, v in put_lat.items()},
            "prefix_64": {k: _summary(v) for k, v in prefix_lat.items()},
            "put_server_cpu_ms": {k: 1000 * v / max(1, len(put_lat[k])) for k, v in put_cpu.items()},
            "put_round_ratios": ratios, "cluster_on_member": on_stats["cluster"].get("member"), "rounds": rounds,
            "on_env": on_env or {}}


def feed_lag_row(work: Path, pg: str, writers: int, seconds: float, size: int) -> dict[str, Any]:
    shared = {"KVGW_CATALOG_URL": pg, "KVGW_CATALOG_KEY": _fernet(), "KVGW_FS_ROOT": str(work / "lag-fs"),
              "KVGW_FSYNC": "false"}
    a, b = _server(work / "lag-a", shared), _server(work / "lag-b", shared)
    a.start()
    b.start()
    try:
        body = os.urandom(size)
        reqs = [[LoadRequest("PUT", _target(f"lag-{c}-{n}"), body=body, expect=(201,)) for n in range(100_000)]
                for c in range(writers)]
        before = _stats(b)["cluster"]["feed"]
        stats = run_load(a.address, lambda c, seq: reqs[c][seq], writers, duration=seconds)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # let b apply the last events
            time.sleep(0.5)
            feed = _stats(b)["cluster"]["feed"]
            if feed["applied"] - before.get("applied", 0) >= stats.ops and feed["behind_events"] == 0:
                break
    finally:
        a.stop()
        b.stop()
    return {"writers": writers, "puts": stats.ops, "puts_per_s": stats.ops_per_s, "chunk_bytes": size,
            "lag_p50_ms": feed["lag_p50_ms"], "lag_p99_ms": feed["lag_p99_ms"], "lag_samples": feed["lag_samples"],
            "applied": feed["applied"] - before.get("applied", 0), "errors": stats.errors}


def workers_row(work: Path, pg: str, workers: int, clients: int, seconds: float) -> dict[str, Any]:
    env = {"KVGW_CATALOG_URL": pg, "KVGW_CATALOG_KEY": _fernet(), "KVGW_FS_ROOT": str(work / f"w{workers}-fs"),
           "KVGW_FSYNC": "false"}
    server = _server(work / f"w{workers}", env, workers=workers)
    server.start()
    try:
        time.sleep(1.0)
        body = os.urandom(8 * MiB)
        keys = [[f"w-{c}-{n}" for n in range(100_000)] for c in range(clients)]
        out: dict[str, Any] = {"workers": workers, "clients": clients, "processes": len(_pids(server))}
        written = [0]

        def put(c: int, seq: int) -> LoadRequest:
            return LoadRequest("PUT", _target(keys[c][seq]), body=body, expect=(201,))

        def get(c: int, seq: int) -> LoadRequest:
            return LoadRequest("GET", _target(keys[c][seq % max(1, written[0] // clients // 2)]))

        for phase in ("put", "get"):
            pids = _pids(server)
            cpu0 = procstat.total_cpu_seconds(pids)
            if phase == "put":
                stats: Stats = run_load(server.address, put, clients, duration=seconds)
                written[0] = stats.ops
            else:
                stats = run_load(server.address, get, clients, duration=seconds, body_buffer_bytes=1 << 20)
            cpu = procstat.total_cpu_seconds(pids) - cpu0
            gib = stats.bytes / (1 << 30)
            out[phase] = {"gib_per_s": stats.bytes_per_s / (1 << 30), "ops": stats.ops, "errors": stats.errors,
                          "p50_ms": 1000 * stats.percentile(0.5), "server_cpu_s_per_gib": cpu / gib if gib else None,
                          "client_cpu_s": stats.client_cpu}
        return out
    finally:
        server.stop()


_CATALOG_KEY: list[str] = []  # the one catalog key of this process's benches (not in os.environ: a KVGW_ name
# there would reach every kvgw this process starts later, which warns about settings it does not know)


def _fernet() -> str:
    from cryptography.fernet import Fernet

    if not _CATALOG_KEY:
        _CATALOG_KEY.append(Fernet.generate_key().decode())
    return _CATALOG_KEY[0]


# -- report ----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = ["kvgw bench cluster", ""]
    mem = results.get("memory")
    if mem:
        small, large = mem["small"], mem["large"]
        lines.append(f"memory: the same gateway holding {small['chunks']} and {large['chunks']} indexed chunks (index "
                     f"{small['index_bytes'] / MiB:.0f} / {large['index_bytes'] / MiB:.0f} MiB on disk, loaded in "
                     f"{small['load_s']:.1f} / {large['load_s']:.1f} s, ready in {small['start_s']:.1f} / "
                     f"{large['start_s']:.1f} s), each after {large['lookups']['lookups']} prefix + exists lookups "
                     f"(prefix p50 {small['lookups']['prefix_p50_ms']:.2f} / "
                     f"{large['lookups']['prefix_p50_ms']:.2f} ms) "
                     f"and {small['evicted']} / {large['evicted']} evictions by its lifecycle leader "
                     f"({small['leader']} / {large['leader']})")
        for phase, label in (("idle", "at start"), ("after", "after the work")):
            for kind in ("VmRSS", "RssAnon", "RssFile"):
                a, b = small[phase].get(kind, 0), large[phase].get(kind, 0)
                per = mem[f"{kind}_idle_per_chunk" if phase == "idle" else f"{kind}_per_chunk"]
                lines.append(f"  {label:<15} {kind:<8} {a / MiB:8.1f} MiB -> {b / MiB:8.1f} MiB   "
                             f"per chunk {per:7.1f} B")
        verdict = "within" if mem["RssAnon_per_chunk"] <= BUDGET_BYTES_PER_CHUNK else "OVER"
        lines.append(f"  process memory per chunk (RssAnon, after the work) {mem['RssAnon_per_chunk']:.1f} B: "
                     f"{verdict} the {BUDGET_BYTES_PER_CHUNK} B budget (RssFile: the index's pages in the page cache)")
        lines.append("")
    coord = results.get("coordination")
    if coord:
        settings = " ".join(f"{k}={v}" for k, v in coord["on_env"].items()) or "defaults"
        lines.append(f"coordination ({coord['rounds']} alternating rounds, one gateway, 1 worker, PostgreSQL catalog; "
                     f"cluster on: {settings}):")
        for what in ("put_8mib", "prefix_64"):
            on, off = coord[what]["on"], coord[what]["off"]
            extra = (on["mean_ms"] - off["mean_ms"]) / off["mean_ms"] if off["mean_ms"] else 0.0
            lines.append(f"  {what:<9} cluster on  p50 {on['p50_ms']:8.2f}  p99 {on['p99_ms']:8.2f}  mean "
                         f"{on['mean_ms']:8.2f} ms   off p50 {off['p50_ms']:8.2f}  p99 {off['p99_ms']:8.2f}  mean "
                         f"{off['mean_ms']:8.2f} ms   on vs off {extra:+.1%} (n={on['n']})")
        cpu = coord["put_server_cpu_ms"]
        ratios = sorted(coord["put_round_ratios"])
        lines.append(f"  8 MiB PUT: server CPU {cpu['on']:.2f} ms (on) vs {cpu['off']:.2f} ms (off) per PUT; "
                     f"per-round mean on/off: median {statistics.median(ratios):.3f}, range "
                     f"{ratios[0]:.3f}-{ratios[-1]:.3f}")
        lines.append("")
    lag = results.get("feed_lag")
    if lag:
        lines.append(f"feed lag: {lag['writers']} writers into gateway A ({lag['puts']} PUTs of "
                     f"{lag['chunk_bytes'] >> 10} KiB, {lag['puts_per_s']:.0f}/s), applied by gateway B: "
                     f"p50 {lag['lag_p50_ms']} ms, p99 {lag['lag_p99_ms']} ms ({lag['lag_samples']} samples)")
        lines.append("")
    for row in results.get("workers", []):
        put, get = row["put"], row["get"]
        lines.append(f"--workers {row['workers']} ({row['processes']} processes, {row['clients']} clients, 8 MiB): "
                     f"PUT {put['gib_per_s']:.2f} GiB/s, {put['server_cpu_s_per_gib'] or 0:.2f} CPU-s/GiB; "
                     f"GET {get['gib_per_s']:.2f} GiB/s, {get['server_cpu_s_per_gib'] or 0:.2f} CPU-s/GiB")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="memory,coordination,lag,workers",
                        help="which rows to run (comma-separated: memory, coordination, lag, workers)")
    parser.add_argument("--chunks", type=int, default=1_000_000, help="chunks indexed for the memory row")
    parser.add_argument("--baseline-chunks", type=int, default=100_000, help="the memory row's smaller gateway")
    parser.add_argument("--lookups", type=int, default=3000, help="prefix + exists lookups in the memory row")
    parser.add_argument("--evictions", type=int, default=2500,
                        help="evictions in the memory row (more than 0.2%% of --chunks)")
    parser.add_argument("--settle-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=10, help="alternating on/off rounds (coordination)")
    parser.add_argument("--puts", type=int, default=20, help="8 MiB PUTs per round and configuration")
    parser.add_argument("--prefixes", type=int, default=500, help="64-key prefix calls per round and configuration")
    parser.add_argument("--writers", type=int, default=8, help="concurrent writers (feed lag)")
    parser.add_argument("--lag-seconds", type=float, default=15.0)
    parser.add_argument("--lag-chunk-kib", type=int, default=256)
    parser.add_argument("--workers", default="1,2", help="--workers values for the throughput row")
    parser.add_argument("--clients", type=int, default=8, help="clients for the throughput row")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per throughput phase")
    parser.add_argument("--cluster-setting", action="append", default=[], metavar="KVGW_X=VALUE",
                        help="a setting of the cluster-on gateway in the coordination row (repeatable)")
    parser.add_argument("--pg-url", default=os.environ.get("KVGW_TEST_PG_URL", DEFAULT_PG))
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    rows = {r.strip() for r in args.rows.split(",") if r.strip()}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-cluster-") as tmp:
        work = Path(tmp)
        if "memory" in rows:
            print("memory row ...", file=sys.stderr, flush=True)
            results["memory"] = memory_row(work, args.chunks, args.baseline_chunks, args.lookups, args.evictions,
                                           args.settle_seconds)
        needs_pg = rows & {"coordination", "lag", "workers"}
        if needs_pg:
            with _pg_schema(args.pg_url) as pg:
                if "coordination" in rows:
                    print("coordination row ...", file=sys.stderr, flush=True)
                    on_env = dict(item.split("=", 1) for item in args.cluster_setting)
                    results["coordination"] = coordination_row(work, pg, args.rounds, args.puts, args.prefixes, on_env)
                if "lag" in rows:
                    print("feed lag row ...", file=sys.stderr, flush=True)
                    results["feed_lag"] = feed_lag_row(work, pg, args.writers, args.lag_seconds,
                                                       args.lag_chunk_kib << 10)
                if "workers" in rows:
                    results["workers"] = []
                    for n in (int(w) for w in args.workers.split(",")):
                        print(f"workers row ({n}) ...", file=sys.stderr, flush=True)
                        results["workers"].append(workers_row(work, pg, n, args.clients, args.seconds))
    sys.stdout.write(report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

