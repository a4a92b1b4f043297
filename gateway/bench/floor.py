"""``kvgw bench floor``: where a small call's server time goes (issue 14, item 1).

The same 64-key ``exists`` call (and a native HEAD) is sent, one keep-alive connection, alternating
rounds, to three servers, and the server process's CPU per call is read from ``/proc`` over each
round:

- ``raw-socket responder`` (``gateway.bench.baselines.serve_raw``): finds the end of the request and
  writes canned bytes: the socket's own cost, the floor for any HTTP server here;
- ``raw-socket + kvgw's index``: the same responder answering ``exists`` from the kvgw gateway's own
  LMDB index (opened read-only), by the same code as kvgw's lookup lane (key digests, the gets, the
  expiry checks) plus a JSON parse and dump: the floor of a lookup answered from this index, with no
  HTTP parsing, authentication, routing or metrics around it;
- ``kvgw server + canned ASGI``: kvgw's HTTP server (``gateway.dataplane``: httptools' parser, one
  write per small answer, the connection guards) running an ASGI app that reads the body and sends the
  same canned answer: what a request cycle costs above the socket;
- ``kvgw``: the real gateway (the chunks present): what kvgw's own work costs above that; its
  lookups are answered by the lookup lane (``gateway.dataplane.lane``), inside the protocol;
- ``kvgw, lane off``: the same gateway with ``KVGW_LOOKUP_LANE=false``, every call through the
  request cycle and the ASGI app: what the lane saves, in the same rounds;
- ``kvgw client``: the same ``exists`` through kvgw's own client (``KvgwClient.blocking.exists``, from
  a plain thread, as LMCache's lookups and vLLM's tier ask): what an engine waits for, with the client's
  own CPU per call (this process: the calling thread and the client's I/O thread).

Then the gateway's ASGI app, and its lookup lane's answer, are driven in this process with no socket
at all (uvloop, a bucket of the same chunks): the microseconds of Python each call costs by itself.
The differences say which layer a microsecond belongs to; the report prints them. Medians of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.api.http import Message, Receive, Scope, Send
from gateway.bench.baselines import BaselineProcess, RawResponder, http_ok
from gateway.bench.io import BUCKET, META_CHUNK_BYTES, META_KEYS, chunk_target, kvgw_server, lookup_answers
from gateway.bench.launcher import wait_until
from gateway.bench.loadgen import Address, LoadRequest, request_once, run_load
from gateway.bench.procstat import total_cpu_seconds

RAW = "raw-socket responder"
INDEXED = "raw-socket + kvgw's index"
CANNED = "server + canned ASGI"
KVGW = "kvgw"
KVGW_NO_LANE = "kvgw, lane off"
KVGW_CLIENT = "kvgw client"
EXISTS = f"exists {META_KEYS} keys"
HEAD = "HEAD"


def lookup_keys() -> list[str]:
    return [f"floor-{i:04d}-{'ab' * 12}" for i in range(META_KEYS)]


def exists_body() -> bytes:
    return b'{"keys":[' + b",".join(b'"%s"' % k.encode() for k in lookup_keys()) + b"]}"


# -- the canned ASGI server ----------------------------------------------------------------------------

def serve_canned(port: int) -> None:
    """kvgw's HTTP server (``gateway.dataplane``, no lane) and an ASGI app answering ``lookup_answers()``
    (HEAD: empty): what the request cycle costs."""
    from gateway.dataplane.limits import ConnectionLimits
    from gateway.dataplane.server import HttpServer, ServerState, run
    from gateway.serve import listen

    answers = [(part.encode(), body) for part, body in lookup_answers().items()]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        path: bytes = scope["raw_path"]
        body = b"" if scope["method"] == "HEAD" else next((b for part, b in answers if part in path), b"ok")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    run(HttpServer(ServerState(app, ConnectionLimits())), listen("127.0.0.1", port))


class CannedAsgi(BaselineProcess):
    name = "canned-asgi"

    def start(self) -> CannedAsgi:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway.bench.floor", "--serve-canned",
                                          str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_until(lambda: http_ok(self.address, "/probe"), self.proc, self.name, self.log)
        return self


# -- over the socket -----------------------------------------------------------------------------------

@dataclass
class Round:
    p50_us: float
    cpu_us: float  # server CPU per call
    client_cpu_us: float | None = None  # the caller's CPU per call (kvgw's client only)


def measure(address: Address, pids: list[int], request: LoadRequest, duration: float) -> Round:
    before = total_cpu_seconds(pids)
    stats = run_load(address, lambda i, seq: request, 1, duration=duration)
    if stats.errors or not stats.ops:
        raise RuntimeError(f"{request.method} {request.target} to {address}: {stats.errors} errors, "
                           f"{stats.error_samples[:2]}")
    return Round(stats.percentile(0.5) * 1e6, (total_cpu_seconds(pids) - before) / stats.ops * 1e6)


def measure_client(url: str, pids: list[int], duration: float) -> Round:
    """``exists`` of the lookup keys through ``KvgwClient.blocking`` for ``duration`` seconds."""
    from kvgw_client.config import ClientSettings
    from kvgw_client.http import KvgwClient

    keys = lookup_keys()
    client = KvgwClient(ClientSettings(url=url, bucket=BUCKET))
    try:
        if not all(client.blocking.exists(keys)):  # the connection opened before the clock starts
            raise RuntimeError("kvgw client: the lookup keys are not all present")
        latencies: list[float] = []
        server0, client0 = total_cpu_seconds(pids), time.process_time()
        end = time.perf_counter() + duration
        while (started := time.perf_counter()) < end:
            client.blocking.exists(keys)
            latencies.append(time.perf_counter() - started)
        calls = len(latencies)
        return Round(statistics.median(latencies) * 1e6, (total_cpu_seconds(pids) - server0) / calls * 1e6,
                     (time.process_time() - client0) / calls * 1e6)
    finally:
        client.close()


def requests() -> dict[str, LoadRequest]:
    return {EXISTS: LoadRequest("POST", f"/v1/buckets/{BUCKET}/exists", body=exists_body(),
                                headers=[("Content-Type", "application/json")]),
            HEAD: LoadRequest("HEAD", chunk_target(lookup_keys()[0]))}


def over_the_socket(workdir: Path, rounds: int, duration: float) -> dict[tuple[str, str], list[Round]]:
    kvgw = kvgw_server(workdir / "kvgw-data").start()
    no_lane = kvgw_server(workdir / "kvgw-no-lane-data", env={"KVGW_LOOKUP_LANE": "false"}).start()
    raw = RawResponder(workdir, lookup_answers()).start()
    canned = CannedAsgi(workdir).start()
    indexed: RawResponder | None = None
    try:
        for gateway in (kvgw, no_lane):
            for key in lookup_keys():
                status, answer = request_once(gateway.address, LoadRequest(
                    "PUT", chunk_target(key), body=b"f" * META_CHUNK_BYTES, expect=(200, 201)))
                if status not in (200, 201):
                    raise RuntimeError(f"preload PUT {key}: {status} {answer[:200]!r}")
        indexed = RawResponder(workdir / "indexed", {}, index=(workdir / "kvgw-data" / "index", BUCKET)).start()
        status, answer = request_once(indexed.address, requests()[EXISTS])
        if (status, answer) != (200, lookup_answers()["/exists"]):
            raise RuntimeError(f"the indexed responder answered {status} {answer[:200]!r}")
        servers: list[tuple[str, Address, list[int], tuple[str, ...]]] = [
            (RAW, raw.address, raw.pids(), (EXISTS, HEAD)), (INDEXED, indexed.address, indexed.pids(), (EXISTS,)),
            (CANNED, canned.address, canned.pids(), (EXISTS, HEAD)), (KVGW, kvgw.address, kvgw.pids(), (EXISTS, HEAD)),
            (KVGW_NO_LANE, no_lane.address, no_lane.pids(), (EXISTS, HEAD))]
        out: dict[tuple[str, str], list[Round]] = {}
        for rnd in range(rounds):
            for name, address, pids, ops in servers if rnd % 2 == 0 else servers[::-1]:
                for op in ops:
                    out.setdefault((name, op), []).append(measure(address, pids, requests()[op], duration))
                if name == KVGW:
                    url = f"http://{address[0]}:{address[1]}"
                    out.setdefault((KVGW_CLIENT, EXISTS), []).append(measure_client(url, pids, duration))
            print(f"  round {rnd + 1}/{rounds} done", file=sys.stderr, flush=True)
        return out
    finally:
        for server in (canned, raw, indexed):
            if server is not None:
                server.stop()
        no_lane.stop()
        kvgw.stop()


# -- in process ----------------------------------------------------------------------------------------

def in_process(workdir: Path, calls: int) -> dict[str, float]:
    """Microseconds per call of the gateway's ASGI app driven directly (uvloop, no socket), and of its
    lookup lane's answer (``<op> lane``)."""
    import uvloop

    return uvloop.run(_in_process(workdir, calls))


async def _in_process(workdir: Path, calls: int) -> dict[str, float]:
    from gateway.app import create_app
    from gateway.config import load_settings

    app = create_app(load_settings(None, data_dir=workdir / "inproc-data", anonymous=True, anonymous_admin=True))
    startup: asyncio.Queue[Message] = asyncio.Queue()
    started = asyncio.Event()
    startup.put_nowait({"type": "lifespan.startup"})

    async def lifespan_send(message: Message) -> None:
        started.set()

    lifespan = asyncio.create_task(app({"type": "lifespan"}, startup.get, lifespan_send))
    await started.wait()

    async def call(method: str, target: str, body: bytes) -> int:
        messages: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
        status = 0

        async def receive() -> Message:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status
            status = message.get("status", status)

        await app({"type": "http", "method": method, "path": target, "raw_path": target.encode(),
                   "query_string": b"", "headers": [(b"host", b"kvgw"), (b"content-length", b"%d" % len(body))],
                   "http_version": "1.1", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                   "scheme": "http", "root_path": "", "state": {}, "asgi": {"version": "3.0"}}, receive, send)
        return status

    try:
        for key in lookup_keys():
            assert await call("PUT", chunk_target(key), b"f" * META_CHUNK_BYTES) == 201
        out: dict[str, float] = {}
        for op, request in requests().items():
            body = bytes(request.body) if request.body is not None else b""
            assert await call(request.method, request.target, body) == 200
            started_at = time.perf_counter()
            for _ in range(calls):
                await call(request.method, request.target, body)
            out[op] = (time.perf_counter() - started_at) / calls * 1e6
            assert app.lane is not None and app.lane.answer(request.method, request.target, [], body, b"", 0.0, {})
            started_at = time.perf_counter()
            for _ in range(calls):
                app.lane.answer(request.method, request.target, [], body, b"", 0.0, {})
            out[f"{op} lane"] = (time.perf_counter() - started_at) / calls * 1e6
        return out
    finally:
        startup.put_nowait({"type": "lifespan.shutdown"})
        await lifespan


# -- the report ----------------------------------------------------------------------------------------

def report(socket_rounds: dict[tuple[str, str], list[Round]], inproc: dict[str, float]) -> str:
    def med(name: str, op: str, field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in socket_rounds[(name, op)]))

    lines = ["", f"{'target':24} {'call':16} {'p50 µs':>8} {'server CPU µs/call':>19}"]
    for op in (EXISTS, HEAD):
        for name in (RAW, INDEXED, CANNED, KVGW, KVGW_NO_LANE, KVGW_CLIENT):
            if (name, op) not in socket_rounds:
                continue
            lines.append(f"{name:24} {op:16} {med(name, op, 'p50_us'):8.0f} {med(name, op, 'cpu_us'):19.1f}")
    lines.append("")
    for op in (EXISTS, HEAD):
        raw_cpu, canned_cpu, kvgw_cpu, no_lane_cpu = (med(n, op, "cpu_us") for n in (RAW, CANNED, KVGW, KVGW_NO_LANE))
        raw_p50 = med(RAW, op, "p50_us")
        lines.append(f"{op}: server CPU per call: socket {raw_cpu:.1f} µs, the request cycle "
                     f"+{canned_cpu - raw_cpu:.1f}, kvgw's own work (lane off) +{no_lane_cpu - canned_cpu:.1f} "
                     f"(in process: its ASGI app {inproc[op]:.1f}, its lane {inproc[op + ' lane']:.1f}); "
                     f"the lane saves {no_lane_cpu - kvgw_cpu:.1f}; "
                     f"p50 kvgw / raw {med(KVGW, op, 'p50_us') / raw_p50:.2f}x "
                     f"(lane off {med(KVGW_NO_LANE, op, 'p50_us') / raw_p50:.2f}x), canned ASGI / raw "
                     f"{med(CANNED, op, 'p50_us') / raw_p50:.2f}x")
    indexed_p50 = med(INDEXED, EXISTS, "p50_us")
    lines.append(f"{EXISTS}: the index floor: raw-socket + kvgw's index / raw p50 "
                 f"{indexed_p50 / med(RAW, EXISTS, 'p50_us'):.2f}x, server CPU +"
                 f"{med(INDEXED, EXISTS, 'cpu_us') - med(RAW, EXISTS, 'cpu_us'):.1f} µs per call above the raw "
                 f"responder; kvgw / that floor: p50 {med(KVGW, EXISTS, 'p50_us') / indexed_p50:.2f}x, server CPU "
                 f"{med(KVGW, EXISTS, 'cpu_us') / med(INDEXED, EXISTS, 'cpu_us'):.2f}x")
    if (KVGW_CLIENT, EXISTS) in socket_rounds:
        client_cpu = statistics.median(r.client_cpu_us or 0.0 for r in socket_rounds[(KVGW_CLIENT, EXISTS)])
        client_p50 = med(KVGW_CLIENT, EXISTS, "p50_us")
        lines.append(f"{EXISTS} through kvgw's client (blocking, from a plain thread): p50 {client_p50:.0f} µs "
                     f"({client_p50 / med(KVGW, EXISTS, 'p50_us'):.2f}x the load generator's to the same gateway), "
                     f"the client's CPU {client_cpu:.0f} µs per call")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--calls", type=int, default=20000, help="in-process calls per op")
    parser.add_argument("--serve-canned", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_canned:
        serve_canned(args.serve_canned)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-floor-") as tmp:
        workdir = Path(tmp)
        print(f"kvgw bench floor: {args.rounds} rounds of {args.duration:g} s, 1 client, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        socket_rounds = over_the_socket(workdir, args.rounds, args.duration)
        inproc = in_process(workdir, args.calls)
    print(report(socket_rounds, inproc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
