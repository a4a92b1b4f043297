"""``kvgw bench s3``: PUT/GET of 8 MiB objects against kvgw's S3 API and real or emulated S3 servers:
Ceph RGW (bluestore, on the same disk as kvgw's data) and moto, through boto3 and through the load
generator, with kvgw's native API as the reference, all in one run on this machine.

Targets, each at every client count (processes, one client and connection each), for kvgw and for
each baseline server of ``--against`` (``rgw``, ``moto``; default both, or moto alone when Ceph is not
installed, which the output then says):

- ``<server> boto3``: boto3 as an application uses it (default configuration: SigV4, CRC32 trailer
  on PUT, checksum validation on GET), path-style;
- ``<server> loadgen``: the same requests through the shared load generator
  (``gateway.bench.loadgen``), SigV4-signed in advance (UNSIGNED-PAYLOAD, as LMCache sends them):
  a client too cheap to be what is measured, the same for every server;
- ``kvgw-native loadgen``: kvgw's native API through the load generator. Against ``kvgw-s3 loadgen``
  this isolates what the S3 front door costs on the server, since client and bytes are the same;
- ``disk loop`` (PUT only): no server and no network, the bare loop of ``kvgw bench io``
  (``baselines.store_file``: write in 2 MiB pieces, fsync, link, directory fsync; no fsync with
  ``--no-fsync``; whole blocks around the page cache with ``--direct-writes``, as kvgw then writes) in
  as many threads as there are clients, as many files as the native PUT phase wrote, on the disk of
  the servers' data: the most a durable PUT written that way can move here. When 3x RGW is more than
  that, the PUT target cannot be met on this machine by any server writing that way, and the verdicts
  say so beside the target.

The S3 servers: ``kvgw-s3`` (kvgw with fsync on by default); ``rgw``: a throwaway one-mon one-osd Ceph
cluster with radosgw (``gateway.bench.rgw``, the launcher the tests use), started in the work
directory and stopped and deleted on exit, also on Ctrl-C or SIGTERM (and its daemons die with this
process if it is SIGKILLed); ``moto``: ``moto_server``, which keeps objects in RAM.

Beside throughput and latency, each row shows the CPU milliseconds per operation used by the server
(``/proc/<pid>/stat`` over the phase; for RGW radosgw + osd + mon) and by the clients: on a host where
clients and server share the CPUs, this tells a server that is cheaper per request from one that
merely got more CPU.

Every PUT writes a new key (objects are write-once); GETs read back, round robin, the first
``--keep`` (64) keys the same target's PUT phase wrote: the rest are deleted right after the phase,
outside its timing, on every server alike. That keeps the data set (and kvgw's page cache) from growing
phase after phase: on this VM, filling page-cache pages the hypervisor has not backed recently costs
~15 ms of system time per 8 MiB, so without it every PUT phase would be slower than the one before for
a server that writes through the page cache (kvgw) and not for one that writes O_DIRECT (RGW's
bluestore), and the run order, not the servers, would decide the PUT ratios (BENCHMARKS.md).

GET phases alternate between the targets for ``--rounds`` rounds and the median round counts, so a
noisy neighbour hits every target alike. Ratios: ``/native`` to
``kvgw-native`` at the same client count; ``/rgw`` and ``/moto`` to that server with the same client
(boto3 or load generator). Every client, boto3 or load generator, is a process of its own (boto3 holds
the GIL while it signs and checksums a body), so each row measures its server, not one client process.
Servers and clients share this host's CPUs, so absolute numbers depend on the machine; compare within a
run. Exit status 1 when a target fails or a request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway.bench import rgw
from gateway.bench.baselines import raw_write_op
from gateway.bench.launcher import KvgwProcess, moto_server
from gateway.bench.loadgen import Address, LoadRequest, Op, Stats, run_load, run_ops
from gateway.bench.procstat import total_cpu_seconds

MiB = 1 << 20
ACCESS_KEY = "KVBENCHROOTACCESSKEY"
SECRET_KEY = "kvgw-bench-root-secret-key-0123456789"
MOTO_KEY = "testing"
BUCKET = "kvcache"
KVGW = "kvgw-s3"
BASELINES = ("rgw", "moto")
NATIVE = "kvgw-native loadgen"
DISK = "disk loop"
CLIENTS = ("boto3", "loadgen")


@dataclass(frozen=True)
class Server:
    """An S3 server under test: where it answers, its keys, and the processes whose CPU time is its cost."""

    name: str  # "kvgw-s3", "rgw", "moto": the first word of its rows
    url: str
    pids: tuple[int, ...]
    access_key: str
    secret_key: str

    def target(self, client: str) -> str:
        return f"{self.name} {client}"


@contextlib.contextmanager
def kvgw_server(workdir: Path, *, fsync: bool, direct: bool = False) -> Iterator[Server]:
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_FSYNC": "true" if fsync else "false", "KVGW_FS_DIRECT_WRITES": "true" if direct else "false"}
    with KvgwProcess(workdir / "kvgw-data", env=env, log_path=workdir / "kvgw.log") as server:
        assert server.proc is not None
        yield Server(KVGW, server.url, (server.proc.pid,), ACCESS_KEY, SECRET_KEY)


@contextlib.contextmanager
def moto_s3(workdir: Path) -> Iterator[Server]:
    with moto_server(workdir / "moto.log") as (port, proc):
        yield Server("moto", f"http://127.0.0.1:{port}", (proc.pid,), MOTO_KEY, MOTO_KEY)


@contextlib.contextmanager
def rgw_s3(workdir: Path) -> Iterator[Server]:
    """A Ceph cluster in ``workdir/rgw`` (the disk kvgw's data is on), killed and deleted on exit."""
    cluster = rgw.RgwCluster(workdir / "rgw", owner=os.getpid(), die_with_parent=True).start()
    try:
        print(f"  rgw: Ceph {_ceph_version()}, radosgw + 1 osd (bluestore, {cluster.directory}) + 1 mon, "
              f"ready in {cluster.startup_seconds:.1f} s", flush=True)
        pids = tuple(cluster.pids[role] for role in ("rgw", "osd", "mon"))
        yield Server("rgw", cluster.url, pids, rgw.ACCESS_KEY, rgw.SECRET_KEY)
    finally:
        cluster.stop()


def _ceph_version() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["ceph", "--version"], capture_output=True, text=True, timeout=10).stdout.split()[2]
    return "?"


def boto3_client(server: Server, clients: int = 1) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=server.url, aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key, region_name="us-east-1",
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
    server_cpu: float = 0.0  # CPU seconds the server's processes used during the phase

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
    before = total_cpu_seconds(server.pids)
    result = phase()
    result.server_cpu = total_cpu_seconds(server.pids) - before
    return result


def boto3_put(server: Server, clients: int, payload: bytes, duration: float, tag: str) -> Result:
    """Each client a process of its own (boto3 holds the GIL while it signs and checksums)."""
    size = len(payload)
    prefix = f"bench-{tag}/c{clients}/"

    def open_put(i: int) -> Op:
        client = boto3_client(server)

        def op(seq: int) -> int:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}t{i}/{seq}", Body=payload)
            return size

        return op

    stats = run_ops(open_put, clients, duration=duration, processes=True)
    return Result(server.target("boto3"), "PUT", clients, stats, _listed(server, prefix))


def _listed(server: Server, prefix: str) -> list[str]:
    """The keys the client processes wrote (they cannot hand them back; the server can)."""
    pages = boto3_client(server).get_paginator("list_objects_v2")
    return [obj["Key"] for page in pages.paginate(Bucket=BUCKET, Prefix=prefix) for obj in page.get("Contents", [])]


def boto3_get(server: Server, clients: int, keys: list[str], size: int, duration: float) -> Result:
    def open_get(i: int) -> Op:
        client = boto3_client(server)

        def op(seq: int) -> int:
            body = client.get_object(Bucket=BUCKET, Key=keys[(seq * clients + i) % len(keys)])["Body"]
            got = len(body.read())
            if got != size:
                raise RuntimeError(f"short GET: {got} of {size}")
            return got

        return op

    return Result(server.target("boto3"), "GET", clients, run_ops(open_get, clients, duration=duration, processes=True))


def native_put(kvgw: Server, clients: int, payload: bytes, duration: float) -> Result:
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    prefix = f"native/c{clients}/"

    def put_request(i: int, seq: int) -> LoadRequest:
        key = f"{prefix}t{i}/{seq}"
        return LoadRequest("PUT", f"/v1/buckets/{BUCKET}/chunks/{quote(key, safe='')}", body=payload, headers=[auth],
                           expect=(201,))

    stats = run_load(_address(kvgw.url), put_request, clients, duration=duration, processes=True)
    return Result(NATIVE, "PUT", clients, stats, _listed(kvgw, prefix))


def native_get(kvgw: Server, clients: int, keys: list[str], size: int, duration: float) -> Result:
    auth = ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")
    gets = [LoadRequest("GET", f"/v1/buckets/{BUCKET}/chunks/{quote(k, safe='')}", headers=[auth]) for k in keys]
    stats = run_load(_address(kvgw.url), lambda i, seq: gets[(seq * clients + i) % len(gets)], clients,
                     duration=duration, body_buffer_bytes=size, processes=True)
    return Result(NATIVE, "GET", clients, stats)


def disk_put(workdir: Path, clients: int, payload: bytes, count: int, *, fsync: bool, direct: bool = False) -> Result:
    """The disk's own ceiling for a PUT: ``count`` files written as the filesystem tier writes them (the
    raw loop of ``kvgw bench io``), by ``clients`` threads (the writes and fsyncs release the GIL), in
    ``workdir`` (the servers' disk); deleted after the phase, as the servers' objects are trimmed."""
    written: list[str] = []
    opener = raw_write_op(workdir / "disk-loop", memoryview(payload), fsync=fsync, written=written, direct=direct)
    try:
        stats = run_ops(opener, clients, count=count)
        stats.client_cpu = 0.0  # no client: the loop's CPU is the row's server column
    finally:
        for path in written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return Result(DISK, "PUT", clients, stats)


def _address(url: str) -> Address:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


def signed_request(server: Server, method: str, key: str, body: bytes | None, expect: tuple[int, ...], *,
                   bucket: str = BUCKET) -> LoadRequest:
    """A SigV4 (UNSIGNED-PAYLOAD) request built by botocore's signer, replayable for 15 minutes."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path = f"/{bucket}/{quote(key, safe='/~')}"
    request = AWSRequest(method=method, url=f"{server.url}{path}",
                         headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    if body is not None:
        request.headers["Content-Length"] = str(len(body))

    class UnsignedPayloadAuth(S3SigV4Auth):  # type: ignore[misc]
        def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
            return False

    UnsignedPayloadAuth(Credentials(server.access_key, server.secret_key), "s3", "us-east-1").add_auth(request)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("content-length", "host")]
    return LoadRequest(method, path, body=body, headers=headers, expect=expect)


def loadgen_put(server: Server, clients: int, payload: bytes, tag: str, count: int) -> Result:
    """``count`` PUTs (the native PUT phase's, so both write as many bytes), signed before the clock starts."""
    keys = [f"loadgen-{tag}/c{clients}/{n}" for n in range(max(count, clients * 4))]
    puts = [signed_request(server, "PUT", k, payload, (200,)) for k in keys]
    stats = run_load(_address(server.url), lambda i, seq: puts[seq], clients, count=len(puts), processes=True)
    return Result(server.target("loadgen"), "PUT", clients, stats, keys)


def loadgen_get(server: Server, clients: int, keys: list[str], size: int, duration: float) -> Result:
    gets = [signed_request(server, "GET", k, None, (200,)) for k in keys]
    stats = run_load(_address(server.url), lambda i, seq: gets[(seq * clients + i) % len(gets)], clients,
                     duration=duration, body_buffer_bytes=size, processes=True)
    return Result(server.target("loadgen"), "GET", clients, stats)


def keep_first(server: Server, result: Result, keep: int) -> Result:
    """Delete what a PUT phase wrote beyond its first ``keep`` keys (the GET phases' data set)."""
    client = boto3_client(server)
    for start in range(keep, len(result.keys), 1000):
        batch = [{"Key": key} for key in result.keys[start:start + 1000]]
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})
    result.keys = result.keys[:keep]
    return result


def median_result(rounds: list[Result]) -> Result:
    """The round with the median throughput (GET rounds alternate between targets to share the noise)."""
    ordered = sorted(rounds, key=lambda r: r.stats.bytes_per_s)
    return ordered[len(ordered) // 2]


def _client_of(target: str) -> str:
    return target.rsplit(" ", 1)[-1]


def _table(results: list[Result], baselines: list[str]) -> str:
    """One line per target: throughput, latency, errors, ratios to the native API and to each baseline
    server with the same client, and CPU milliseconds per operation used by the server and by the clients."""
    rate = {(r.target, r.op, r.clients): r.mb_per_s for r in results}

    def ratio(r: Result, reference: str | None) -> str:
        ref = rate.get((reference, r.op, r.clients)) if reference else None
        return f"{r.mb_per_s / ref:.2f}" if ref else "-"

    head = (f"{'target':<22}{'op':<5}{'clients':>8}{'MB/s':>10}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>7}"
            f"{'/native':>9}" + "".join(f"{'/' + b:>8}" for b in baselines) + f"{'srv ms/op':>11}{'cli ms/op':>11}")
    lines = [head]
    for r in sorted(results, key=lambda r: (r.op, r.clients, r.target)):
        s = r.stats
        lines.append(f"{r.target:<22}{r.op:<5}{r.clients:>8}{r.mb_per_s:>10.0f}{s.ops_per_s:>9.1f}"
                     f"{s.percentile(0.5) * 1e3:>9.1f}{s.percentile(0.99) * 1e3:>9.1f}{s.errors:>7}"
                     f"{ratio(r, NATIVE):>9}"
                     + "".join(f"{ratio(r, f'{b} {_client_of(r.target)}'):>8}" for b in baselines)
                     + f"{r.server_ms_per_op:>11.1f}{r.client_ms_per_op:>11.1f}")
        for sample in s.error_samples[:2]:
            lines.append(f"    error: {sample}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    numerator: str
    denominator: str
    op: str
    need: float
    text: str
    counts: bool = True  # False: printed beside the targets, not one of them ("informative")


def targets(baselines: list[str]) -> list[Target]:
    """kvgw-s3 >= 3x each baseline on PUT and GET with either client (issue 14 item 5 for RGW; for
    moto, the boto3 PUT an earlier issue set, the rest informative), and S3 GET >= 90% of native."""
    found = [Target(f"{KVGW} loadgen", NATIVE, "GET", 0.90, "S3 GET >= 90% of the native API (same client)")]
    for base in baselines:
        for op in ("PUT", "GET"):
            for client in CLIENTS:
                found.append(Target(f"{KVGW} {client}", f"{base} {client}", op, 3.0,
                                    f"S3 {op} >= 3x {base} ({client} both)",
                                    counts=base == "rgw" or (client, op) == ("boto3", "PUT")))
    return found


def _verdicts(results: list[Result], clients_list: list[int], baselines: list[str],
              unavailable: dict[str, str]) -> tuple[str, bool]:
    rate = {(r.target, r.op, r.clients): r.mb_per_s for r in results}
    lines, ok = ["targets:"], True
    for t in targets(baselines):
        for clients in clients_list:
            a, b = rate.get((t.numerator, t.op, clients)), rate.get((t.denominator, t.op, clients))
            if not a or not b:
                lines.append(f"  {t.text:<44} {clients} client(s): n/a")
                ok = ok and not t.counts
                continue
            verdict = "PASS" if a / b >= t.need else "FAIL"
            if t.counts:
                ok = ok and verdict == "PASS"
            else:
                verdict += " (informative)"
            lines.append(_ratio_line(t.text, clients, a, b, verdict))
    for base, why in unavailable.items():
        lines.append(f"  S3 PUT/GET >= 3x {base:<26} n/a: {base.upper()} NOT MEASURED ({why})")
    lines.extend(_disk_ceiling(rate, clients_list, baselines))
    return "\n".join(lines), ok


def _disk_ceiling(rate: dict[tuple[str, str, int], float], clients_list: list[int],
                  baselines: list[str]) -> list[str]:
    """Each S3 PUT target beside the disk loop's rate (the most a durable PUT moves here): kvgw's share
    of it, and whether 3x the baseline is beyond it (then no server writing through the page cache
    meets that target on this machine)."""
    lines: list[str] = []
    for clients in clients_list:
        disk = rate.get((DISK, "PUT", clients))
        if not disk:
            continue
        kvgw = rate.get((f"{KVGW} loadgen", "PUT", clients))
        if kvgw:
            lines.append(_ratio_line("S3 PUT (loadgen) / the disk loop", clients, kvgw, disk, "(informative)"))
        for base in baselines:
            for client in CLIENTS:
                other = rate.get((f"{base} {client}", "PUT", clients))
                if other:
                    need = 3 * other
                    lines.append(_ratio_line(f"3x {base} PUT ({client}) / the disk loop", clients, need, disk,
                                               "beyond the disk: unreachable here" if need > disk
                                               else "within the disk"))
    return lines


def _ratio_line(text: str, clients: int, a: float, b: float, verdict: str) -> str:
    """One line of the verdicts: ``a / b`` at ``clients`` and what it means."""
    return f"  {text:<44} {clients} client(s): {a:7.0f} / {b:<7.0f} = {a / b:5.2f}  {verdict}"


def _baselines(against: str | None) -> tuple[list[str], dict[str, str]]:
    """The baseline servers to run, and those left out with the reason (RGW, by default, when Ceph is
    not installed). Raises SystemExit when one asked for by name cannot run."""
    missing = rgw.missing_commands()
    if against is None:
        if missing:
            return ["moto"], {"rgw": f"Ceph not installed: {', '.join(missing)} missing; run .ci/install-rgw.sh"}
        return list(BASELINES), {}
    chosen = [b.strip() for b in against.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown:
        raise SystemExit(f"kvgw bench s3: --against: unknown {', '.join(unknown)} (choose from {', '.join(BASELINES)})")
    if "rgw" in chosen and missing:
        raise SystemExit(f"kvgw bench s3: --against rgw, but Ceph is not installed ({', '.join(missing)} missing; "
                         "run .ci/install-rgw.sh)")
    return chosen, {}


def _raise_on_sigterm() -> None:
    """SIGTERM (and SIGHUP) unwind like Ctrl-C, so every server, RGW's cluster above all, is stopped and its
    directory deleted by the ``with`` blocks that started it."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench s3", description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--size-mib", type=float, default=8.0, help="object size (default 8 MiB)")
    parser.add_argument("--clients", default="1,8", help="client counts (default 1,8)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating GET rounds; the median counts (default 3)")
    parser.add_argument("--keep", type=int, default=64, help="objects of each PUT phase kept for the GET phases; "
                                                              "the rest are deleted after the phase (default 64)")
    parser.add_argument("--no-fsync", action="store_true", help="run kvgw without fsync (default: fsync on)")
    parser.add_argument("--direct-writes", action="store_true",
                        help="run kvgw with KVGW_FS_DIRECT_WRITES (and the disk loop writing the same way)")
    parser.add_argument("--against", help="baseline S3 servers, comma-separated: rgw, moto (default: both, or "
                                          "moto alone when Ceph RGW is not installed)")
    parser.add_argument("--workdir", type=Path, help="where servers keep data (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    baselines, unavailable = _baselines(args.against)
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    payload = os.urandom(int(args.size_mib * MiB))
    results: list[Result] = []
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgw-bench-s3-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tags = (f"r{n}" for n in itertools.count())
    print(f"kvgw bench s3: {len(payload) / MiB:g} MiB objects, clients {clients_list}, {args.duration:g} s per "
          f"phase, {args.rounds} GET rounds, kvgw fsync {'off' if args.no_fsync else 'on'}"
          f"{', direct writes' if args.direct_writes else ''}, against "
          f"{', '.join(baselines)}, {os.cpu_count()} CPUs, workdir {workdir}", flush=True)
    for base, why in unavailable.items():
        print(f"  {base}: NOT AVAILABLE ({why}): no {base} rows, its targets are not measured", flush=True)
    _raise_on_sigterm()
    starts = {"rgw": rgw_s3, "moto": moto_s3}
    try:
        with contextlib.ExitStack() as stack:
            kvgw = stack.enter_context(kvgw_server(workdir, fsync=not args.no_fsync, direct=args.direct_writes))
            others = [stack.enter_context(starts[b](workdir)) for b in baselines]
            for server in others:
                boto3_client(server).create_bucket(Bucket=BUCKET)
            results = _run(kvgw, others, clients_list, payload, args.duration, args.rounds, args.keep, tags,
                           workdir=workdir, fsync=not args.no_fsync, direct=args.direct_writes)
    except KeyboardInterrupt as exc:
        print(f"kvgw bench s3: interrupted ({exc or 'Ctrl-C'}); servers stopped", file=sys.stderr)
        return 130
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(_table(results, baselines))
    verdicts, ok = _verdicts(results, clients_list, baselines, unavailable)
    print()
    print(verdicts)
    errors = sum(r.stats.errors for r in results)
    return 0 if ok and errors == 0 else 1


def _run(kvgw: Server, others: list[Server], clients_list: list[int], payload: bytes, duration: float, rounds: int,
         keep: int, tags: Iterator[str], *, workdir: Path, fsync: bool, direct: bool = False) -> list[Result]:
    """Every phase: per client count, the PUTs (native, the disk loop, then boto3 and the load generator
    on each S3 server; each phase's objects trimmed to ``keep`` after it), then ``rounds`` alternating
    rounds of every GET, the median round of each kept."""
    results: list[Result] = []
    size = len(payload)
    s3_servers = [kvgw, *others]
    for clients in clients_list:
        print(f"  PUT, {clients} client(s): native, then boto3 and loadgen on "
              f"{', '.join(s.name for s in s3_servers)}", flush=True)
        os.sync()
        native = on_server(kvgw, functools.partial(native_put, kvgw, clients, payload, duration))
        native_ops = native.stats.ops
        keep_first(kvgw, native, keep)
        results.append(native)
        os.sync()
        loop = Server(DISK, "", (os.getpid(),), "", "")  # its CPU: this process's threads
        results.append(on_server(loop, functools.partial(disk_put, workdir, clients, payload, native_ops,
                                                         fsync=fsync, direct=direct)))
        puts: dict[str, Result] = {}
        for server in s3_servers:
            for put in (functools.partial(boto3_put, server, clients, payload, duration, next(tags)),
                        functools.partial(loadgen_put, server, clients, payload, next(tags), native_ops)):
                os.sync()  # each PUT phase starts with no other phase's dirty pages to write back
                result = keep_first(server, on_server(server, put), keep)
                puts[result.target] = result
                results.append(result)
        os.sync()
        print(f"  GET, {clients} client(s): {rounds} alternating rounds", flush=True)
        phases: list[tuple[Server, Callable[[], Result]]] = [
            (kvgw, functools.partial(native_get, kvgw, clients, native.keys, size, duration))]
        for server in s3_servers:
            for client, get in (("boto3", boto3_get), ("loadgen", loadgen_get)):
                keys = puts[server.target(client)].keys
                if keys:
                    phases.append((server, functools.partial(get, server, clients, keys, size, duration)))
        by_target: dict[str, list[Result]] = {}
        for _ in range(rounds):
            for server, phase in phases:
                result = on_server(server, phase)
                by_target.setdefault(result.target, []).append(result)
        results.extend(median_result(r) for r in by_target.values())
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
