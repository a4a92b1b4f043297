"""``kvgw bench s3``: PUT/GET of 8 MiB objects through boto3 against kvgw's S3 API and moto, with
kvgw's native API as the reference, all in one run on this machine.

Targets, each at every client count (processes, one client and connection each):

- ``kvgw-s3 boto3``: boto3 as an application uses it (default configuration: SigV4, CRC32 trailer
  on PUT, checksum validation on GET), path-style;
- ``moto boto3``: the same client code against ``moto_server`` (the S3 emulator people test with);
- ``kvgw-native``: the native API through the shared load generator (``gateway.bench.loadgen``);
- ``kvgw-s3 loadgen``: the S3 API through that same load generator, with requests SigV4-signed in
  advance (UNSIGNED-PAYLOAD, as LMCache sends them). Against ``kvgw-native`` this isolates what the S3
  front door costs on the server, since client and bytes are the same;
- ``moto loadgen`` (PUT): moto through the load generator, the same cheap client for both servers.

Beside throughput and latency, each row shows the CPU milliseconds per operation used by the server
process (``/proc/<pid>/stat`` over the phase) and by the clients: on a host where clients and server
share the CPUs, this tells a server that is cheaper per request from one that merely got more CPU.

Every PUT writes a new key (objects are write-once); GETs read back the keys the PUT phase wrote,
round robin. GET phases alternate between the targets for ``--rounds`` rounds and the median round
counts, so a noisy neighbour hits every target alike. Ratios are to ``kvgw-native`` at the same
client count. Every client, boto3 or load generator, is a process of its own (boto3 holds the GIL
while it signs and checksums a body, and even the load generator's clients would share one GIL as
threads), so each row measures its server, not one client process. Servers and clients share this
host's CPUs, so absolute numbers depend on the machine; compare within a run. Exit status 1 when a
target fails or a request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway.bench.launcher import KvgwProcess, moto_server
from gateway.bench.loadgen import Address, LoadRequest, Op, Stats, run_load, run_ops
from gateway.bench.procstat import cpu_seconds

MiB = 1 << 20
ACCESS_KEY = "KVBENCHROOTACCESSKEY"
SECRET_KEY = "kvgw-bench-root-secret-key-0123456789"
MOTO_KEY = "testing"
BUCKET = "kvcache"
NATIVE = "kvgw-native loadgen"
S3_LOADGEN = "kvgw-s3 loadgen"
S3_BOTO3 = "kvgw-s3 boto3"
MOTO_BOTO3 = "moto boto3"
MOTO_LOADGEN = "moto loadgen"


@dataclass(frozen=True)
class Server:
    url: str
    pid: int  # the server process (uvicorn and moto_server are one process each): its CPU time is read


@contextlib.contextmanager
def kvgw_server(workdir: Path, *, fsync: bool) -> Iterator[Server]:
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_FSYNC": "true" if fsync else "false"}
    with KvgwProcess(workdir / "kvgw-data", env=env, log_path=workdir / "kvgw.log") as server:
        assert server.proc is not None
        yield Server(server.url, server.proc.pid)


@contextlib.contextmanager
def moto_s3(workdir: Path) -> Iterator[Server]:
    with moto_server(workdir / "moto.log") as (port, proc):
        yield Server(f"http://127.0.0.1:{port}", proc.pid)


def boto3_client(url: str, access_key: str, secret_key: str, clients: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=url, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=max(10, clients),
                      retries={"max_attempts": 1, "mode": "standard"}),
    )


@dataclass
class Result:
    target: str
    op: str
    clients: int
    stats: Stats
    keys: list[str] = field(default_factory=list)  # what a PUT phase wrote, for the GET phase
    server_cpu: float = 0.0  # CPU seconds the server process used during the phase

    @property
    def mb_per_s(self) -> float:
        return self.stats.bytes_per_s / 1e6

    @property
    def server_ms_per_op(self) -> float:
        return self.server_cpu * 1e3 / self.stats.ops if self.stats.ops else 0.0

    @property
    def client_ms_per_op(self) -> float:
        return self.stats.client_cpu * 1e3 / self.stats.ops if self.stats.ops else 0.0


def on_server(server: Server, phase: Callable[[], Result]) -> Result:
    """Run one phase and record the CPU time its server used meanwhile."""
    before = cpu_seconds(server.pid)
    result = phase()
    result.server_cpu = cpu_seconds(server.pid) - before
    return result


def boto3_put(target: str, url: str, access_key: str, secret_key: str, clients: int, payload: bytes,
              duration: float, tag: str) -> Result:
    """Each client a process of its own (boto3 holds the GIL while it signs and checksums)."""
    size = len(payload)
    prefix = f"bench-{tag}/c{clients}/"

    def open_put(i: int) -> Op:
        client = boto3_client(url, access_key, secret_key, 1)

        def op(seq: int) -> int:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}t{i}/{seq}", Body=payload)
            return size

        return op

    stats = run_ops(open_put, clients, duration=duration, processes=True)
    return Result(target, "PUT", clients, stats, _listed(url, access_key, secret_key, prefix))


def _listed(url: str, access_key: str, secret_key: str, prefix: str) -> list[str]:
    """The keys the client processes wrote (they cannot hand them back; the server can)."""
    pages = boto3_client(url, access_key, secret_key, 1).get_paginator("list_objects_v2")
    return [obj["Key"] for page in pages.paginate(Bucket=BUCKET, Prefix=prefix) for obj in page.get("Contents", [])]


def boto3_get(target: str, url: str, access_key: str, secret_key: str, clients: int, keys: list[str], size: int,
              duration: float) -> Result:
    def open_get(i: int) -> Op:
        client = boto3_client(url, access_key, secret_key, 1)

        def op(seq: int) -> int:
            body = client.get_object(Bucket=BUCKET, Key=keys[(seq * clients + i) % len(keys)])["Body"]
            got = len(body.read())
            if got != size:
                raise RuntimeError(f"short GET: {got} of {size}")
            return got

        return op

    return Result(target, "GET", clients, run_ops(open_get, clients, duration=duration, processes=True))


def native_put(url: str, clients: int, payload: bytes, duration: float) -> Result:
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    prefix = f"native/c{clients}/"

    def put_request(i: int, seq: int) -> LoadRequest:
        key = f"{prefix}t{i}/{seq}"
        return LoadRequest("PUT", f"/v1/buckets/{BUCKET}/chunks/{quote(key, safe='')}", body=payload, headers=[auth],
                       expect=(201,))

    stats = run_load(_address(url), put_request, clients, duration=duration, processes=True)
    return Result(NATIVE, "PUT", clients, stats, _listed(url, ACCESS_KEY, SECRET_KEY, prefix))


def native_get(url: str, clients: int, keys: list[str], size: int, duration: float) -> Result:
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    gets = [LoadRequest("GET", f"/v1/buckets/{BUCKET}/chunks/{quote(k, safe='')}", headers=[auth]) for k in keys]
    stats = run_load(_address(url), lambda i, seq: gets[(seq * clients + i) % len(gets)], clients, duration=duration,
                     body_buffer_bytes=size, processes=True)
    return Result(NATIVE, "GET", clients, stats)


def _address(url: str) -> Address:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


def signed_request(url: str, method: str, key: str, body: bytes | None, expect: tuple[int, ...]) -> LoadRequest:
    """A SigV4 (UNSIGNED-PAYLOAD) request built by botocore's signer, replayable for 15 minutes."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path = f"/{BUCKET}/{quote(key, safe='/~')}"
    request = AWSRequest(method=method, url=f"{url}{path}",
                         headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    if body is not None:
        request.headers["Content-Length"] = str(len(body))

    class UnsignedPayloadAuth(S3SigV4Auth):  # type: ignore[misc]
        def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
            return False

    UnsignedPayloadAuth(Credentials(ACCESS_KEY, SECRET_KEY), "s3", "us-east-1").add_auth(request)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("content-length", "host")]
    return LoadRequest(method, path, body=body, headers=headers, expect=expect)


def loadgen_s3_put(target: str, url: str, clients: int, payload: bytes, tag: str, count: int) -> Result:
    keys = [f"loadgen-{tag}/c{clients}/{n}" for n in range(max(count, clients * 4))]
    puts = [signed_request(url, "PUT", k, payload, (200,)) for k in keys]
    stats = run_load(_address(url), lambda i, seq: puts[seq], clients, count=len(puts), processes=True)
    return Result(target, "PUT", clients, stats, keys)


def loadgen_s3_get(url: str, clients: int, keys: list[str], size: int, duration: float) -> Result:
    gets = [signed_request(url, "GET", k, None, (200,)) for k in keys]
    stats = run_load(_address(url), lambda i, seq: gets[(seq * clients + i) % len(gets)], clients,
                     duration=duration, body_buffer_bytes=size, processes=True)
    return Result(S3_LOADGEN, "GET", clients, stats)


def median_result(rounds: list[Result]) -> Result:
    """The round with the median throughput (GET rounds alternate between targets to share the noise)."""
    ordered = sorted(rounds, key=lambda r: r.stats.bytes_per_s)
    return ordered[len(ordered) // 2]


def _table(results: list[Result]) -> str:
    """One line per target: throughput, latency, errors, ratios to the native API and to moto-boto3,
    and CPU milliseconds per operation used by the server process and by the clients."""
    native = {(r.op, r.clients): r.mb_per_s for r in results if r.target == NATIVE}
    moto = {(r.op, r.clients): r.mb_per_s for r in results if r.target == MOTO_BOTO3}
    lines = [f"{'target':<22}{'op':<5}{'clients':>8}{'MB/s':>10}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'errors':>7}{'/native':>9}{'/moto':>8}{'srv ms/op':>11}{'cli ms/op':>11}"]
    for r in sorted(results, key=lambda r: (r.op, r.clients, r.target)):
        ref = native.get((r.op, r.clients))
        ref_moto = moto.get((r.op, r.clients))
        ratio = f"{r.mb_per_s / ref:.2f}" if ref else "-"
        ratio_moto = f"{r.mb_per_s / ref_moto:.2f}" if ref_moto else "-"
        s = r.stats
        lines.append(f"{r.target:<22}{r.op:<5}{r.clients:>8}{r.mb_per_s:>10.0f}{s.ops_per_s:>9.1f}"
                     f"{s.percentile(0.5) * 1e3:>9.1f}{s.percentile(0.99) * 1e3:>9.1f}{s.errors:>7}"
                     f"{ratio:>9}{ratio_moto:>8}{r.server_ms_per_op:>11.1f}{r.client_ms_per_op:>11.1f}")
        for sample in s.error_samples[:2]:
            lines.append(f"    error: {sample}")
    return "\n".join(lines)


# (numerator target, denominator target, op, minimum ratio, what the issue asks)
TARGETS = (
    (S3_LOADGEN, NATIVE, "GET", 0.90, "S3 GET >= 90% of the native API (same client)"),
    (S3_BOTO3, MOTO_BOTO3, "PUT", 3.0, "S3 PUT >= 3x moto (boto3 both)"),
)
SERVER_ONLY = ((S3_LOADGEN, MOTO_LOADGEN, "PUT", 3.0, "S3 PUT >= 3x moto (load generator both)"),)
"""Not the issue's target (it says boto3), printed beside it: the same cheap client for both servers."""


def _verdicts(results: list[Result], clients_list: list[int]) -> tuple[str, bool]:
    rate = {(r.target, r.op, r.clients): r.mb_per_s for r in results}
    lines, ok = ["targets:"], True
    for num, den, op, need, text in (*TARGETS, *SERVER_ONLY):
        for clients in clients_list:
            a, b = rate.get((num, op, clients)), rate.get((den, op, clients))
            if not a or not b:
                lines.append(f"  {text:<48} {clients} client(s): n/a")
                ok = False
                continue
            verdict = "PASS" if a / b >= need else "FAIL"
            if (num, den, op, need, text) in TARGETS:
                ok = ok and verdict == "PASS"
            else:
                verdict += " (informative)"
            lines.append(f"  {text:<48} {clients} client(s): {a:7.0f} / {b:<7.0f} = {a / b:5.2f}  {verdict}")
    return "\n".join(lines), ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgw bench s3", description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--size-mib", type=float, default=8.0, help="object size (default 8 MiB)")
    parser.add_argument("--clients", default="1,8", help="client counts (default 1,8)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating GET rounds; the median counts (default 3)")
    parser.add_argument("--no-fsync", action="store_true", help="run kvgw without fsync (default: fsync on)")
    parser.add_argument("--skip-moto", action="store_true")
    parser.add_argument("--workdir", type=Path, help="where servers keep data (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    payload = os.urandom(int(args.size_mib * MiB))
    results: list[Result] = []
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgw-bench-s3-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tags = (f"r{n}" for n in itertools.count())
    print(f"kvgw bench s3: {len(payload) / MiB:g} MiB objects, clients {clients_list}, {args.duration:g} s per "
          f"phase, fsync {'off' if args.no_fsync else 'on'}, {os.cpu_count()} CPUs, workdir {workdir}", flush=True)
    try:
        with contextlib.ExitStack() as stack:
            kvgw = stack.enter_context(kvgw_server(workdir, fsync=not args.no_fsync))
            moto = None if args.skip_moto else stack.enter_context(moto_s3(workdir))
            if moto is not None:
                boto3_client(moto.url, MOTO_KEY, MOTO_KEY, 1).create_bucket(Bucket=BUCKET)
            size = len(payload)
            for clients in clients_list:
                print(f"  PUT, {clients} client(s): native, kvgw-s3 boto3, moto boto3, kvgw-s3 loadgen", flush=True)
                os.sync()
                native = on_server(kvgw, functools.partial(native_put, kvgw.url, clients, payload, args.duration))
                os.sync()
                s3 = on_server(kvgw, functools.partial(boto3_put, S3_BOTO3, kvgw.url, ACCESS_KEY, SECRET_KEY, clients,
                                                       payload, args.duration, next(tags)))
                results += [native, s3]
                moto_put = None
                if moto is not None:
                    moto_put = on_server(moto, functools.partial(boto3_put, MOTO_BOTO3, moto.url, MOTO_KEY, MOTO_KEY,
                                                                 clients, payload, args.duration, next(tags)))
                    results.append(moto_put)
                os.sync()
                loadgen = on_server(kvgw, functools.partial(loadgen_s3_put, S3_LOADGEN, kvgw.url, clients, payload,
                                                            next(tags), native.stats.ops))
                results.append(loadgen)
                if moto is not None:
                    results.append(on_server(moto, functools.partial(loadgen_s3_put, MOTO_LOADGEN, moto.url, clients,
                                                                     payload, next(tags), native.stats.ops)))
                os.sync()
                print(f"  GET, {clients} client(s): {args.rounds} alternating rounds", flush=True)
                phases: list[tuple[Server, Callable[[], Result]]] = [
                    (kvgw, functools.partial(native_get, kvgw.url, clients, native.keys, size, args.duration)),
                    (kvgw, functools.partial(loadgen_s3_get, kvgw.url, clients, loadgen.keys, size, args.duration)),
                    (kvgw, functools.partial(boto3_get, S3_BOTO3, kvgw.url, ACCESS_KEY, SECRET_KEY, clients, s3.keys,
                                             size, args.duration)),
                ]
                if moto is not None and moto_put is not None and moto_put.keys:
                    phases.append((moto, functools.partial(boto3_get, MOTO_BOTO3, moto.url, MOTO_KEY, MOTO_KEY,
                                                           clients, moto_put.keys, size, args.duration)))
                rounds: dict[str, list[Result]] = {}
                for _ in range(args.rounds):
                    for server, phase in phases:
                        result = on_server(server, phase)
                        rounds.setdefault(result.target, []).append(result)
                results.extend(median_result(r) for r in rounds.values())
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(_table(results))
    verdicts, ok = _verdicts(results, clients_list)
    print()
    print(verdicts)
    errors = sum(r.stats.errors for r in results)
    return 0 if ok and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
