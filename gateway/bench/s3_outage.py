"""``kvgw bench s3-outage``: what a client waits for while the S3 tier is hung or dead (issue 12, items 1-3).

One run starts ``moto_server`` and a real ``kvgw serve`` whose S3 tier is that moto (its request-path
settings at their defaults unless given), writes S3-only chunks (a bucket whose write tier is S3), and
times three requests on one keep-alive connection, each phase in turn:

- ``exists`` of one key the gateway does not know (an index miss: a lookup in S3);
- ``PUT`` of a new key into the filesystem-tier bucket (its pre-write lookup misses, and asks S3);
- ``GET`` of an S3-only chunk (promotion on read, then a direct read).

Phases: ``healthy``; ``hung`` (moto SIGSTOPped: connections accepted, never answered); ``dead`` (moto
SIGKILLed: connections refused). In the outage phases the first request of each kind after the outage
began is reported apart ("first"), then ``--rounds`` more; the breaker's state comes from
``/v1/admin/stats``. Between ``hung`` and ``dead`` moto is resumed and the breaker left to close.
Targets (issue 12): no request waits for the tier's 30 s operation deadline while S3 hangs (every
answer under 2 s), a new PUT answers 201 in every phase, and the first S3-only GET after S3 dies
answers (503) within 500 ms. Exit status 1 when a target fails.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from gateway.bench.launcher import KvgwProcess, moto_server

ROOT = ("KVBENCHROOT0000000000", "bench-root-secret-0123456789")
MOTO_BUCKET = "kvgw-outage-bench"
OPS = ("exists", "PUT", "GET s3-only")


class Client:
    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.auth = {"Authorization": f"Bearer {ROOT[0]}:{ROOT[1]}"}

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = dict(self.auth)
        if body is not None:
            headers["Content-Type"] = "application/octet-stream"
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()

    def timed(self, method: str, path: str, body: bytes | None = None) -> tuple[float, int]:
        start = time.perf_counter()
        status, _ = self.request(method, path, body)
        return (time.perf_counter() - start) * 1e3, status

    def breaker(self) -> str:
        status, payload = self.request("GET", "/v1/admin/stats")
        return str(json.loads(payload).get("s3_breaker")) if status == 200 else f"stats {status}"


class Phase:
    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name
        self.first: dict[str, tuple[float, int]] = {}
        self.samples: dict[str, list[tuple[float, int]]] = {op: [] for op in OPS}
        self.breaker = ""

    def run(self, rounds: int, counter: Callable[[], int], first: bool) -> None:
        calls = {
            "exists": lambda i: self.client.timed("POST", "/v1/buckets/kvcache/exists",
                                                  json.dumps({"keys": [f"unknown-{self.name}-{i}"]}).encode()),
            "PUT": lambda i: self.client.timed("PUT", f"/v1/buckets/kvcache/chunks/new-{self.name}-{i}", b"n" * 4096),
            "GET s3-only": lambda i: self.client.timed("GET", f"/v1/buckets/remote/chunks/cold-{counter()}"),
        }
        order = ("GET s3-only", "exists", "PUT")  # the first GET after the outage began is item 3's figure
        if first:
            for op in order:
                self.first[op] = calls[op](-1)
        for i in range(rounds):
            for op in order:
                self.samples[op].append(calls[op](i))
        self.breaker = self.client.breaker()

    def rows(self) -> list[str]:
        out = []
        for op in OPS:
            times = [t for t, _ in self.samples[op]]
            statuses = Counter(s for _, s in self.samples[op])
            first = self.first.get(op)
            first_text = f"{first[0]:8.1f} ({first[1]})" if first else f"{'-':>14}"
            out.append(f"{self.name:8} {op:12} {first_text} {statistics.median(times):9.1f} {max(times):9.1f}   "
                       + " ".join(f"{code}x{n}" for code, n in sorted(statuses.items())))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench s3-outage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="requests of each kind per phase, after the first")
    parser.add_argument("--lookup-timeout", type=float, help="KVGW_S3__LOOKUP_TIMEOUT (default: the setting's)")
    parser.add_argument("--request-timeout", type=float, help="KVGW_S3__REQUEST_TIMEOUT (default: the setting's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-s3-outage-") as tmp:
        return run(Path(tmp), args)


def run(workdir: Path, args: argparse.Namespace) -> int:
    import boto3

    with moto_server(workdir / "moto.log") as (port, moto):
        url = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=MOTO_BUCKET)
        env = {"KVGW_ROOT_ACCESS_KEY": ROOT[0], "KVGW_ROOT_SECRET_KEY": ROOT[1], "KVGW_FSYNC": "false",
               "KVGW_LIFECYCLE_INTERVAL": "3600", "KVGW_S3__ENDPOINT_URL": url, "KVGW_S3__BUCKET": MOTO_BUCKET,
               "KVGW_S3__ACCESS_KEY": "testing", "KVGW_S3__SECRET_KEY": "testing",
               "KVGW_S3__ADDRESSING_STYLE": "path"}
        if args.lookup_timeout is not None:
            env["KVGW_S3__LOOKUP_TIMEOUT"] = str(args.lookup_timeout)
        if args.request_timeout is not None:
            env["KVGW_S3__REQUEST_TIMEOUT"] = str(args.request_timeout)
        data_dir = workdir / "kvgw-data"
        from gateway.cli import main as kvgw

        with _environment(env), contextlib.redirect_stdout(io.StringIO()):
            if kvgw(["bucket", "create", "remote", "--data-dir", str(data_dir), "--write-tier", "s3"]) != 0:
                print("could not create the S3-tier bucket", file=sys.stderr)
                return 1
        with KvgwProcess(data_dir, env=env, inherit_kvgw_env=False, log_path=workdir / "kvgw.log") as server:
            client = Client(server.port)
            cold = 3 * (args.rounds + 2)
            for i in range(cold):
                status, text = client.request("PUT", f"/v1/buckets/remote/chunks/cold-{i}", b"c" * 65536)
                if status != 201:
                    print(f"setup: PUT of an S3-only chunk answered {status}: {text[:200]!r}", file=sys.stderr)
                    return 1
            next_cold = iter(range(cold))
            phases = []
            healthy = Phase(client, "healthy")
            healthy.run(args.rounds, lambda: next(next_cold), first=False)
            phases.append(healthy)
            moto.send_signal(signal.SIGSTOP)
            try:
                hung = Phase(client, "hung")
                hung.run(args.rounds, lambda: next(next_cold), first=True)
                phases.append(hung)
            finally:
                moto.send_signal(signal.SIGCONT)
            _wait_closed(client)
            moto.send_signal(signal.SIGKILL)
            moto.wait(10)
            dead = Phase(client, "dead")
            dead.run(args.rounds, lambda: next(next_cold), first=True)
            phases.append(dead)
            settings = _request_path_settings(env)
    return report(phases, args.rounds, settings)


def _wait_closed(client: Client, timeout: float = 60.0) -> None:
    """After the hung phase: wait out the breaker's cooldown; a lookup is then its probe and closes it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client.request("POST", "/v1/buckets/kvcache/exists", json.dumps({"keys": ["probe"]}).encode())
        if client.breaker() == "closed":
            return
        time.sleep(0.5)
    raise RuntimeError("the S3 breaker did not close after moto resumed")


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the block (the CLI reads its settings from there)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _request_path_settings(env: dict[str, str]) -> str:
    from backends.s3_settings import S3TierSettings

    fields = S3TierSettings.model_fields
    values = {name: env.get(f"KVGW_S3__{name.upper()}", fields[name].default)
              for name in ("lookup_timeout", "request_timeout", "request_max_attempts", "operation_timeout",
                           "breaker_threshold", "breaker_cooldown")}
    return ", ".join(f"{k} {v}" for k, v in values.items())


def report(phases: list[Phase], rounds: int, settings: str) -> int:
    print(f"kvgw bench s3-outage: {rounds} requests of each kind per phase (after the first), one keep-alive "
          "connection; moto_server as the S3 tier")
    print(f"S3 tier: {settings}")
    print()
    print(f"{'phase':8} {'op':12} {'first ms':>14} {'p50 ms':>9} {'max ms':>9}   statuses")
    for phase in phases:
        for row in phase.rows():
            print(row)
        print(f"{'':8} breaker after the phase: {phase.breaker}")
    by_name = {p.name: p for p in phases}
    hung, dead = by_name["hung"], by_name["dead"]
    hung_max = max(max(t for t, _ in hung.samples[op]) for op in OPS)
    hung_max = max(hung_max, *(t for t, _ in hung.first.values()))
    puts_ok = all(s == 201 for p in phases for _, s in p.samples["PUT"]) and all(
        p.first.get("PUT", (0.0, 201))[1] == 201 for p in phases)
    first_get_ms, first_get_status = dead.first["GET s3-only"]
    targets = [
        ("hung S3: every answer under 2 s (no 30 s operation deadline)", hung_max < 2000.0, f"max {hung_max:.1f} ms"),
        ("new PUT to an fs-tier bucket answers 201 in every phase", puts_ok, ""),
        ("first S3-only GET after S3 dies answers within 500 ms", first_get_ms < 500.0 and first_get_status == 503,
         f"{first_get_ms:.1f} ms, {first_get_status}"),
    ]
    print()
    print("targets:")
    for name, ok, detail in targets:
        print(f"  {name:66} {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
