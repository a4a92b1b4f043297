"""``kvgw bench slow-clients``: request latency while many stalled connections are open.

A real gateway; a client on one keep-alive connection times GET, PUT and exists of small chunks, first
with no other connection open (the baseline, same run), then with ``--stalled`` connections open from
many loopback addresses, half with a partial request line, half in the middle of a PUT body. Prints
p50/p99 per operation for both phases, their ratio, and the verdict of the target (p99 under
``--target-ms`` while the stalled connections are open).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.bench.launcher import KvgwProcess

ROOT = ("KVBENCHROOT0000000000", "bench-root-secret-0123456789")


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(rounds: int, call: Callable[[int], None]) -> list[float]:
    out = []
    for i in range(rounds):
        start = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def measure(port: int, rounds: int, tag: str) -> dict[str, list[float]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    auth = {"Authorization": f"Bearer {ROOT[0]}:{ROOT[1]}"}
    body = b"x" * 4096

    def request(method: str, path: str, data: bytes | None = None, **headers: str) -> bytes:
        conn.request(method, path, body=data, headers={**auth, **headers})
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {payload[:200]!r}")
        return payload

    def put(i: int) -> None:
        request("PUT", f"/v1/buckets/kvcache/chunks/{tag}-{i}", body)

    def get(i: int) -> None:
        request("GET", f"/v1/buckets/kvcache/chunks/{tag}-{i}")

    keys = json.dumps({"keys": [f"{tag}-{i}" for i in range(64)]}).encode()

    def exists(_: int) -> None:
        request("POST", "/v1/buckets/kvcache/exists", keys, **{"Content-Type": "application/json"})

    result = {"PUT": _timed(rounds, put), "GET": _timed(rounds, get), "exists": _timed(rounds, exists)}
    conn.close()
    return result


def open_stalled(port: int, count: int, stack: contextlib.ExitStack) -> None:
    put_head = (f"PUT /v1/buckets/kvcache/chunks/stalled HTTP/1.1\r\nHost: a\r\n"
                f"Authorization: Bearer {ROOT[0]}:{ROOT[1]}\r\nContent-Length: 100000\r\n\r\nabc").encode()
    for i in range(count):
        sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30,
                                                            source_address=(f"127.0.2.{1 + i % 200}", 0)))
        sock.sendall(b"GET /v1/buck" if i % 2 else put_head)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench slow-clients", description=__doc__)
    parser.add_argument("--stalled", type=int, default=1000, help="stalled connections to hold open")
    parser.add_argument("--rounds", type=int, default=300, help="timed calls per operation and phase")
    parser.add_argument("--target-ms", type=float, default=100.0, help="p99 each operation must stay under")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvgw-bench-slow-") as tmp:
        env = {"KVGW_ROOT_ACCESS_KEY": ROOT[0], "KVGW_ROOT_SECRET_KEY": ROOT[1],
               "KVGW_HEADER_TIMEOUT": "600", "KVGW_BODY_IDLE_TIMEOUT": "600"}
        with KvgwProcess(data_dir=Path(tmp) / "data", env=env, inherit_kvgw_env=False) as server:
            baseline = measure(server.port, args.rounds, "base")
            with contextlib.ExitStack() as stack:
                open_stalled(server.port, args.stalled, stack)
                loaded = measure(server.port, args.rounds, "loaded")
    failed = False
    print(f"{'op':8} {'p50 ms':>8} {'p99 ms':>8} | {'p50 ms':>8} {'p99 ms':>8} with {args.stalled} stalled | "
          f"p99 ratio  target p99 < {args.target_ms:g} ms")
    for op in baseline:
        b50, b99 = statistics.median(baseline[op]), _percentile(baseline[op], 0.99)
        l50, l99 = statistics.median(loaded[op]), _percentile(loaded[op], 0.99)
        ok = l99 < args.target_ms
        failed |= not ok
        print(f"{op:8} {b50:8.2f} {b99:8.2f} | {l50:8.2f} {l99:8.2f}{'':>{len(str(args.stalled)) + 14}} | "
              f"{l99 / b99:9.2f}  {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
