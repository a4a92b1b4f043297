"""``kvgw bench etag``: what an MD5-mode bucket (``kvgw bucket create B --etag md5``) costs a PUT, against
an xxh3-mode bucket (the default) on the same gateway, in the same run.

One ``kvgw serve`` (fsync on unless ``--no-fsync``) with two buckets, ``etag-xxh3`` and ``etag-md5``.
Each round PUTs ``--count`` objects of ``--size-mib`` into each bucket, alternating which goes first,
through the load generator (one process per client, one keep-alive connection each), both ways a KV
engine writes: S3 PutObject signed ``UNSIGNED-PAYLOAD`` (LMCache's S3 connector; a threaded receive:
the body is received, hashed and written by one worker thread, the MD5 beside the xxh3 there) and the
native PUT. After each phase, outside its timing, its objects are deleted, so no phase writes into a
page cache the others grew. Per phase: throughput, p50, and the server's CPU milliseconds per PUT
(``/proc/<pid>/stat`` over the phase); the median of ``--rounds`` rounds is kept, and the verdict lines
give md5 / xxh3 for each. The ``hashlib`` line is the floor: MD5 and xxh3-64 of the same buffer in this
process, one core, no I/O.

No target: the figure explains the default (``BENCHMARKS.md``). Compare within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import xxhash

from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import LoadRequest, Stats, run_load
from gateway.bench.procstat import total_cpu_seconds
from gateway.bench.s3 import ACCESS_KEY, SECRET_KEY, signed_request

MiB = 1 << 20
MODES = ("xxh3", "md5")
APIS = ("s3", "native")


@dataclass
class Phase:
    api: str
    mode: str
    clients: int
    stats: Stats
    server_cpu: float

    @property
    def server_ms_per_put(self) -> float:
        return self.server_cpu * 1e3 / self.stats.ops if self.stats.ops else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.stats.bytes_per_s / 1e6


def bucket(mode: str) -> str:
    return f"etag-{mode}"


def hash_floor(size: int, repeat: int = 20) -> dict[str, float]:
    """Milliseconds per ``size`` bytes for MD5 and xxh3-64 in this process (the median of ``repeat``)."""
    data = os.urandom(size)
    out: dict[str, float] = {}
    for name in ("md5", "xxh3"):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            if name == "md5":
                hashlib.md5(data).digest()
            else:
                xxhash.xxh3_64(data).digest()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    return out


def _cli(server: KvgwProcess, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--data-dir", str(server.data_dir)],
                   env=server.environment(), check=True, capture_output=True, timeout=120)


def _put_requests(server: KvgwProcess, api: str, mode: str, keys: list[str], payload: bytes) -> list[LoadRequest]:
    if api == "s3":
        from gateway.bench.s3 import Server

        target = Server("kvgw", server.url, (), ACCESS_KEY, SECRET_KEY)
        return [signed_request(target, "PUT", k, payload, (200,), bucket=bucket(mode)) for k in keys]
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    return [LoadRequest("PUT", f"/v1/buckets/{bucket(mode)}/chunks/{quote(k, safe='')}", body=payload,
                        headers=[auth], expect=(201,)) for k in keys]


def _delete_all(server: KvgwProcess, mode: str, keys: list[str]) -> None:
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    deletes = [LoadRequest("DELETE", f"/v1/buckets/{bucket(mode)}/chunks/{quote(k, safe='')}", headers=[auth],
                           expect=(204,)) for k in keys]
    run_load(server.address, lambda i, seq: deletes[seq], 1, count=len(deletes))


def run_phase(server: KvgwProcess, api: str, mode: str, clients: int, payload: bytes, count: int, tag: str) -> Phase:
    keys = [f"{tag}/{api}/{mode}/{n}" for n in range(count)]
    puts = _put_requests(server, api, mode, keys, payload)
    assert server.proc is not None
    os.sync()
    before = total_cpu_seconds([server.proc.pid])
    stats = run_load(server.address, lambda i, seq: puts[seq], clients, count=len(puts), processes=True)
    cpu = total_cpu_seconds([server.proc.pid]) - before
    _delete_all(server, mode, keys)
    return Phase(api, mode, clients, stats, cpu)


def _median(phases: list[Phase]) -> Phase:
    return sorted(phases, key=lambda p: p.server_ms_per_put)[len(phases) // 2]


def _table(phases: list[Phase]) -> str:
    lines = [f"{'api':<8}{'bucket':<12}{'clients':>8}{'MB/s':>9}{'p50 ms':>9}{'errors':>8}{'srv ms/PUT':>12}"]
    for p in phases:
        lines.append(f"{p.api:<8}{bucket(p.mode):<12}{p.clients:>8}{p.mb_per_s:>9.0f}"
                     f"{p.stats.percentile(0.5) * 1e3:>9.1f}{p.stats.errors:>8}{p.server_ms_per_put:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench etag", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=8.0, help="object size (default 8 MiB)")
    parser.add_argument("--count", type=int, default=40, help="PUTs per phase (default 40)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median counts (default 5)")
    parser.add_argument("--clients", default="1,8", help="client counts (default 1,8)")
    parser.add_argument("--no-fsync", action="store_true", help="run kvgw without fsync (default: fsync on)")
    parser.add_argument("--workdir", type=Path, help="where kvgw keeps data (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    size = int(args.size_mib * MiB)
    payload = os.urandom(size)
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgw-bench-etag-"))
    floor = hash_floor(size)
    print(f"kvgw bench etag: {size / MiB:g} MiB PUTs, {args.count} per phase, {args.rounds} alternating rounds, "
          f"clients {clients_list}, fsync {'off' if args.no_fsync else 'on'}, {os.cpu_count()} CPUs", flush=True)
    print(f"  hashlib floor, one core: MD5 {floor['md5']:.2f} ms, xxh3-64 {floor['xxh3']:.2f} ms per "
          f"{size / MiB:g} MiB ({size / floor['md5'] / 1e3:.0f} / {size / floor['xxh3'] / 1e3:.0f} MB/s)", flush=True)
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_FSYNC": "false" if args.no_fsync else "true"}
    kept: list[Phase] = []
    try:
        with KvgwProcess(workdir / "kvgw-data", env=env, log_path=workdir / "kvgw.log") as server:
            for mode in MODES:
                _cli(server, "bucket", "create", bucket(mode), "--etag", mode)
            _wait_known(server)
            for clients in clients_list:
                for api in APIS:
                    rounds: dict[str, list[Phase]] = {m: [] for m in MODES}
                    for n in range(args.rounds):
                        order = MODES if n % 2 == 0 else tuple(reversed(MODES))
                        for mode in order:
                            rounds[mode].append(run_phase(server, api, mode, clients, payload, args.count,
                                                          f"r{n}c{clients}"))
                    kept.extend(_median(rounds[m]) for m in MODES)
                    print(f"  {api} PUT, {clients} client(s): done", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(_table(kept))
    print()
    print("md5 / xxh3 (same gateway, same client, medians of alternated rounds):")
    by = {(p.api, p.mode, p.clients): p for p in kept}
    for clients in clients_list:
        for api in APIS:
            x, m = by[(api, "xxh3", clients)], by[(api, "md5", clients)]
            print(f"  {api:<7} {clients} client(s): server CPU per PUT {m.server_ms_per_put:6.2f} / "
                  f"{x.server_ms_per_put:6.2f} ms = {m.server_ms_per_put / max(x.server_ms_per_put, 1e-9):4.2f}x "
                  f"(+{m.server_ms_per_put - x.server_ms_per_put:.2f} ms); throughput "
                  f"{m.mb_per_s / max(x.mb_per_s, 1e-9):4.2f}x; p50 "
                  f"{m.stats.percentile(0.5) / max(x.stats.percentile(0.5), 1e-9):4.2f}x")
    errors = sum(p.stats.errors for p in kept)
    return 0 if errors == 0 else 1


def _wait_known(server: KvgwProcess, timeout: float = 30.0) -> None:
    """Until both buckets answer a PUT the way their mode says (the catalog refresh has seen them)."""
    import httpx

    deadline = time.monotonic() + timeout
    auth = {"Authorization": f"Bearer {ACCESS_KEY}:{SECRET_KEY}"}

    def known(mode: str) -> bool:
        url = f"{server.url}/v1/buckets/{bucket(mode)}/chunks/probe"
        return httpx.put(url, content=b"p", headers=auth, timeout=30).status_code in (200, 201)

    while not all(known(mode) for mode in MODES):
        if time.monotonic() > deadline:
            raise SystemExit("kvgw bench etag: the buckets never became known to the gateway")
        time.sleep(0.1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
