"""``kvgw bench leases``: what a read lease adds to a lookup (issue 31, item 5: at most 1.3x the same lookup).

One gateway (one worker, PostgreSQL catalog in a schema of its own, cluster on, no fsync) holds
sets of 64 chunks of 1 KiB. On one keep-alive connection, in ``--rounds`` alternating rounds of
``--calls`` calls each, the same 64-key lookup (``prefix`` and/or ``exists``) is sent with
``"lease_ms": 5000`` (what the engine integrations ask for) and without:

- **fresh**: every call looks up a set of 64 chunks no call looked up before, so a leased call leases 64
  chunks no lease holds yet (a client of a fresh gateway, an engine's new prompts); the unleased calls
  take fresh sets of their own;
- **again**: every call looks up the same 64 chunks (a lease that is extended).

Each configuration runs twice: with the lookup lane (the default: unleased lookups are answered inside
the HTTP protocol; leased ones are handed to the ASGI path until the lane grants leases itself) and
without it (``KVGW_LOOKUP_LANE=false``: both on the ASGI path, so the ratio is the lease's own cost).
Reported per configuration: p50 of each side over all calls, the median over rounds of the per-round
p50 ratio leased / plain, and server CPU per call (from ``/proc/<pid>/task/*/schedstat``, nanoseconds).
Compare within one run only (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.bench import procstat
from gateway.bench.cluster import DEFAULT_PG, LEASE_MS, _fernet, _pg_schema, _server
from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import HttpConnection, LoadRequest, run_load

BUCKET = "kvcache"
KEYS = 64
TARGET = 1.3  # issue 31, item 5


def _lookup(op: str, keys: list[str], lease_ms: int) -> LoadRequest:
    doc: dict[str, Any] = {"keys": keys, "lease_ms": lease_ms} if lease_ms else {"keys": keys}
    return LoadRequest("POST", f"/v1/buckets/{BUCKET}/{op}", body=json.dumps(doc).encode(),
                       headers=[("Content-Type", "application/json")])


def _set(i: int) -> list[str]:
    return [f"set-{i}/chunk-{j}" for j in range(KEYS)]


def _fill(server: KvgwProcess, sets: int) -> None:
    body = b"k" * 1024
    keys = [key for i in range(sets) for key in _set(i)]
    stats = run_load(server.address, lambda _c, seq: LoadRequest("PUT", f"/v1/buckets/{BUCKET}/chunks/{keys[seq]}",
                                                                 body=body, expect=(201,)),
                     4, count=len(keys))
    if stats.errors:
        raise RuntimeError(f"filling: {stats.errors} PUTs failed: {stats.error_samples[:3]}")


def _calls(conn: HttpConnection, reqs: list[LoadRequest], pids: list[int]) -> tuple[list[float], float]:
    """Latencies of ``reqs`` sent one after another, and the server CPU seconds they took."""
    lat = []
    cpu0 = procstat.task_cpu_seconds(pids)
    for req in reqs:
        t0 = time.perf_counter()
        status, _ = conn.request(req)
        lat.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"{req.method} {req.target}: {status}")
    return lat, procstat.task_cpu_seconds(pids) - cpu0


def configuration(server: KvgwProcess, op: str, fresh: bool, rounds: int, calls: int,
                  next_set: list[int]) -> dict[str, Any]:
    """Alternating rounds of leased and plain calls (see the module docstring)."""
    pids = server.pids()
    conn = HttpConnection(server.address)
    same = _set(0)
    out: dict[str, Any] = {"leased": [], "plain": [], "cpu": {"leased": 0.0, "plain": 0.0}, "ratios": []}
    try:
        for lease_ms in (LEASE_MS, 0):  # warm the connection and both paths once
            conn.request(_lookup(op, same, lease_ms))
        for r in range(rounds):
            medians: dict[str, float] = {}
            for side in (("leased", "plain") if r % 2 == 0 else ("plain", "leased")):
                lease_ms = LEASE_MS if side == "leased" else 0
                reqs = []
                for _ in range(calls):
                    keys = same
                    if fresh:
                        keys = _set(next_set[0])
                        next_set[0] += 1
                    reqs.append(_lookup(op, keys, lease_ms))
                lat, cpu = _calls(conn, reqs, pids)
                out[side] += lat
                out["cpu"][side] += cpu
                medians[side] = statistics.median(lat)
            out["ratios"].append(medians["leased"] / medians["plain"])
    finally:
        conn.close()
    n = rounds * calls
    return {"p50_ms": {side: 1000 * statistics.median(out[side]) for side in ("leased", "plain")},
            "p99_ms": {side: 1000 * sorted(out[side])[int(0.99 * (n - 1))] for side in ("leased", "plain")},
            "cpu_us_per_call": {side: 1e6 * out["cpu"][side] / n for side in ("leased", "plain")},
            "ratio_median": statistics.median(out["ratios"]), "ratio_range": [min(out["ratios"]), max(out["ratios"])],
            "calls": n}


def run(work: Path, pg_url: str, ops: list[str], rounds: int, calls: int, lanes: list[bool]) -> dict[str, Any]:
    sets = 1 + 2 * rounds * calls * len(ops)  # set 0 for "again", then fresh sets for every fresh call
    results: dict[str, Any] = {"rounds": rounds, "calls": calls, "lease_ms": LEASE_MS, "lanes": {}}
    for lane in lanes:
        name = "lane" if lane else "asgi"
        with _pg_schema(pg_url) as pg:
            env = {"KVGW_CATALOG_URL": pg, "KVGW_CATALOG_KEY": _fernet(), "KVGW_FS_ROOT": str(work / f"{name}-fs"),
                   "KVGW_FSYNC": "false", "KVGW_LOOKUP_LANE": "true" if lane else "false"}
            server = _server(work / name, env)
            server.start()
            try:
                print(f"{name}: writing {sets * KEYS} chunks ...", file=sys.stderr, flush=True)
                _fill(server, sets)
                next_set = [1]
                rows: dict[str, Any] = {}
                for op in ops:
                    for fresh in (True, False):
                        label = f"{op} {'fresh' if fresh else 'again'}"
                        print(f"{name}: {label} ...", file=sys.stderr, flush=True)
                        rows[label] = configuration(server, op, fresh, rounds, calls, next_set)
                results["lanes"][name] = rows
            finally:
                server.stop()
    return results


def report(results: dict[str, Any]) -> str:
    lines = [f"kvgw bench leases: 64-key lookups with a {results['lease_ms']} ms lease and without, one keep-alive "
             f"connection, {results['rounds']} alternating rounds of {results['calls']} calls each "
             "(PostgreSQL catalog)"]
    for lane, rows in results["lanes"].items():
        lines.append("")
        lines.append("with the lookup lane (the default)" if lane == "lane" else
                     "without the lookup lane (KVGW_LOOKUP_LANE=false: both on the ASGI path)")
        lines.append(f"  {'lookup':<16} {'p50 leased':>11} {'p50 plain':>10} {'p99 leased':>11} {'p99 plain':>10} "
                     f"{'CPU/call leased':>16} {'plain':>8}  ratio (median of rounds, range)  target {TARGET}x")
        for label, row in rows.items():
            p50, p99, cpu = row["p50_ms"], row["p99_ms"], row["cpu_us_per_call"]
            lo, hi = row["ratio_range"]
            verdict = "met" if row["ratio_median"] <= TARGET else "NOT met"
            lines.append(f"  {label:<16} {p50['leased']:8.3f} ms {p50['plain']:7.3f} ms {p99['leased']:8.3f} ms "
                         f"{p99['plain']:7.3f} ms {cpu['leased']:13.0f} µs {cpu['plain']:5.0f} µs  "
                         f"{row['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f})  {verdict}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgw bench leases", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="prefix", help="lookups to measure (comma-separated: prefix, exists)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds per configuration")
    parser.add_argument("--calls", type=int, default=20, help="calls per round and side")
    parser.add_argument("--lanes", default="on,off", help="with the lookup lane (on), without (off), or both")
    parser.add_argument("--pg-url", default=os.environ.get("KVGW_TEST_PG_URL", DEFAULT_PG))
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if not ops or any(op not in ("prefix", "exists") for op in ops):
        parser.error("--ops takes prefix and/or exists")
    lanes = [{"on": True, "off": False}[lane.strip()] for lane in args.lanes.split(",") if lane.strip()]
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-leases-") as tmp:
        results = run(Path(tmp), args.pg_url, ops, args.rounds, args.calls, lanes)
    results["at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(report(results), end="")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
