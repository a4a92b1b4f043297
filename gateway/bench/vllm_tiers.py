"""``kvgw bench vllm``: the same KV blocks through vLLM 0.33's tiering manager with three secondary tiers,
one at a time, in one run, on this machine:

    (k) kvgw's tier                  ``kvgw_client.vllm.KvgwTier``, kvgw's native API
    (d) kvgw's tier, direct reads    the same, loads read from kvgw's directory (``direct_read_root``)
    (f) vLLM's fs tier               ``FileSystemTierManager``, a directory on the same disk as kvgw's data
                                     (its pure-Python I/O: vLLM's C extension ``fs_io_C`` needs CUDA
                                     libraries, so these figures say nothing of the fs tier on a GPU host)
    (o) vLLM's obj tier -> kvgw      ``ObjectStoreSecondaryTierManager`` (NIXL 1.5.1's OBJ backend,
                                     aws-sdk-cpp), kvgw's S3 API

Each tier is built by vLLM's own factory inside vLLM's ``TieringOffloadingManager`` on CPU and driven as
the scheduler drives it (``gateway.bench.vllm_engine.Engine``; a step is ``--step-ms`` long, the model's
time). Per round, engine A stores ``--blocks`` blocks of ``--block-mib`` MiB (written into its primary
tier as the GPU worker would, then cascaded into the secondary tier: timed until the tier reports the
job done), then a fresh engine B (an empty primary tier, as another instance) looks the blocks up and
loads them (timed from the first lookup until vLLM answers HIT for every block: lookups, promotion
job, all of it; the bench's own copy of the loaded bytes, for the check, is not timed). The first load
of every tier is checked byte for byte. Lookup: how many scheduler steps until the tier answered for
all blocks (1: by the next step). Every engine idles ``--warmup``
seconds after it is created, before it is timed: creating vLLM's shared-memory primary tier keeps this
2-core machine busy for some 40 ms after (a step's lookup batch then took 43 ms instead of 4).

Targets (issue 32): the kvgw tier's load >= 1.0x the fs tier's and >= 2x the obj tier's; lookups of 64
blocks answered within one scheduler step. Exit status 1 when a target could not run or a check failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.launcher import KvgwProcess, work_directory

MiB = 1 << 20
ACCESS_KEY = "KVBENCHVLLMACCESSKEY"
SECRET_KEY = "kvgw-bench-vllm-secret-key-0123456789"
BUCKET = "kvcache"
TARGETS = {"k": "kvgw tier (native API)", "d": "kvgw tier, direct reads", "f": "vLLM fs tier (same disk)",
           "o": "vLLM obj tier -> kvgw S3 API"}


@dataclass
class Result:
    target: str
    store_mbps: list[float] = field(default_factory=list)
    load_mbps: list[float] = field(default_factory=list)
    lookup_steps: list[int] = field(default_factory=list)
    lookup_ms: list[float] = field(default_factory=list)
    error: str | None = None


def tier_config(target: str, server: KvgwProcess, workdir: Path) -> dict[str, Any]:
    if target in "kd":
        doc = {"type": "KvgwTier", "module_path": "kvgw_client.vllm", "url": server.url, "bucket": BUCKET,
               "access_key": ACCESS_KEY, "secret_key": SECRET_KEY, "prefix": f"bench-{target}"}
        if target == "d":
            doc["direct_read_root"] = str((server.data_dir / "fs").resolve())
        return doc
    if target == "f":
        return {"type": "fs", "root_dir": str(workdir / "fs-tier")}
    return {"type": "obj", "prefix": "bench-o", "io_threads": 4,
            "store_config": {"bucket": BUCKET, "endpoint_override": f"127.0.0.1:{server.port}", "scheme": "http",
                             "region": "us-east-1", "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}}


def run_target(target: str, tier: dict[str, Any], args: argparse.Namespace, seed: int) -> Result:
    from gateway.bench.vllm_engine import Engine, block_keys

    result = Result(target)
    block = args.block_mib * MiB
    step = args.step_ms / 1000
    for round_ in range(args.rounds):
        keys = block_keys(args.blocks, seed + round_)
        blocks = [os.urandom(block) for _ in keys]
        a = Engine([tier], block_bytes=block, cpu_blocks=args.blocks + 4, step_seconds=step)
        time.sleep(args.warmup)
        try:
            started = time.perf_counter()
            a.store(keys, blocks)
            result.store_mbps.append(len(keys) * block / (time.perf_counter() - started) / 1e6)
        finally:
            a.close()
        b = Engine([tier], block_bytes=block, cpu_blocks=args.blocks + 4, step_seconds=step)
        time.sleep(args.warmup)
        try:
            got = b.load(keys)
            elapsed = got.seconds  # until vLLM answered HIT for every block; reading them back is not timed
            if round_ == 0 and got.data != blocks:
                bad = sum(1 for x, y in zip(got.data, blocks, strict=True) if x != y)
                raise AssertionError(f"{bad} of {len(keys)} blocks did not load byte for byte")
            result.load_mbps.append(len(keys) * block / elapsed / 1e6)
            answered = next(i for i, row in enumerate(got.answers) if "RETRY" not in row)
            result.lookup_steps.append(answered)
            result.lookup_ms.append(answered * args.step_ms)
        finally:
            b.close()
    return result


def lookup_latency(server: KvgwProcess, n: int, samples: int = 50) -> float:
    """p50 ms of one ``exists`` of ``n`` blocks with a lease, as the kvgw tier sends a step's batch."""
    from kvgw_client.config import ClientSettings
    from kvgw_client.http import KvgwClient

    client = KvgwClient(ClientSettings(url=server.url, bucket=BUCKET, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                       lease_ms=5000))
    try:
        names = [f"bench-k/lookup/{i:064x}.bin" for i in range(n)]
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            client.blocking.exists(names)
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)
    finally:
        client.close()


def report(results: list[Result], args: argparse.Namespace, exists_ms: float | None) -> tuple[str, bool]:
    ok = True
    lines = [f"{'target':<34} {'store MB/s':>11} {'load MB/s':>10} {'lookup steps':>13}",
             "-" * 72]
    by = {r.target: r for r in results}
    for r in results:
        if r.error is not None:
            lines.append(f"({r.target}) {TARGETS[r.target]:<30} FAILED: {r.error}")
            ok = False
            continue
        lines.append(f"({r.target}) {TARGETS[r.target]:<30} {statistics.median(r.store_mbps):>11.0f} "
                     f"{statistics.median(r.load_mbps):>10.0f} {'/'.join(map(str, r.lookup_steps)):>13}")
    lines.append("")
    k = by.get("k")
    if k is not None and k.error is None and k.load_mbps:
        load = statistics.median(k.load_mbps)
        for other, need in (("f", 1.0), ("o", 2.0)):
            base = by.get(other)
            if base is None or base.error is not None:
                continue
            ratio = load / statistics.median(base.load_mbps)
            lines.append(f"kvgw tier load / ({other}) load: {ratio:.2f}x (target >= {need:.1f}x): "
                         f"{'MET' if ratio >= need else 'NOT MET'}")
        d = by.get("d")
        o = by.get("o")
        if d is not None and d.error is None and o is not None and o.error is None:
            ratio = statistics.median(d.load_mbps) / statistics.median(o.load_mbps)
            lines.append(f"kvgw tier with direct reads load / (o) load: {ratio:.2f}x (target >= 2.0x): "
                         f"{'MET' if ratio >= 2.0 else 'NOT MET'}")
        steps = max(k.lookup_steps)
        lines.append(f"kvgw tier: {args.blocks} blocks' lookups answered after {steps} scheduler step(s) of "
                     f"{args.step_ms} ms (target 1): {'MET' if steps <= 1 else 'NOT MET'}")
        if exists_ms is not None:
            lines.append(f"kvgw tier: one step's lookup batch ({args.blocks} keys, exists with a lease) "
                         f"p50 {exists_ms:.2f} ms")
    return "\n".join(lines), ok


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgw bench vllm", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--blocks", type=int, default=64, help="blocks stored and loaded per round (default 64)")
    p.add_argument("--block-mib", type=int, default=2, help="MiB per block (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="store + load rounds per target (default 3)")
    p.add_argument("--step-ms", type=float, default=10.0, help="a scheduler step's length (default 10 ms)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds a new engine idles before it is timed")
    p.add_argument("--only", default="kdfo", help="targets to run, e.g. 'kf' (default kdfo)")
    p.add_argument("--no-fsync", action="store_true", help="run kvgw with --no-fsync (vLLM's tiers never fsync)")
    p.add_argument("--workdir", type=Path, help="where kvgw's data and the fs tier's files go (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    from gateway.bench import vllm_engine

    try:
        vllm_engine.load()
    except ImportError as exc:
        print(f"kvgw bench vllm needs vLLM 0.33 (.ci/install-vllm.sh DIR, then DIR/bin/kvgw): {exc}",
              file=sys.stderr)
        return 1
    import importlib.metadata

    with work_directory(args, "kvgw-bench-vllm-") as workdir:
        env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY}
        server = KvgwProcess(workdir / "kvgw", extra_args=["--no-fsync"] if args.no_fsync else [], env=env,
                             inherit_kvgw_env=False, log_path=workdir / "kvgw.log")
        (workdir / "fs-tier").mkdir(exist_ok=True)
        with server:
            results: list[Result] = []
            seed = int(time.time()) << 8
            for target in args.only:
                try:
                    results.append(run_target(target, tier_config(target, server, workdir), args, seed))
                except Exception as exc:  # report and go on with the other targets
                    results.append(Result(target, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            exists_ms = lookup_latency(server, args.blocks) if "k" in args.only else None
        same = os.stat(workdir / "kvgw").st_dev == os.stat(workdir / "fs-tier").st_dev
        print(f"kvgw bench vllm: {args.blocks} blocks x {args.block_mib} MiB, {args.rounds} rounds, medians; "
              f"vLLM {importlib.metadata.version('vllm')}, {os.cpu_count()} CPUs; kvgw fsync "
              f"{'off' if args.no_fsync else 'on'}; kvgw data and the fs tier "
              f"{'on the same device' if same else 'on DIFFERENT devices'}")
        table, ok = report(results, args, exists_ms)
        print(table)
        return 0 if ok else 1
