"""``kvgw bench head``: the HEAD rate a lookup-heavy S3 client gets from kvgw, beside a baseline measured in
the same run with the same load generator.

vLLM's object-store tier (docs/vllm.md) looks every block up with one S3 HEAD, hits
and misses alike, many workers at once. This measures exactly that request, at ``--clients`` concurrent
clients (default 8 and 64; each client one keep-alive connection, in a process of its own):

- ``kvgw S3 HEAD hit`` / ``kvgw S3 HEAD miss``: HeadObject of vLLM-named objects (``gateway.bench.vllm_obj``)
  in a bucket of ``--objects`` chunks, SigV4-signed as aws-sdk-cpp signs them (header auth, the empty
  payload's SHA-256), path-style; misses are keys never stored (404). Each request is signed once, up
  front, and replayed (within SigV4's 15 minutes): kvgw still checks every signature;
- ``kvgw native HEAD hit``: the same chunks through the native API (bearer credentials);
- ``FastAPI dict route`` (baseline): a plain FastAPI app under uvicorn (uvloop + httptools, one process,
  like kvgw) whose ``HEAD /items/{key}`` answers a size and an ETag from a dict, the least a Python
  gateway can do per HEAD (``gateway.bench.baselines``);
- ``nginx static HEAD`` (reference, when nginx is installed): nginx answering HEAD of a small file;
- ``NIXL query_memory`` (with ``--nixl`` and NIXL installed): vLLM's own lookup call, batches of 64 keys
  from one agent with ``io_threads`` 4, counted in HEADs per second.

The machine may be shared and noisy: every target runs ``--rounds`` rounds, in an order alternating
between rounds, and the report gives the median round. Server CPU per 1,000 HEADs (``/proc/<pid>/stat``
over the phase) tells a server that is cheaper per request from one that merely got more CPU. Clients
and servers share this machine's cores, so compare within a run. Exit status 1 when a request failed.

``--instructions N`` measures instead what such noise cannot move: each server (kvgw with the lane on
and off, the FastAPI route) runs under valgrind's callgrind and the report gives the instructions it
executes per HEAD over N HEADs on one connection, net of what it runs idle in as much time (its timers
and background threads, which callgrind's slowdown would charge to the HEADs; ``gateway.bench.callgrind``):
the way to compare two builds' per-request cost on this VM.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from gateway.bench import callgrind
from gateway.bench.baselines import FastAPIApp, Nginx, RawResponder, find_nginx, item_keys
from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import Address, LoadRequest, Stats, run_load
from gateway.bench.procstat import total_cpu_seconds
from gateway.bench.vllm_obj import KeyForm, stored_name

ACCESS_KEY = "KVBENCHHEADACCESSKEY"
SECRET_KEY = "kvgw-bench-head-secret-key-0123456789"
BUCKET = "vllm-kv"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
OBJECT_BYTES = 4096  # a HEAD never reads the body; the size only has to be realistic for the index

KVGW_HIT = "kvgw S3 HEAD hit"
KVGW_MISS = "kvgw S3 HEAD miss"
KVGW_NATIVE = "kvgw native HEAD hit"
NO_LANE = ", lane off"
FASTAPI = "FastAPI dict route"
NGINX = "nginx static HEAD"
RAW = "raw-socket responder (floor)"
NIXL = "NIXL query_memory"
BASELINE = FASTAPI


@dataclass
class Result:
    target: str
    clients: int
    stats: Stats
    server_cpu: float | None  # CPU seconds of the serving process(es) during the phase

    @property
    def rate(self) -> float:
        return self.stats.ops_per_s

    @property
    def cpu_ms_per_1000(self) -> float | None:
        if self.server_cpu is None or not self.stats.ops:
            return None
        return self.server_cpu * 1e6 / self.stats.ops


@dataclass
class Target:
    name: str
    pids: Callable[[], list[int]]
    run: Callable[[int, float], Stats]  # (clients, duration) -> Stats
    rounds: dict[int, list[Result]] = field(default_factory=dict)

    def measure(self, clients: int, duration: float) -> Result:
        pids = self.pids()
        before = total_cpu_seconds(pids) if pids else 0.0
        stats = self.run(clients, duration)
        cpu = total_cpu_seconds(pids) - before if pids else None
        result = Result(self.name, clients, stats, cpu)
        self.rounds.setdefault(clients, []).append(result)
        return result

    def median(self, clients: int) -> Result | None:
        rounds = sorted(self.rounds.get(clients, []), key=lambda r: r.rate)
        return rounds[len(rounds) // 2] if rounds else None


def signed_head(address: Address, bucket: str, key: str, expect: tuple[int, ...]) -> LoadRequest:
    """HeadObject signed with SigV4 in the Authorization header, as aws-sdk-cpp sends it."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    path = f"/{bucket}/{quote(key, safe='/~')}"
    host = f"{address[0]}:{address[1]}"
    request = AWSRequest(method="HEAD", url=f"http://{host}{path}", headers={"x-amz-content-sha256": EMPTY_SHA256})
    S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "s3", "us-east-1").add_auth(request)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
    return LoadRequest("HEAD", path, headers=headers, expect=expect)


def cycling(requests: Sequence[LoadRequest]) -> Callable[[int, int], LoadRequest]:
    n = len(requests)
    return lambda i, seq: requests[(i * 7919 + seq) % n]


def load(address: Address, requests: Sequence[LoadRequest]) -> Callable[[int, float], Stats]:
    make = cycling(requests)
    return lambda clients, duration: run_load(address, make, clients, duration=duration, processes=True,
                                              body_buffer_bytes=64 * 1024)


# Under callgrind (30-60x slower) a gateway's clock-driven work (catalog refresh, the cluster's feed
# polls, heartbeats and usage reads, lifecycle passes) ran 38-230k instructions per HEAD, more than
# a native HEAD itself, and moved ±30% between runs: subtracted as idle work, it left the per-HEAD
# counts ±10% apart. These clocks tick every 10 minutes instead there, so the counts are the HEADs'.
QUIET_CLOCKS = {f"KVGW_{name}": "600" for name in (
    "CATALOG_REFRESH_SECONDS", "LIFECYCLE_INTERVAL", "CLUSTER_POLL_SECONDS", "CLUSTER_HEARTBEAT_SECONDS",
    "CLUSTER_USAGE_REFRESH_SECONDS", "CLUSTER_READ_FLUSH_SECONDS")} | {
    "KVGW_LIFECYCLE_LEASE_SECONDS": "3000", "KVGW_CLUSTER_MEMBER_TIMEOUT_SECONDS": "3000",
    "KVGW_LOOP_STALL_SECONDS": "0"}  # no event-loop watch: its 4 wakeups a second, and 30-60x slower callbacks


@contextlib.contextmanager
def kvgw_server(workdir: Path, *, name: str = "kvgw", lane: bool = True,
                wrapper: Sequence[str] = ()) -> Iterator[KvgwProcess]:
    """A gateway on its defaults, with the bench's root credentials; ``lane=False``: the lookup lane
    off (``KVGW_LOOKUP_LANE``), every HEAD through uvicorn's request cycle. Under a ``wrapper``
    (callgrind), with ``QUIET_CLOCKS``."""
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_LOOKUP_LANE": str(lane).lower(), **(QUIET_CLOCKS if wrapper else {})}
    with KvgwProcess(workdir / f"{name}-data", env=env, inherit_kvgw_env=False,
                     log_path=workdir / f"{name}.log", wrapper=list(wrapper)) as server:
        yield server


def bearer() -> tuple[str, str]:
    """The native API's credentials: the bench's root key."""
    return ("Authorization", f"Bearer {ACCESS_KEY}:{SECRET_KEY}")


def native_target(key: str) -> str:
    return f"/v1/buckets/{BUCKET}/chunks/{quote(key, safe='')}"


def preload(server: KvgwProcess, keys: Sequence[str]) -> None:
    """The bucket (through the S3 API) and one object per key (through the native API)."""
    create_bucket(server)
    payload = os.urandom(OBJECT_BYTES)
    puts = [LoadRequest("PUT", native_target(k), body=payload, headers=[bearer()], expect=(201,)) for k in keys]
    done = run_load(server.address, lambda i, seq: puts[seq], 4, count=len(puts))
    if done.errors:
        raise RuntimeError(f"preload: {done.errors} PUTs failed, e.g. {done.error_samples[:2]}")


def create_bucket(server: KvgwProcess) -> None:
    """The bucket, through the S3 API (CreateBucket, root credentials)."""
    import boto3

    boto3.client("s3", endpoint_url=server.url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)


def nixl_target(server: KvgwProcess, keys: list[str], batch: int = 64) -> Target | str:
    """vLLM's lookup call itself, or why it cannot run."""
    try:
        from gateway.bench.vllm_obj import ObjTier
    except ImportError as exc:  # pragma: no cover - vllm_obj imports nothing optional
        return str(exc)
    config = {"bucket": BUCKET, "endpoint_override": f"127.0.0.1:{server.port}", "scheme": "http",
              "region": "us-east-1", "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}
    try:
        tier = ObjTier(config, block_bytes=4096, blocks=1, io_threads=4)
    except Exception as exc:
        return f"NIXL unavailable: {type(exc).__name__}: {exc}"
    batches = [keys[i : i + batch] for i in range(0, len(keys) - batch + 1, batch)] or [keys]

    def run(clients: int, duration: float) -> Stats:
        stats = Stats(clients=1)
        start = time.perf_counter()
        deadline = start + duration
        n = 0
        while time.perf_counter() < deadline:
            keys_now = batches[n % len(batches)]
            t = time.perf_counter()
            found = tier.lookup(keys_now)
            stats.latencies.append(time.perf_counter() - t)
            if all(found):
                stats.ops += len(keys_now)
            else:
                stats.errors += 1
            n += 1
        stats.elapsed = stats.window = time.perf_counter() - start
        stats.window_ops = float(stats.ops)
        return stats

    return Target(f"{NIXL} ({batch} keys, 4 threads)", lambda: [server.pids()[0]], run)


def report(targets: list[Target], clients_list: Sequence[int]) -> tuple[str, int]:
    lines = [f"{'target':<40}{'clients':>8}{'HEAD/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}"
             f"{'srv CPU ms/1000':>17}{'/ FastAPI':>11}"]
    errors = 0
    for clients in clients_list:
        base = next((t.median(clients) for t in targets if t.name == BASELINE), None)
        for t in targets:
            r = t.median(clients)
            if r is None:
                continue
            errors += sum(x.stats.errors for x in t.rounds.get(clients, []))
            ratio = f"{r.rate / base.rate:.2f}" if base is not None and base.rate and t.name != NIXL else "-"
            cpu = "-" if r.cpu_ms_per_1000 is None else f"{r.cpu_ms_per_1000:.0f}"
            shown = "(batched)" if t.name.startswith(NIXL) else str(clients)
            lines.append(f"{t.name:<40}{shown:>8}{r.rate:>10.0f}{r.stats.percentile(0.5) * 1e3:>9.2f}"
                         f"{r.stats.percentile(0.99) * 1e3:>9.2f}{r.stats.errors:>8}{cpu:>17}{ratio:>11}")
            for sample in r.stats.error_samples[:2]:
                lines.append(f"    error: {sample}")
    return "\n".join(lines), errors


# -- instructions per HEAD (callgrind) -------------------------------------------------------------------

def instruction_counts(workdir: Path, hits: Sequence[str], misses: Sequence[str],
                       count: int) -> list[tuple[str, callgrind.Counted]]:
    """(target, instructions per HEAD) of each server run under callgrind: kvgw with its lookup lane on
    (S3 HEAD hit and miss, native HEAD) and off (S3 HEAD hit and miss), the FastAPI route, and the
    raw-socket responder (``serve_raw``: the socket, uvloop and a few lines of Python finding the
    request's end: the floor of any Python HTTP server here)."""
    if not callgrind.available():
        raise SystemExit("kvgw bench head --instructions needs valgrind (callgrind_control) on PATH")
    print(f"kvgw bench head --instructions {count}: {len(hits)} objects; each server under callgrind", flush=True)
    rows: list[tuple[str, callgrind.Counted]] = []
    for lane in (True, False):
        name = "kvgw" if lane else "kvgw-no-lane"
        out = workdir / f"{name}.callgrind"
        with kvgw_server(workdir, name=name, lane=lane, wrapper=callgrind.wrapper(out)) as server:
            preload(server, hits)
            kinds = [(KVGW_HIT, [signed_head(server.address, BUCKET, k, (200,)) for k in hits]),
                     (KVGW_MISS, [signed_head(server.address, BUCKET, k, (404,)) for k in misses])]
            if lane:
                kinds.append((KVGW_NATIVE, [LoadRequest("HEAD", native_target(k), headers=[bearer()]) for k in hits]))
            assert server.proc is not None
            for target, requests in kinds:
                sender = callgrind.Sender(server.address, requests)
                try:
                    rows.append((target + ("" if lane else NO_LANE),
                                 callgrind.instructions_per_request(server.proc.pid, out, sender, count)))
                finally:
                    sender.close()
                print(f"  {rows[-1][0]}: {rows[-1][1].per_request:,.0f}", flush=True)
    items = [LoadRequest("HEAD", f"/items/{k}") for k in item_keys(len(hits))]
    for target, make in ((FASTAPI, lambda out: FastAPIApp(workdir / "fastapi", len(hits), OBJECT_BYTES,
                                                         wrapper=callgrind.wrapper(out))),
                         (RAW, lambda out: RawResponder(workdir / "raw", {}, wrapper=callgrind.wrapper(out)))):
        out = workdir / f"{target.split()[0]}.callgrind"
        baseline = make(out).start()
        sender = callgrind.Sender(baseline.address, items)
        try:
            assert baseline.proc is not None
            rows.append((target, callgrind.instructions_per_request(baseline.proc.pid, out, sender, count)))
        finally:
            sender.close()
            baseline.stop()
        print(f"  {rows[-1][0]}: {rows[-1][1].per_request:,.0f}", flush=True)
    return rows


def report_instructions(rows: Sequence[tuple[str, callgrind.Counted]]) -> int:
    """The table: instructions per HEAD, and the FastAPI route's count over each (higher: cheaper), with
    the clock-driven work subtracted from each (``callgrind.instructions_per_request``)."""
    base = dict(rows)[FASTAPI].per_request
    print(f"\n{'target':40s} {'instructions/HEAD':>18s} {'FastAPI / target':>17s} {'idle, subtracted':>17s}")
    for target, counted in rows:
        print(f"{target:40s} {counted.per_request:18,.0f} {base / counted.per_request:17.2f} "
              f"{counted.background:17,.0f}")
    return 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench head", description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--clients", default="8,64", help="concurrent clients, each a process (default 8,64)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per phase (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median counts (default 3)")
    parser.add_argument("--objects", type=int, default=1024, help="objects in the bucket (default 1024)")
    parser.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=True,
                        help="also time NIXL's query_memory (vLLM's lookup call) when NIXL is installed")
    parser.add_argument("--workdir", type=Path, help="where the servers keep data (default: a temp dir, removed)")
    parser.add_argument("--instructions", type=int, default=0, metavar="N",
                        help="instead of rates: each server's instructions per HEAD over N HEADs on one connection, "
                             "counted by valgrind's callgrind (gateway.bench.callgrind; a few minutes)")
    args = parser.parse_args(list(argv))
    clients_list = [int(c) for c in args.clients.split(",") if c.strip()]
    if not clients_list or min(clients_list) < 1 or args.rounds < 1 or args.duration <= 0 or args.objects < 1:
        print("kvgw bench head: need clients >= 1, rounds >= 1, a positive duration and objects", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgw-bench-head-"))
    workdir.mkdir(parents=True, exist_ok=True)
    form = KeyForm()
    hits = [stored_name(form.object_key(i.to_bytes(32, "big"))) for i in range(args.objects)]
    misses = [stored_name(form.object_key(((1 << 255) + i).to_bytes(32, "big"))) for i in range(args.objects)]
    if args.instructions > 0:
        try:
            return report_instructions(instruction_counts(workdir, hits[:64], misses[:64], args.instructions))
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    print(f"kvgw bench head: clients {clients_list}, {args.rounds} rounds of {args.duration:g} s, {args.objects} "
          f"objects, {os.cpu_count()} CPUs ({platform.machine()}), load {os.getloadavg()[0]:.2f}, workdir {workdir}",
          flush=True)
    try:
        with contextlib.ExitStack() as stack:
            kvgw = stack.enter_context(kvgw_server(workdir))
            no_lane = stack.enter_context(kvgw_server(workdir, name="kvgw-no-lane", lane=False))
            for gateway in (kvgw, no_lane):
                preload(gateway, hits)
            payload = os.urandom(OBJECT_BYTES)
            fastapi = FastAPIApp(workdir / "fastapi", args.objects, OBJECT_BYTES).start()
            stack.callback(fastapi.stop)
            server_pid = lambda: kvgw.pids()  # noqa: E731
            targets = [
                Target(KVGW_HIT, server_pid, load(kvgw.address, [signed_head(kvgw.address, BUCKET, k, (200,))
                                                                 for k in hits])),
                Target(KVGW_MISS, server_pid, load(kvgw.address, [signed_head(kvgw.address, BUCKET, k, (404,))
                                                                  for k in misses])),
                Target(KVGW_HIT + NO_LANE, no_lane.pids, load(no_lane.address, [
                    signed_head(no_lane.address, BUCKET, k, (200,)) for k in hits])),
                Target(KVGW_MISS + NO_LANE, no_lane.pids, load(no_lane.address, [
                    signed_head(no_lane.address, BUCKET, k, (404,)) for k in misses])),
                Target(KVGW_NATIVE, server_pid, load(kvgw.address, [
                    LoadRequest("HEAD", native_target(k), headers=[bearer()]) for k in hits])),
                Target(FASTAPI, fastapi.pids, load(fastapi.address, [LoadRequest("HEAD", f"/items/{k}")
                                                                     for k in item_keys(args.objects)])),
            ]
            nginx_bin = find_nginx()
            if nginx_bin is not None:
                www = workdir / "www"
                www.mkdir(exist_ok=True)
                (www / "probe").write_bytes(b"ok")
                for i in range(64):
                    (www / f"o{i}").write_bytes(payload)
                nginx = Nginx(nginx_bin, www, workdir / "nginx").start("/probe")
                stack.callback(nginx.stop)
                targets.append(Target(NGINX, nginx.pids, load(nginx.address, [LoadRequest("HEAD", f"/o{i}")
                                                                              for i in range(64)])))
            else:
                print("  (nginx is not installed: no nginx reference row)", flush=True)
            for rnd in range(args.rounds):
                order = targets if rnd % 2 == 0 else list(reversed(targets))
                for clients in clients_list:
                    for target in order:
                        target.measure(clients, args.duration)
                print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
            # NIXL last: its agent runs C++ threads, and the load generator forks its clients, which must
            # not inherit locks those threads hold.
            if args.nixl:
                made = nixl_target(kvgw, hits)
                if isinstance(made, Target):  # one agent, its own concurrency: reported under the first count
                    for _ in range(args.rounds):
                        made.measure(clients_list[0], args.duration)
                    targets.append(made)
                else:
                    print(f"  (no NIXL row: {made})", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text, errors = report(targets, clients_list)
    print()
    print(text)
    print()
    for clients in clients_list:
        hit = next(t.median(clients) for t in targets if t.name == KVGW_HIT)
        base = next(t.median(clients) for t in targets if t.name == BASELINE)
        if hit is not None and base is not None and base.rate:
            print(f"{clients} clients: kvgw S3 HEAD (hit) {hit.rate:.0f}/s = {hit.rate / base.rate:.2f}x the FastAPI "
                  f"dict route ({base.rate:.0f}/s), measured alternately in the same run")
        for name in (KVGW_HIT, KVGW_MISS):
            on = next(t.median(clients) for t in targets if t.name == name)
            off = next(t.median(clients) for t in targets if t.name == name + NO_LANE)
            if on is not None and off is not None and off.rate:
                print(f"{clients} clients: {name} with the lookup lane / without: {on.rate / off.rate:.2f}x the rate")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
