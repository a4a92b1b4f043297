"""``kvgw bench memory``: the gateway's peak RSS while many clients read large chunks as fast as they can.

A real gateway stores ``--objects`` chunks of each size; then, per size, its peak-RSS mark is reset
(``/proc/PID/clear_refs``) and ``--clients`` keep-alive clients GET chunks in a loop for
``--duration`` seconds. Reported: RSS before, the peak (VmHWM, which counts mapped file pages as a
container's memory limit does), the sampled maxima of anonymous and file-backed RSS, and throughput;
the target (issue 12, item 11) is a peak of at most ``--target-mib``.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gateway.bench import procstat
from gateway.bench.launcher import KvgwProcess

MiB = 1 << 20
ROOT = ("KVBENCHROOT0000000000", "bench-root-secret-0123456789")
AUTH = {"Authorization": f"Bearer {ROOT[0]}:{ROOT[1]}"}


def store(port: int, size: int, count: int) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    keys = []
    for i in range(count):
        key = f"mem-{size}-{i}"
        conn.request("PUT", f"/v1/buckets/kvcache/chunks/{key}", body=os.urandom(size), headers=AUTH)
        response = conn.getresponse()
        response.read()
        if response.status not in (200, 201):
            raise RuntimeError(f"PUT {key}: {response.status}")
        keys.append(key)
    conn.close()
    return keys


def read_phase(server: KvgwProcess, keys: list[str], clients: int, duration: float) -> dict[str, Any]:
    pid = server.pids()[0]
    procstat.reset_peak_rss(pid)
    before = procstat.memory_bytes(pid)
    deadline = time.monotonic() + duration
    received = [0] * clients
    errors = [0] * clients

    def client(n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        i = n
        while time.monotonic() < deadline:
            conn.request("GET", f"/v1/buckets/kvcache/chunks/{keys[i % len(keys)]}", headers=AUTH)
            response = conn.getresponse()
            if response.status != 200:
                errors[n] += 1
            while piece := response.read(MiB):
                received[n] += len(piece)
            i += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    anon = file = 0
    while any(t.is_alive() for t in threads):
        sample = procstat.memory_bytes(pid)
        anon, file = max(anon, sample.get("RssAnon", 0)), max(file, sample.get("RssFile", 0))
        time.sleep(0.02)
    after = procstat.memory_bytes(pid)
    return {"rss_before": before.get("VmRSS", 0), "peak": after.get("VmHWM", 0), "anon_max": anon,
            "file_max": file, "bytes_per_s": sum(received) / duration, "errors": sum(errors)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench memory", description=__doc__)
    parser.add_argument("--sizes", default="16,32", help="chunk sizes in MiB (default 16,32)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--objects", type=int, default=8, help="chunks per size the clients cycle over")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of reading per size")
    parser.add_argument("--target-mib", type=float, default=400.0)
    args = parser.parse_args(argv)
    sizes = [int(s) * MiB for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-memory-") as tmp:
        env = {"KVGW_ROOT_ACCESS_KEY": ROOT[0], "KVGW_ROOT_SECRET_KEY": ROOT[1]}
        with KvgwProcess(data_dir=Path(tmp) / "data", env=env, inherit_kvgw_env=False) as server:
            results = {size: read_phase(server, store(server.port, size, args.objects), args.clients,
                                        args.duration) for size in sizes}
    failed = False
    print(f"kvgw bench memory: {args.clients} clients, {args.duration:g} s per size, target peak <= "
          f"{args.target_mib:g} MiB")
    print(f"{'chunk':>8} {'before':>8} {'peak':>8} {'anon max':>9} {'file max':>9} {'MB/s':>7} {'errors':>6}  verdict")
    for size, r in results.items():
        ok = r["peak"] <= args.target_mib * MiB and not r["errors"]
        failed |= not ok
        print(f"{size // MiB:>5} MiB {r['rss_before'] / MiB:>8.0f} {r['peak'] / MiB:>8.0f} "
              f"{r['anon_max'] / MiB:>9.0f} {r['file_max'] / MiB:>9.0f} {r['bytes_per_s'] / 1e6:>7.0f} "
              f"{r['errors']:>6}  {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
