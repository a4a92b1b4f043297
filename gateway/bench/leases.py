"""``kvgw bench leases``: what a read lease adds to a lookup (issue 31, item 5: at most 1.3x the same lookup).

One gateway (one worker, PostgreSQL catalog in a schema of its own, cluster on, no fsync) holds
sets of 64 chunks of 1 KiB. On one keep-alive connection, in ``--rounds`` rounds of ``--calls`` pairs
(which call of a pair goes first alternates), the same 64-key lookup (``prefix`` and/or ``exists``) is sent with
``"lease_ms": 5000`` (what the engine integrations ask for) and without:

- **fresh**: every call looks up a set of 64 chunks no call looked up before, so a leased call leases 64
  chunks no lease holds yet (a client of a fresh gateway, an engine's new prompts); the unleased calls
  take fresh sets of their own;
- **again**: every call looks up the same 64 chunks (a lease that is extended).

Each configuration runs twice: with the lookup lane (the default: leased and plain lookups alike are
answered inside the HTTP protocol, the lease granted in memory; a leased lookup that must wait for a
lease sync goes to the ASGI path) and without it (``KVGW_LOOKUP_LANE=false``: both on the ASGI path).
Reported per configuration: p50 of each side over all calls, the median over rounds of the per-round
p50 ratio leased / plain, and server CPU per call (from ``/proc/<pid>/task/*/schedstat``, nanoseconds,
read around each call: the median is the call's own; the mean adds what background threads did
meanwhile, such as lease syncs and the feed publishing the chains fresh prefix calls reveal).

Then, in this process, the calls the lookup lane makes for the same lookups (``exists_now`` /
``prefix_now`` against ``exists_leased_now`` / ``prefix_leased_now``) on a gateway of its own, timed
call by call in alternating pairs: what a lease adds to the lane's index work, without HTTP.
Compare within one run only (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.bench import procstat
from gateway.bench.cluster import DEFAULT_PG, _fernet, _pg_schema, _server
from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import HttpConnection, LoadRequest, run_load

BUCKET = "kvcache"
KEYS = 64
LEASE_MS = 5_000  # what the engine integrations ask for by default
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


def _call(conn: HttpConnection, req: LoadRequest) -> float:
    t0 = time.perf_counter()
    status, _ = conn.request(req)
    took = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{req.method} {req.target}: {status}")
    return took


def configuration(server: KvgwProcess, op: str, fresh: bool, rounds: int, calls: int,
                  next_set: list[int]) -> dict[str, Any]:
    """``rounds`` rounds of ``calls`` pairs, a leased call and a plain one in each pair, which goes first
    alternating (see the module docstring). Server CPU is read around each call."""
    pids = server.pids()
    conn = HttpConnection(server.address)
    same = _set(0)
    out: dict[str, Any] = {"leased": [], "plain": [], "ratios": []}
    try:
        for lease_ms in (LEASE_MS, 0):  # warm the connection and both paths once
            conn.request(_lookup(op, same, lease_ms))
        cpu: dict[str, list[float]] = {"leased": [], "plain": []}
        for _ in range(rounds):
            lat: dict[str, list[float]] = {"leased": [], "plain": []}
            for i in range(calls):
                for side in (("leased", "plain") if i % 2 == 0 else ("plain", "leased")):
                    keys = same
                    if fresh:
                        keys = _set(next_set[0])
                        next_set[0] += 1
                    req = _lookup(op, keys, LEASE_MS if side == "leased" else 0)
                    before = procstat.task_cpu_seconds(pids)
                    lat[side].append(_call(conn, req))
                    cpu[side].append(procstat.task_cpu_seconds(pids) - before)
            out["leased"] += lat["leased"]
            out["plain"] += lat["plain"]
            out["ratios"].append(statistics.median(lat["leased"]) / statistics.median(lat["plain"]))
    finally:
        conn.close()
    n = rounds * calls
    return {"p50_ms": {side: 1000 * statistics.median(out[side]) for side in ("leased", "plain")},
            "p99_ms": {side: 1000 * sorted(out[side])[int(0.99 * (n - 1))] for side in ("leased", "plain")},
            "cpu_us_median": {side: 1e6 * statistics.median(cpu[side]) for side in ("leased", "plain")},
            "cpu_us_mean": {side: 1e6 * statistics.fmean(cpu[side]) for side in ("leased", "plain")},
            "ratio_median": statistics.median(out["ratios"]), "ratio_range": [min(out["ratios"]), max(out["ratios"])],
            "calls": n}


def in_process(work: Path, pg_url: str, ops: list[str], rounds: int, calls: int) -> dict[str, Any]:
    """The calls the lookup lane makes, timed in this process on a gateway of its own (PostgreSQL
    catalog, its lease syncer running between calls): ``exists_now`` / ``prefix_now`` against
    ``exists_leased_now`` / ``prefix_leased_now``, in alternating pairs, fresh sets and the same set."""
    return asyncio.run(_in_process(work, pg_url, ops, rounds, calls))


async def _in_process(work: Path, pg_url: str, ops: list[str], rounds: int, calls: int) -> dict[str, Any]:
    from gateway.config import load_settings
    from gateway.runtime import Gateway

    sets = 1 + rounds * calls * len(ops)
    with _pg_schema(pg_url) as pg:
        settings = load_settings(data_dir=work / "in-process", catalog_url=pg, catalog_key=_fernet(), fsync=False)
        gateway = Gateway(settings)
        await gateway.start()
        try:
            service = gateway.service
            bucket = await service.bucket(BUCKET)
            body = b"k" * 1024

            async def one(data: bytes) -> Any:
                yield data

            for i in range(sets):
                for key in _set(i):
                    await service.put(bucket, key, one(body), length=len(body))
            await asyncio.sleep(1.0)  # the feed publishes the writes
            out: dict[str, Any] = {}
            next_set = 1
            waited = 0
            await service.lease(bucket, _set(0), LEASE_MS)  # the process's first lease: a sync for its share
            for op in ops:
                plain = service.exists_now if op == "exists" else service.prefix_now
                leased = service.exists_leased_now if op == "exists" else service.prefix_leased_now
                for fresh in (True, False):
                    lat: dict[str, list[float]] = {"leased": [], "plain": []}
                    ratios = []
                    for _ in range(rounds):
                        round_lat: dict[str, list[float]] = {"leased": [], "plain": []}
                        for i in range(calls):
                            keys = _set(0)
                            if fresh:
                                keys = _set(next_set)
                                next_set += 1
                            for side in (("leased", "plain") if i % 2 == 0 else ("plain", "leased")):
                                t0 = time.perf_counter()
                                answer = leased(bucket, keys, LEASE_MS) if side == "leased" else plain(bucket, keys)
                                if answer is None and side == "leased":  # the lane would hand it over: wait
                                    waited += 1
                                    await service.lease(bucket, keys, LEASE_MS)
                                elif answer is None:
                                    raise RuntimeError(f"{op} without waiting gave no answer")
                                round_lat[side].append(time.perf_counter() - t0)
                                await asyncio.sleep(0)  # let the syncer and the rest of the loop run
                        ratios.append(statistics.median(round_lat["leased"]) / statistics.median(round_lat["plain"]))
                        for side in lat:
                            lat[side] += round_lat[side]
                    out[f"{op} {'fresh' if fresh else 'again'}"] = {
                        "us": {side: 1e6 * statistics.median(lat[side]) for side in lat},
                        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                        "waited": waited}
                    waited = 0
            return out
        finally:
            await gateway.stop()
            gateway.close()


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
             f"connection, {results['rounds']} rounds of {results['calls']} alternating pairs "
             "(PostgreSQL catalog)"]
    for lane, rows in results["lanes"].items():
        lines.append("")
        lines.append("with the lookup lane (the default)" if lane == "lane"
                     else "without the lookup lane (KVGW_LOOKUP_LANE=false: both on the ASGI path)")
        lines.append(f"  {'lookup':<14} {'p50 leased':>10} {'plain':>9} {'p99 leased':>11} {'plain':>9} "
                     f"{'server CPU/call, median':>24} {'mean':>15}  ratio (median of rounds, range)  target {TARGET}x")
        for label, row in rows.items():
            p50, p99, med, mean = row["p50_ms"], row["p99_ms"], row["cpu_us_median"], row["cpu_us_mean"]
            lo, hi = row["ratio_range"]
            verdict = "met" if row["ratio_median"] <= TARGET else "NOT met"
            lines.append(f"  {label:<14} {p50['leased']:7.3f} ms {p50['plain']:6.3f} ms {p99['leased']:8.3f} ms "
                         f"{p99['plain']:6.3f} ms {med['leased']:8.0f} / {med['plain']:4.0f} µs "
                         f"{mean['leased']:6.0f} / {mean['plain']:4.0f} µs  "
                         f"{row['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f})  {verdict}")
    inproc = results.get("in_process")
    if inproc:
        lines.append("")
        lines.append("in process: what the lookup lane runs for the index and the lease (exists_now / prefix_now "
                     "against exists_leased_now / prefix_leased_now), median µs per call")
        for label, row in inproc.items():
            lo, hi = row["ratio_range"]
            extra = row["us"]["leased"] - row["us"]["plain"]
            lines.append(f"  {label:<14} leased {row['us']['leased']:6.1f} µs  plain {row['us']['plain']:6.1f} µs  "
                         f"(+{extra:.1f} µs)  ratio {row['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f}); "
                         f"{row['waited']} leased calls waited for a sync")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgw bench leases", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="prefix", help="lookups to measure (comma-separated: prefix, exists)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds per configuration")
    parser.add_argument("--calls", type=int, default=20, help="pairs (a leased and a plain call) per round")
    parser.add_argument("--lanes", default="on,off", help="with the lookup lane (on), without (off), or both")
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process timing of the lane's calls")
    parser.add_argument("--pg-url", default=os.environ.get("KVGW_TEST_PG_URL", DEFAULT_PG))
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if not ops or any(op not in ("prefix", "exists") for op in ops):
        parser.error("--ops takes prefix and/or exists")
    lanes = [{"on": True, "off": False}[lane.strip()] for lane in args.lanes.split(",") if lane.strip()]
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-leases-") as tmp:
        results = run(Path(tmp), args.pg_url, ops, args.rounds, args.calls, lanes)
        if not args.no_in_process:
            print("in process ...", file=sys.stderr, flush=True)
            results["in_process"] = in_process(Path(tmp), args.pg_url, ops, args.rounds, args.calls)
    results["at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(report(results), end="")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
