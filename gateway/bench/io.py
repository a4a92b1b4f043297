"""``kvgw bench io``: chunk I/O throughput, latency, CPU and memory of a real gateway, beside baselines
measured in the same run, on the same disk, with the same load generator (``gateway.bench.loadgen``).

What runs (all on loopback, all started here and stopped afterwards):

- ``kvgw serve --anonymous-admin`` on its defaults (fsync on, reads verified), in a subprocess, data in a
  temp dir under ``--data-dir`` (default: the current directory); with ``--compare-no-fsync`` a second
  one with ``--no-fsync`` for the PUT rows; ``--direct-writes`` runs both with
  ``KVGW_FS_DIRECT_WRITES=true`` (and the raw write loop and the PUT sinks write with ``O_DIRECT`` too,
  from page-aligned memory, as kvgw then does). Its GETs and batch-gets are sent as kvgw's client sends
  them, with ``x-kvgw-verify: xxh3`` (the client checks every chunk, so the gateway sends the files
  unverified, by ``sendfile``): the ``kvgw`` rows; the ``kvgw, server-verified`` rows send the same
  requests without it, as curl or an S3 SDK would (the gateway verifies each chunk before its first
  byte); the ``kvgw client`` row is kvgw's own client (``KvgwClient.batch_get_into`` preallocated
  buffers, every frame's xxh3 checked) reading the batch-get;
- nginx (``sendfile on``, ``worker_processes auto``) serving the same bytes from files in that temp dir;
- a plain FastAPI dict-lookup app under uvicorn (uvloop + httptools) for HEAD, and nginx answering
  HEAD for a tiny static file;
- a minimal raw-socket HTTP responder (``baselines.serve_raw``) answering exists / prefix with the
  same bytes kvgw answers: the floor for a lookup's round trip; and answering a batch-get request with
  as many bytes as kvgw's batch-get of BATCH_CHUNKS x BATCH_CHUNK answers, written from memory on the
  one connection: the physical limit of one loopback stream, which kvgw's batch-get is measured
  against with the same client reading both to the end into one buffer;
- the same responder as the **verified sender** (``baselines.VerifiedFiles``): nginx's files, and the
  batch-get's chunks as files, mapped and xxh3-checked on its event loop and written, nothing else: the
  floor of a server that verifies the bytes it serves from files (kvgw does by default; nginx does not),
  for GET and batch-get;
- raw file write (temp file, fsync, link, fsync dir) and read (``readinto``) of the same bytes, from
  Python threads, in that temp dir (their CPU is this process's, measured over the same window);
- the **PUT sink** (``baselines.serve_put_sink``, with and without fsync): an HTTP server that receives
  PUT bodies straight into a 2 MiB buffer on a thread per connection and writes them as the raw loop
  does, from the same load generator: the floor for a server that must receive the bytes it stores,
  which the raw loop (no socket) is not; and the **receive-only sink** (the same server storing
  nothing: each body received into one reused buffer and dropped, waking per 512 KiB as kvgw's
  threaded receives do): the floor of any HTTP PUT here, issue 31's reference for PUTs without fsync.

The targets printed at the end are issue 31's for GET, batch-get and PUT, issue 14's for HEAD and the
lookups (``targets``).

The machine may be shared and noisy, so every figure is measured in ``--rounds`` rounds, kvgw and its
baselines back to back within a round (their order alternating between rounds); the report gives
medians over rounds, and each ratio is the median of the per-round kvgw / baseline ratios. CPU used by
other processes during each measurement is recorded too. GETs cycle over ``--objects`` distinct
chunks; PUTs always write new keys (a repeated key is a no-op for kvgw). Each PUT operation is a PUT
followed by a DELETE of what it stored (kvgw and the PUT sink: a DELETE request on the same connection,
timed with the PUT; the raw loop: unlink), so writes reuse page-cache pages as a store in steady state
does; ``--keep-puts`` keeps every chunk until the measurement ends instead. Reads are served from the
page cache (everything was just written); this measures the serving path, not the disk. Before the
rounds, the **idle phase** watches kvgw and nginx for ``IDLE_SECONDS`` with no request: the CPU an idle
gateway's background work takes from the engines on its host.

Exit status: 0 when every target passes and no request failed, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from backends.fileio import mount_of
from gateway.bench import procstat
from gateway.bench.baselines import (
    VERIFY_HEADER,
    FastAPIApp,
    Nginx,
    PutSink,
    RawResponder,
    batch_request,
    batch_stream_bytes,
    files_batch_request,
    files_target,
    find_nginx,
    item_keys,
    raw_read_op,
    raw_write_op,
    read_streams,
)
from gateway.bench.launcher import KvgwProcess
from gateway.bench.loadgen import Address, LoadRequest, Stats, request_once, run_load, run_ops
from gateway.bench.plots import plot_io, progress

MiB = 1 << 20
GiB = 1 << 30
BUCKET = "kvcache"
META_KEYS = 64  # keys per exists / prefix call, and HEAD targets
META_CHUNK_BYTES = 4096
RSS_CLIENTS = 32
RSS_CHUNK = 32 * MiB
IDLE_SECONDS = 5.0  # the idle phase: how long the gateway and nginx are watched with no request (1 s with --quick)
RSS_LIMIT_BYTES = 400 * 10**6
BATCH_CHUNKS = 16  # one batch-get of 16 warm 8 MiB chunks against one socket stream (issue 14, item 2)
BATCH_CHUNK = 8 * MiB
BATCH_PAYLOAD = BATCH_CHUNKS * BATCH_CHUNK

KVGW = "kvgw"  # GET / batch-get as kvgw's client sends them: x-kvgw-verify: xxh3, the files sent unverified
KVGW_SERVER_VERIFIED = "kvgw, server-verified"  # the same requests without that header: verified by the gateway
KVGW_CLIENT = "kvgw client"  # KvgwClient.batch_get_into: kvgw's own client, checking every frame's xxh3
KVGW_NOFSYNC = "kvgw --no-fsync"
NGINX = "nginx"
RAW_READ = "raw read"
RAW_WRITE = "raw write+fsync+link"
RAW_WRITE_NOFSYNC = "raw write+link"
PUT_SINK = "PUT sink, fsync"  # serve_put_sink: the floor for an HTTP PUT server
PUT_SINK_NOFSYNC = "PUT sink, no fsync"
RECEIVE_SINK = "receive-only sink"  # serve_put_sink storing nothing: the floor of any HTTP PUT (issue 31)
WRITE_BEHIND_SINK = "write-behind sink"  # acks from a memory arena, O_DIRECT behind: a DRAM store's floor
WRITE_BEHIND_MIB = 128  # its arena: at most this much of a round's PUTs is written after the round's clock stops
FASTAPI = "FastAPI dict route"
RAW_RESPONDER = "raw-socket responder"
RAW_STREAM = "raw socket stream"
VERIFIED_SENDER = "verified sender"
BATCH_FOLDER = "batch"  # the batch-get's chunks as files under www/, for the verified sender
BATCH_GET = f"batch-get {BATCH_CHUNKS} x {BATCH_CHUNK // MiB} MiB"
OPS = ("put", "get", "small", "batch")  # --ops: PUT cells, GET cells + memory phase, HEAD / exists / prefix
# cells, the batch-get cell


# -- the gateway under test ------------------------------------------------------------------------

def kvgw_server(data_dir: Path, *, fsync: bool = True, env: dict[str, str] | None = None) -> KvgwProcess:
    """``kvgw serve`` on its defaults (the caller's KVGW_* settings are not passed on; ``env`` sets
    some, e.g. ``DIRECT_WRITES``), anonymous with delete rights (``--anonymous-admin``: the PUT cells
    delete what they wrote; loopback only)."""
    return KvgwProcess(data_dir, extra_args=["--anonymous-admin", *([] if fsync else ["--no-fsync"])],
                       env=dict(env or {}), inherit_kvgw_env=False,
                       log_path=data_dir.parent / f"{data_dir.name}.log")


DIRECT_WRITES = {"KVGW_FS_DIRECT_WRITES": "true"}  # --direct-writes: chunk data written with O_DIRECT


def chunk_target(key: str) -> str:
    return f"/v1/buckets/{BUCKET}/chunks/{quote(key, safe='')}"


def lookup_answers() -> dict[str, bytes]:
    """What kvgw answers the benchmark's exists and prefix calls (``Bench.check_meta`` checks it)."""
    return {"/exists": b'{"exists":[' + b",".join([b"true"] * META_KEYS) + b"]}",
            "/prefix": b'{"length":%d}' % META_KEYS}


# -- measurements ----------------------------------------------------------------------------------

@dataclass
class Sample:
    """One measurement: one target, one op, one size, one client count, one round."""

    target: str
    op: str
    size: int
    clients: int
    round: int
    stats: Stats
    server_cpu_s: float | None  # CPU of the serving process(es); None for in-process baselines
    others_cores: float  # average cores busy with processes other than ours during the window
    steal_cores: float

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "op": self.op, "size": self.size, "clients": self.clients,
                "round": self.round, **self.stats.summary(), "server_cpu_s": self.server_cpu_s,
                "server_cpu_s_per_gib": self.cpu_per_gib, "others_cores": self.others_cores,
                "steal_cores": self.steal_cores, "statuses": dict(self.stats.statuses)}

    @property
    def cpu_per_gib(self) -> float | None:
        if self.server_cpu_s is None or not self.stats.bytes:
            return None
        return self.server_cpu_s / (self.stats.bytes / GiB)


@dataclass
class Cell:
    """Targets measured back to back in every round: the first is kvgw, the rest its baselines."""

    op: str
    size: int
    clients: int
    runs: list[tuple[str, Callable[[int], Sample]]]  # (target, run(round) -> Sample)


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    kvgw: KvgwProcess
    kvgw_nofsync: KvgwProcess | None
    nginx: Nginx
    fastapi: FastAPIApp
    responder: RawResponder
    sinks: dict[bool, PutSink] = field(default_factory=dict)  # by fsync: the PUT floor's servers
    receive_sink: PutSink | None = None  # the receive-only sink (PUT cells without fsync)
    write_behind_sink: PutSink | None = None  # the write-behind sink (PUT cells without fsync)
    payloads: dict[int, bytearray] = field(default_factory=dict)
    get_keys: dict[int, list[str]] = field(default_factory=dict)
    batch_keys: list[str] = field(default_factory=list)
    www_files: dict[int, list[Path]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: os.urandom(3).hex())

    # -- plumbing --

    def our_pids(self) -> list[int]:
        pids = [os.getpid(), *self.kvgw.pids(), *self.nginx.pids(), *self.fastapi.pids(), *self.responder.pids()]
        if self.kvgw_nofsync is not None:
            pids += self.kvgw_nofsync.pids()
        for sink in (*self.sinks.values(), self.receive_sink, self.write_behind_sink):
            if sink is not None:
                pids += sink.pids()
        return pids

    def measure(self, target: str, op: str, size: int, clients: int, rnd: int, run: Callable[[], Stats],
                server_pids: Sequence[int] | None) -> Sample:
        ours = self.our_pids()
        busy0, steal0 = procstat.machine_busy_seconds()
        ours0 = procstat.total_cpu_seconds(ours)
        server0 = procstat.total_cpu_seconds(server_pids) if server_pids is not None else 0.0
        t0 = time.monotonic()
        stats = run()
        wall = time.monotonic() - t0
        server = procstat.total_cpu_seconds(server_pids) - server0 if server_pids is not None else None
        busy1, steal1 = procstat.machine_busy_seconds()
        others = max(0.0, (busy1 - busy0) - (procstat.total_cpu_seconds(ours) - ours0)) / wall
        sample = Sample(target, op, size, clients, rnd, stats, server, others, (steal1 - steal0) / wall)
        self.samples.append(sample)
        if stats.errors:
            print(f"  ! {target} {op} {fmt_size(size)} x{clients}: {stats.errors} errors, e.g. "
                  f"{stats.error_samples[:2]}", flush=True)
        return sample

    def duration(self) -> float:
        return float(self.args.duration)

    # -- set-up --

    def payload(self, size: int) -> bytearray:
        if size not in self.payloads:
            self.payloads[size] = bytearray(os.urandom(size))
        return self.payloads[size]

    def preload(self, sizes: Sequence[int]) -> None:
        """``--objects`` distinct chunks per size, in kvgw and as files for nginx / raw reads (the same
        bytes: object i is the size's payload with i in its first 8 bytes); META_KEYS small chunks."""
        www = self.work / "www"
        for size in sizes:
            if size in self.get_keys:
                continue
            buf = self.payload(size)
            head = bytes(buf[:8])
            keys, files = [], []
            folder = www / str(size)
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(self.args.objects):
                buf[:8] = i.to_bytes(8, "little")
                key = f"get-{self.run_id}-{size}-{i}"
                self.put(key, buf)
                path = folder / f"obj{i}"
                path.write_bytes(buf)
                keys.append(key)
                files.append(path)
            buf[:8] = head
            self.get_keys[size] = keys
            self.www_files[size] = files
        (www / "probe").write_bytes(b"ok")
        for key in self.meta_keys():
            self.put(key, b"m" * META_CHUNK_BYTES)
        # Everything is read once before it is measured, so every target starts from the page cache.
        for size in sizes:
            run_load(self.kvgw.address, self.get_request_maker(size), 1, count=len(self.get_keys[size]),
                     body_buffer_bytes=MiB)
            run_ops(raw_read_op(self.www_files[size], size), 1, count=len(self.www_files[size]))

    def put(self, key: str, body: bytes | bytearray) -> None:
        status, answer = request_once(self.kvgw.address, LoadRequest("PUT", chunk_target(key), body=body,
                                                                     expect=(201, 200)), timeout=300)
        if status not in (200, 201):
            raise RuntimeError(f"preload PUT {key}: {status} {answer[:200]!r}")

    def preload_batch(self) -> None:
        """BATCH_CHUNKS distinct chunks for the batch-get cell, then one batch-get of them: it warms the
        page cache and checks that kvgw answers as many bytes as the raw stream sends."""
        buf = bytearray(os.urandom(BATCH_CHUNK))
        folder = self.work / "www" / BATCH_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(BATCH_CHUNKS):
            buf[:8] = i.to_bytes(8, "little")
            self.batch_keys.append(f"batch-{self.run_id}-{i}")
            self.put(self.batch_keys[-1], buf)
            (folder / f"obj{i:03d}").write_bytes(buf)
        batch = batch_request(BUCKET, self.batch_keys)
        want = batch_stream_bytes(BATCH_CHUNKS, BATCH_CHUNK)
        for server, req in ((self.kvgw.address, batch), (self.responder.address, batch),
                            (self.responder.address, self.files_batch_request())):
            got = read_streams(server, req, want, count=1)
            if got.errors or got.bytes != req.body_length + want:
                raise RuntimeError(f"batch-get from {server} moved {got.bytes - req.body_length} bytes, "
                                   f"expected {want}: {got.error_samples[:1]}")

    def files_batch_request(self) -> LoadRequest:
        """The verified sender's batch: the same chunks, with the same request body as kvgw's batch-get."""
        return files_batch_request(BATCH_FOLDER, batch_request(BUCKET, self.batch_keys).body)

    def meta_keys(self) -> list[str]:
        return [f"meta-{self.run_id}-{i:04d}" for i in range(META_KEYS)]

    def check_meta(self) -> None:
        """exists / prefix must answer what the benchmark assumes (all 64 keys present)."""
        for op, want in ((op, lookup_answers()[f"/{op}"]) for op in ("exists", "prefix")):
            status, body = request_once(self.kvgw.address, self.meta_request(op))
            if status != 200 or body.replace(b" ", b"") != want:
                raise RuntimeError(f"{op} answered {status} {body[:200]!r}, expected {want[:60]!r}...")

    def meta_request(self, op: str) -> LoadRequest:
        doc = json.dumps({"keys": self.meta_keys()}).encode()
        return LoadRequest("POST", f"/v1/buckets/{BUCKET}/{op}", body=doc,
                       headers=[("Content-Type", "application/json")])

    def get_request_maker(self, size: int, *, verify: bool = True) -> Callable[[int, int], LoadRequest]:
        """GETs cycling over the size's chunks; ``verify``: with ``x-kvgw-verify: xxh3``, as kvgw's client
        sends them (the load generator itself checks nothing: the server's work is what is measured)."""
        headers = [VERIFY_HEADER] if verify else []
        reqs = [LoadRequest("GET", chunk_target(k), headers=headers) for k in self.get_keys[size]]
        n = len(reqs)
        return lambda i, seq: reqs[(i + seq) % n]

    # -- the cells --

    def recycles(self) -> bool:
        """PUT cells delete each chunk right after storing it (``--keep-puts`` off): the next write
        reuses its page-cache pages, as in a store whose capacity eviction frees what it overwrites. A
        kept chunk's pages are fresh memory instead, which a VM that hands freed pages back to its host
        charges several times the copy (BENCHMARKS.md, PUT); that cost is the hypervisor's, not the
        server's."""
        return not self.args.keep_puts

    def put_kvgw(self, server: KvgwProcess, target: str, size: int, clients: int) -> Callable[[int], Sample]:
        def run(rnd: int) -> Sample:
            payload = self.payload(size)
            written: list[str] = []
            tag = f"put-{self.run_id}-{'n' if '--no-fsync' in server.extra_args else 'f'}-{size}-{clients}-{rnd}"

            def make(i: int, seq: int) -> LoadRequest:
                key = f"{tag}-{i}-{seq}"
                written.append(key)
                return LoadRequest("PUT", chunk_target(key), body=payload, expect=(201,))

            def delete(i: int, seq: int) -> LoadRequest:
                return LoadRequest("DELETE", chunk_target(f"{tag}-{i}-{seq}"), expect=(204,))

            then = delete if self.recycles() else None
            sample = self.measure(target, "PUT", size, clients, rnd,
                                  lambda: run_load(server.address, make, clients, duration=self.duration(), then=then),
                                  server.pids())
            if then is not None and not sample.stats.errors:
                written.clear()  # every operation's own DELETE removed its chunk
            deletes = [LoadRequest("DELETE", chunk_target(k), expect=(204, 404)) for k in written]
            if deletes:
                done = run_load(server.address, lambda i, seq: deletes[seq], min(4, len(deletes)),
                                count=len(deletes))
                if done.errors:
                    print(f"  ! clean-up of {target} PUT keys: {done.errors} errors {done.error_samples[:2]}")
            os.sync()
            return sample

        return run

    def put_raw(self, target: str, size: int, clients: int, *, fsync: bool) -> Callable[[int], Sample]:
        def run(rnd: int) -> Sample:
            written: list[str] = []
            folder = self.work / "raw-write"
            opener = raw_write_op(folder, memoryview(self.payload(size)), fsync=fsync, recycle=self.recycles(),
                                  written=written, direct=self.args.direct_writes)
            sample = self.measure(target, "PUT", size, clients, rnd,
                                  lambda: run_ops(opener, clients, duration=self.duration()), [os.getpid()])
            for path in written:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            os.sync()
            return sample

        return run

    def put_sink(self, sink: PutSink, target: str, size: int, clients: int) -> Callable[[int], Sample]:
        def run(rnd: int) -> Sample:
            payload = self.payload(size)
            request = LoadRequest("PUT", "/sink", body=payload, expect=(201,))
            delete = LoadRequest("DELETE", "/sink", expect=(204,))
            then = (lambda i, seq: delete) if self.recycles() else None
            sample = self.measure(target, "PUT", size, clients, rnd,
                                  lambda: run_load(sink.address, lambda i, seq: request, clients,
                                                   duration=self.duration(), then=then), sink.pids())
            sink.clear()
            os.sync()
            return sample

        return run

    def get_kvgw(self, size: int, clients: int, *, verify: bool = True) -> Callable[[int], Sample]:
        make = self.get_request_maker(size, verify=verify)
        return lambda rnd: self.measure(
            KVGW if verify else KVGW_SERVER_VERIFIED, "GET", size, clients, rnd,
            lambda: run_load(self.kvgw.address, make, clients, duration=self.duration()), self.kvgw.pids())

    def get_nginx(self, size: int, clients: int) -> Callable[[int], Sample]:
        return self.get_www(NGINX, self.nginx, lambda name: f"/{size}/{name}", size, clients)

    def get_verified(self, size: int, clients: int) -> Callable[[int], Sample]:
        return self.get_www(VERIFIED_SENDER, self.responder, lambda name: files_target(f"{size}/{name}"), size,
                            clients)

    def get_www(self, target: str, server: Nginx | RawResponder, path_of: Callable[[str], str], size: int,
                clients: int) -> Callable[[int], Sample]:
        """GETs of the size's files under www/ from a baseline that serves them (nginx, the verified
        sender), cycling over them as kvgw's GETs cycle over the same chunks."""
        reqs = [LoadRequest("GET", path_of(p.name)) for p in self.www_files[size]]
        n = len(reqs)
        return lambda rnd: self.measure(
            target, "GET", size, clients, rnd,
            lambda: run_load(server.address, lambda i, seq: reqs[(i + seq) % n], clients, duration=self.duration()),
            server.pids())

    def get_raw(self, size: int, clients: int) -> Callable[[int], Sample]:
        opener = raw_read_op(self.www_files[size], size)
        return lambda rnd: self.measure(RAW_READ, "GET", size, clients, rnd,
                                        lambda: run_ops(opener, clients, duration=self.duration()), None)

    def meta_kvgw(self, op: str, clients: int) -> Callable[[int], Sample]:
        heads = [LoadRequest("HEAD", chunk_target(k)) for k in self.meta_keys()]
        reqs = heads if op == "HEAD" else [self.meta_request(op)]
        n = len(reqs)
        name = op if op == "HEAD" else f"{op} {META_KEYS} keys"
        return lambda rnd: self.measure(
            KVGW, name, 0, clients, rnd,
            lambda: run_load(self.kvgw.address, lambda i, seq: reqs[(i + seq) % n], clients,
                             duration=self.duration()),
            self.kvgw.pids())

    def meta_raw(self, op: str, clients: int) -> Callable[[int], Sample]:
        """The same exists / prefix request to the raw-socket responder (the floor of a lookup)."""
        req = self.meta_request(op)
        return lambda rnd: self.measure(
            RAW_RESPONDER, f"{op} {META_KEYS} keys", 0, clients, rnd,
            lambda: run_load(self.responder.address, lambda i, seq: req, clients, duration=self.duration()),
            self.responder.pids())

    def batch(self, target: str, address: Address, pids: Callable[[], list[int]],
              req: LoadRequest | None = None) -> Callable[[int], Sample]:
        """The batch-get cell's runs: kvgw's batch-get, the raw socket stream or the verified sender
        (``req``), read the same way."""
        req = req or batch_request(BUCKET, self.batch_keys)
        size = batch_stream_bytes(BATCH_CHUNKS, BATCH_CHUNK)
        return lambda rnd: self.measure(target, BATCH_GET, BATCH_PAYLOAD, 1, rnd,
                                        lambda: read_streams(address, req, size, duration=self.duration()), pids())

    def batch_client(self) -> Callable[[int], Sample]:
        """kvgw's own client reading the batch-get cell's chunks: ``KvgwClient.blocking.batch_get_into``
        preallocated buffers (one per chunk, reused), every frame's xxh3 checked by the client, as the
        LMCache connector and the SGLang backend load. Counted in the same bytes as the other rows."""
        from kvgw_client.config import ClientSettings
        from kvgw_client.framing import ItemStatus
        from kvgw_client.http import KvgwClient

        keys = list(self.batch_keys)
        moved = batch_request(BUCKET, keys).body_length + batch_stream_bytes(BATCH_CHUNKS, BATCH_CHUNK)
        host, port = self.kvgw.address
        opened: dict[int, KvgwClient] = {}

        def open_client(i: int) -> Callable[[int], int]:
            client = opened[i] = KvgwClient(ClientSettings(url=f"http://{host}:{port}", bucket=BUCKET))
            buffers = [memoryview(bytearray(BATCH_CHUNK)) for _ in keys]

            def op(seq: int) -> int:
                statuses = client.blocking.batch_get_into(keys, lambda j, n: buffers[j][:n])
                if any(status != ItemStatus.OK for status in statuses):
                    raise RuntimeError(f"batch_get_into: {[str(s) for s in statuses]}")
                return moved

            op(-1)  # the connection opened before the clock starts
            return op

        def finish(i: int, _result: Any) -> None:
            opened.pop(i).close()

        return lambda rnd: self.measure(KVGW_CLIENT, BATCH_GET, BATCH_PAYLOAD, 1, rnd,
                                        lambda: run_ops(open_client, 1, duration=self.duration(), finish=finish),
                                        self.kvgw.pids())

    def head_nginx(self, clients: int) -> Callable[[int], Sample]:
        probe = LoadRequest("HEAD", "/probe")
        return lambda rnd: self.measure(
            NGINX, "HEAD", 0, clients, rnd,
            lambda: run_load(self.nginx.address, lambda i, seq: probe, clients, duration=self.duration()),
            self.nginx.pids())

    def head_fastapi(self, clients: int) -> Callable[[int], Sample]:
        reqs = [LoadRequest("HEAD", f"/items/{k}") for k in item_keys(META_KEYS)]
        n = len(reqs)
        return lambda rnd: self.measure(
            FASTAPI, "HEAD", 0, clients, rnd,
            lambda: run_load(self.fastapi.address, lambda i, seq: reqs[(i + seq) % n], clients,
                             duration=self.duration()),
            self.fastapi.pids())

    def cells(self) -> list[Cell]:
        sizes, clients, ops = self.args.sizes, self.args.clients, self.args.ops
        out: list[Cell] = []
        for size in sizes if "put" in ops else ():
            for c in clients:
                out.append(Cell("PUT", size, c, [(KVGW, self.put_kvgw(self.kvgw, KVGW, size, c)),
                                                 (RAW_WRITE, self.put_raw(RAW_WRITE, size, c, fsync=True)),
                                                 (PUT_SINK, self.put_sink(self.sinks[True], PUT_SINK, size, c))]))
                if self.kvgw_nofsync is not None:
                    runs = [(KVGW_NOFSYNC, self.put_kvgw(self.kvgw_nofsync, KVGW_NOFSYNC, size, c)),
                            (RAW_WRITE_NOFSYNC, self.put_raw(RAW_WRITE_NOFSYNC, size, c, fsync=False)),
                            (PUT_SINK_NOFSYNC, self.put_sink(self.sinks[False], PUT_SINK_NOFSYNC, size, c))]
                    if self.receive_sink is not None:
                        runs.append((RECEIVE_SINK, self.put_sink(self.receive_sink, RECEIVE_SINK, size, c)))
                    if self.write_behind_sink is not None:
                        runs.append((WRITE_BEHIND_SINK,
                                     self.put_sink(self.write_behind_sink, WRITE_BEHIND_SINK, size, c)))
                    out.append(Cell("PUT", size, c, runs))
        for size in sizes if "get" in ops else ():
            for c in clients:
                out.append(Cell("GET", size, c, [(KVGW, self.get_kvgw(size, c)), (NGINX, self.get_nginx(size, c)),
                                                 (KVGW_SERVER_VERIFIED, self.get_kvgw(size, c, verify=False)),
                                                 (VERIFIED_SENDER, self.get_verified(size, c)),
                                                 (RAW_READ, self.get_raw(size, c))]))
        for c in clients if "small" in ops else ():
            runs = [(KVGW, self.meta_kvgw("HEAD", c)), (FASTAPI, self.head_fastapi(c)), (NGINX, self.head_nginx(c))]
            for op in ("exists", "prefix"):
                runs += [(KVGW, self.meta_kvgw(op, c)), (RAW_RESPONDER, self.meta_raw(op, c))]
            out.append(Cell("meta", 0, c, runs))
        if "batch" in ops:
            out.append(Cell(BATCH_GET, BATCH_PAYLOAD, 1, [
                (KVGW, self.batch(KVGW, self.kvgw.address, self.kvgw.pids)),
                (RAW_STREAM, self.batch(RAW_STREAM, self.responder.address, self.responder.pids)),
                (KVGW_SERVER_VERIFIED, self.batch(KVGW_SERVER_VERIFIED, self.kvgw.address, self.kvgw.pids,
                                                  batch_request(BUCKET, self.batch_keys, verify=False))),
                (VERIFIED_SENDER, self.batch(VERIFIED_SENDER, self.responder.address, self.responder.pids,
                                             self.files_batch_request())),
                (KVGW_CLIENT, self.batch_client())]))
        return out

    # -- special phases --

    def selfcheck(self) -> dict[str, Any]:
        """How much one load-generator thread can sink (nginx, biggest chunk) and how many small
        requests the load generator can issue (nginx, 8 clients, a tiny file): the ceiling the load
        generator puts on every figure below."""
        probe = LoadRequest("HEAD", "/probe")
        many = run_load(self.nginx.address, lambda i, seq: probe, 8, duration=self.duration())
        out: dict[str, Any] = {"head_8_clients_per_s": many.ops_per_s, "errors": many.errors}
        if self.www_files:  # GET chunks were preloaded (--ops get)
            size = max(self.www_files)
            reqs = [LoadRequest("GET", f"/{size}/{p.name}") for p in self.www_files[size]]
            one = run_load(self.nginx.address, lambda i, seq: reqs[seq % len(reqs)], 1, duration=self.duration())
            out.update(one_client_get_bytes_per_s=one.bytes_per_s, one_client_get_size=size,
                       one_client_get_client_cpu_per_gib=one.client_cpu / max(one.bytes / GiB, 1e-9),
                       errors=one.errors + many.errors)
        return out

    def idle_phase(self) -> dict[str, float]:
        """The CPU the gateway and nginx spend with no request over ``IDLE_SECONDS``, in ms per second:
        what an idle gateway's background work (cluster feed, read-lease syncs, lifecycle) takes from
        the engines on its host."""
        seconds = self.idle_seconds()
        servers = {KVGW: self.kvgw.pids, NGINX: self.nginx.pids}
        before = {name: procstat.total_cpu_seconds(pids()) for name, pids in servers.items()}
        time.sleep(seconds)
        return {name: (procstat.total_cpu_seconds(pids()) - before[name]) / seconds * 1e3
                for name, pids in servers.items()} | {"seconds": seconds}

    def idle_seconds(self) -> float:
        return 1.0 if self.args.quick else IDLE_SECONDS

    def rss_phase(self) -> dict[str, Any]:
        """VmHWM (peak RSS) and sampled VmRSS of the gateway while RSS_CLIENTS clients GET RSS_CHUNK
        chunks at once. The peak is reset (clear_refs) just before, so earlier phases do not count."""
        pid = self.kvgw.pids()[0]
        reset = procstat.reset_peak_rss(pid)
        before = procstat.memory_bytes(pid)
        samples: list[dict[str, int]] = []
        stop = threading.Event()

        def sampler() -> None:
            while not stop.wait(0.02):
                samples.append(procstat.memory_bytes(pid))

        make = self.get_request_maker(RSS_CHUNK)
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            stats = run_load(self.kvgw.address, make, RSS_CLIENTS, duration=max(self.duration(), 1.0))
        finally:
            stop.set()
            thread.join()
        after = procstat.memory_bytes(pid)
        rss = [s.get("VmRSS", 0) for s in samples] or [after.get("VmRSS", 0)]
        anon = [s.get("RssAnon", 0) for s in samples] or [0]
        return {
            "clients": RSS_CLIENTS, "size": RSS_CHUNK, "peak_reset": reset,
            "rss_before": before.get("VmRSS", 0), "vm_hwm": after.get("VmHWM", 0),
            "rss_sampled_max": max(rss), "rss_sampled_median": statistics.median(rss),
            "rss_anon_sampled_max": max(anon), "rss_file_at_end": after.get("RssFile", 0),
            "bytes_per_s": stats.bytes_per_s, "errors": stats.errors, "error_samples": stats.error_samples,
        }


# -- summarising -----------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Figure:
    """Medians over rounds of one (target, op, size, clients)."""

    target: str
    op: str
    size: int
    clients: int
    rounds: int
    ops_per_s: float
    bytes_per_s: float
    p50: float
    p99: float
    cpu_per_gib: float | None
    errors: int

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def summarise(samples: Sequence[Sample]) -> dict[tuple[str, str, int, int], Figure]:
    groups: dict[tuple[str, str, int, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.target, s.op, s.size, s.clients), []).append(s)
    out: dict[tuple[str, str, int, int], Figure] = {}
    for key, group in groups.items():
        cpu = [s.cpu_per_gib for s in group if s.cpu_per_gib is not None]
        out[key] = Figure(
            *key, rounds=len(group),
            ops_per_s=median([s.stats.ops_per_s for s in group]),
            bytes_per_s=median([s.stats.bytes_per_s for s in group]),
            p50=median([s.stats.percentile(0.5) for s in group]),
            p99=median([s.stats.percentile(0.99) for s in group]),
            cpu_per_gib=median(cpu) if cpu else None,
            errors=sum(s.stats.errors for s in group),
        )
    return out


def paired_ratio(samples: Sequence[Sample], a: tuple[str, str], b: tuple[str, str], size: int, clients: int,
                 value: Callable[[Sample], float | None]) -> float | None:
    """Median over rounds of value(a) / value(b), a and b being (target, op) measured in the same round."""
    by_round: dict[int, dict[tuple[str, str], Sample]] = {}
    for s in samples:
        if s.size == size and s.clients == clients:
            by_round.setdefault(s.round, {})[(s.target, s.op)] = s
    ratios = []
    for got in by_round.values():
        if a in got and b in got:
            va, vb = value(got[a]), value(got[b])
            if va is not None and vb:
                ratios.append(va / vb)
    return median(ratios) if ratios else None


def throughput(s: Sample) -> float:
    return s.stats.bytes_per_s


def rate(s: Sample) -> float:
    return s.stats.ops_per_s


def p50(s: Sample) -> float:
    return s.stats.percentile(0.5)


def p99(s: Sample) -> float:
    return s.stats.percentile(0.99)


def median_of(samples: Sequence[Sample], target: str, op: str, size: int, clients: int,
              value: Callable[[Sample], float]) -> float | None:
    """Median over rounds of ``value`` of one (target, op, size, clients)."""
    got = [value(s) for s in samples if (s.target, s.op, s.size, s.clients) == (target, op, size, clients)]
    return median(got) if got else None


def cpu_per_gib(s: Sample) -> float | None:
    return s.cpu_per_gib


def cpu_or_nan(s: Sample) -> float:
    return float("nan") if s.cpu_per_gib is None else s.cpu_per_gib


def client_cpu_per_gib(s: Sample) -> float:
    return s.stats.client_cpu / (s.stats.bytes / GiB) if s.stats.bytes else float("nan")


IN_PROCESS = (RAW_READ, RAW_WRITE, RAW_WRITE_NOFSYNC)  # loops run by this process: their CPU is all of it


def total_cpu_per_gib(s: Sample) -> float | None:
    """CPU per GiB of the whole transfer on this machine: the server's plus, over sockets, the load
    generator's (an in-process loop's CPU is all of it)."""
    if s.cpu_per_gib is None:
        return None
    return s.cpu_per_gib + (0.0 if s.target in IN_PROCESS else client_cpu_per_gib(s))


def cpu_bound_ceiling(samples: Sequence[Sample], mine: tuple[str, str], base: tuple[str, str], size: int,
                      clients: int) -> float | None:
    """The highest ``mine`` / ``base`` throughput ratio possible when both saturate the same cores:
    the baseline's CPU per GiB over ``mine``'s, clients included (median of per-round ratios). A
    measured ratio at this ceiling is at the floor the CPU cost sets; below it, something else waits."""
    return paired_ratio(samples, base, mine, size, clients, total_cpu_per_gib)


@dataclass
class Target:
    name: str
    value: float | None
    limit: float
    higher_is_better: bool
    unit: str = "x"
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        ok = self.value >= self.limit if self.higher_is_better else self.value <= self.limit
        return "PASS" if ok else "FAIL"

    def line(self) -> str:
        shown = "not measured" if self.value is None else fmt_num(self.value, self.unit)
        bound = (">=" if self.higher_is_better else "<=") + " " + fmt_num(self.limit, self.unit)
        return f"{self.verdict:4}  {self.name}: {shown} (target {bound}){self.note}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "limit": self.limit, "verdict": self.verdict,
                "higher_is_better": self.higher_is_better, "unit": self.unit}


def targets(samples: Sequence[Sample], rss: dict[str, Any] | None) -> list[Target]:
    """Issue 31's targets for GET, batch-get and PUT, issue 14's for HEAD and the lookups (ratios to
    baselines measured in the same rounds), and the memory cap."""
    mb8, mb32 = 8 * MiB, 32 * MiB
    out: list[Target] = []
    for size, c in ((mb8, 1), (mb8, 8), (mb32, 1), (mb32, 8)):
        where = f"GET {fmt_size(size)} client-verified, {c} client{'s' if c > 1 else ''}"
        out.append(Target(f"{where}: kvgw / nginx throughput",
                          paired_ratio(samples, (KVGW, "GET"), (NGINX, "GET"), size, c, throughput), 1.0, True))
        out.append(Target(f"{where}: server CPU per GiB, kvgw / nginx",
                          paired_ratio(samples, (KVGW, "GET"), (NGINX, "GET"), size, c, cpu_per_gib), 1.1, False))
    for c in (1, 8):
        where = f"PUT 8 MiB, {c} client{'s' if c > 1 else ''}"
        out.append(Target(f"{where}, fsync: kvgw server CPU per GiB",
                          median_of(samples, KVGW, "PUT", mb8, c, cpu_or_nan), 1.0, False, unit=" s/GiB"))
        out.append(Target(f"{where}, fsync: kvgw / {RAW_WRITE} throughput",
                          paired_ratio(samples, (KVGW, "PUT"), (RAW_WRITE, "PUT"), mb8, c, throughput), 0.9, True))
        out.append(Target(f"{where}, no fsync: kvgw / {RECEIVE_SINK} throughput",
                          paired_ratio(samples, (KVGW_NOFSYNC, "PUT"), (RECEIVE_SINK, "PUT"), mb8, c, throughput),
                          0.9, True))
    for c in (8,):
        out.append(Target(f"HEAD, {c} clients: kvgw / FastAPI dict route rate",
                          paired_ratio(samples, (KVGW, "HEAD"), (FASTAPI, "HEAD"), 0, c, rate), 1.5, True))
        out.append(Target(f"HEAD, {c} clients: kvgw / nginx static HEAD rate",
                          paired_ratio(samples, (KVGW, "HEAD"), (NGINX, "HEAD"), 0, c, rate), 0.5, True))
    for op in ("exists", "prefix"):
        name = f"{op} {META_KEYS} keys"
        out.append(Target(f"{op} of {META_KEYS} keys, 1 client: p50 / raw-socket responder p50",
                          paired_ratio(samples, (KVGW, name), (RAW_RESPONDER, name), 0, 1, p50), 1.3, False))
        out.append(Target(f"{op} of {META_KEYS} keys, 1 client: p50", median_of(samples, KVGW, name, 0, 1, p50),
                          150e-6, False, unit="s"))
        out.append(Target(f"{op} of {META_KEYS} keys, 1 client: p99", median_of(samples, KVGW, name, 0, 1, p99),
                          400e-6, False, unit="s"))
    for mine in (KVGW, KVGW_CLIENT):
        out.append(Target(f"{BATCH_GET} warm, 1 client: {mine} / raw socket stream throughput",
                          paired_ratio(samples, (mine, BATCH_GET), (RAW_STREAM, BATCH_GET), BATCH_PAYLOAD, 1,
                                       throughput), 0.9, True))
    peak = None if rss is None else float(rss["vm_hwm"] if rss["peak_reset"] else rss["rss_sampled_max"])
    out.append(Target(f"gateway peak RSS serving {RSS_CLIENTS} concurrent {RSS_CHUNK // MiB} MiB GETs", peak,
                      RSS_LIMIT_BYTES, False, unit="B"))
    return out


# -- formatting ------------------------------------------------------------------------------------

def fmt_size(n: int) -> str:
    if n and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B" if n else "-"


def fmt_num(v: float, unit: str) -> str:
    if unit == "B":
        return f"{v / 1e6:.0f} MB ({v / MiB:.0f} MiB)"
    if unit == "s":
        return f"{v * 1e6:.0f} µs"
    return f"{v:.2f}{unit}"


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def report(samples: Sequence[Sample], figures: dict[tuple[str, str, int, int], Figure], args: argparse.Namespace,
           tgts: list[Target], rss: dict[str, Any] | None, selfcheck: dict[str, Any],
           idle: dict[str, float] | None = None) -> str:
    lines: list[str] = []
    add = lines.append
    rows: list[str] = []
    row = rows.append

    def table(title: str, *columns: str) -> None:
        """The rows added so far under ``title`` and a header of ``columns``; nothing without rows (--ops)."""
        if rows:
            lines.extend([title, "", f"| {' | '.join(columns)} |", "|---" * len(columns) + "|", *rows, ""])
        rows.clear()

    pairs = [("PUT", KVGW, RAW_WRITE), ("PUT", KVGW, PUT_SINK), ("PUT", KVGW_NOFSYNC, RAW_WRITE_NOFSYNC),
             ("PUT", KVGW_NOFSYNC, PUT_SINK_NOFSYNC), ("PUT", KVGW_NOFSYNC, RECEIVE_SINK),
             ("PUT", KVGW_NOFSYNC, WRITE_BEHIND_SINK), ("PUT", WRITE_BEHIND_SINK, RECEIVE_SINK), ("GET", KVGW, NGINX),
             ("GET", KVGW_SERVER_VERIFIED, NGINX), ("GET", KVGW, VERIFIED_SENDER),
             ("GET", KVGW_SERVER_VERIFIED, VERIFIED_SENDER), ("GET", KVGW, RAW_READ)]
    labels = {KVGW_NOFSYNC: " (no fsync)", KVGW_SERVER_VERIFIED: " (server-verified)",
              WRITE_BEHIND_SINK: f" ({WRITE_BEHIND_SINK} as kvgw)"}
    for op, mine, base in pairs:
        for size in args.sizes:
            for c in args.clients:
                k, b = figures.get((mine, op, size, c)), figures.get((base, op, size, c))
                if k is None or b is None:
                    continue
                ratio = paired_ratio(samples, (mine, op), (base, op), size, c, throughput)
                err = f" ({k.errors} errors!)" if k.errors else ""
                berr = f" ({b.errors} errors!)" if b.errors else ""
                row(f"| {op}{labels.get(mine, '')} | {fmt_size(size)} | {c} "
                    f"| {k.bytes_per_s / 1e6:.0f}{err} | {fmt_ms(k.p50)} / {fmt_ms(k.p99)} | {base} "
                    f"| {b.bytes_per_s / 1e6:.0f}{berr} | {fmt_ms(b.p50)} / {fmt_ms(b.p99)} | {fmt_ratio(ratio)} |")
    put_op = ("" if "put" not in args.ops else "; each PUT kept until the measurement ends" if args.keep_puts
              else "; each PUT followed by a DELETE of its chunk (raw loop: unlink), timed with it")
    direct = "; kvgw with KVGW_FS_DIRECT_WRITES=true, the raw loop and the PUT sinks writing with O_DIRECT" if (
        "put" in args.ops and args.direct_writes) else ""
    get_op = ("; GET (kvgw) with x-kvgw-verify: xxh3 as kvgw's client sends it (files sent unverified), "
              "GET (server-verified) without it" if "get" in args.ops else "")
    table(f"Throughput (MB/s = 10^6 B/s), medians of {args.rounds} interleaved rounds of {args.duration:g} s; "
          f"ratio = median of per-round kvgw/baseline{put_op}{direct}{get_op}", "op", "size", "clients", "kvgw MB/s",
          "kvgw p50 / p99 ms", "baseline", "baseline MB/s", "baseline p50 / p99 ms", "kvgw / baseline")
    for mine in (KVGW, KVGW_SERVER_VERIFIED):
        for size in args.sizes:
            for c in args.clients:
                k, b = figures.get((mine, "GET", size, c)), figures.get((NGINX, "GET", size, c))
                if k is None or b is None or k.cpu_per_gib is None or b.cpu_per_gib is None:
                    continue
                ratio = paired_ratio(samples, (mine, "GET"), (NGINX, "GET"), size, c, cpu_per_gib)
                ceiling = cpu_bound_ceiling(samples, (mine, "GET"), (NGINX, "GET"), size, c)
                v = figures.get((VERIFIED_SENDER, "GET", size, c))
                v_cpu = "-" if v is None or v.cpu_per_gib is None else f"{v.cpu_per_gib:.3f}"
                floor = paired_ratio(samples, (VERIFIED_SENDER, "GET"), (NGINX, "GET"), size, c, cpu_per_gib)
                over_floor = paired_ratio(samples, (mine, "GET"), (VERIFIED_SENDER, "GET"), size, c, cpu_per_gib)
                row(f"| {mine} | {fmt_size(size)} | {c} | {k.cpu_per_gib:.3f} | {b.cpu_per_gib:.3f} "
                    f"| {fmt_ratio(ratio)} | {fmt_ratio(ceiling)} | {v_cpu} | {fmt_ratio(floor)} "
                    f"| {fmt_ratio(over_floor)} |")
    table("Server CPU per GiB served by GET (process utime+stime; nginx = master + workers); ceiling: the "
          "highest kvgw / nginx throughput when both saturate the cores, load generator's CPU included; "
          "verified sender: the floor of a server that verifies what it reads (maps, hashes, writes; one thread)",
          "kvgw as", "size", "clients", "kvgw CPU s/GiB", "nginx CPU s/GiB", "kvgw / nginx", "CPU-bound ceiling",
          "verified sender CPU s/GiB", "verified sender / nginx", "kvgw / verified sender")
    for mine, raw, sink, fsync in ((KVGW, RAW_WRITE, PUT_SINK, "on"),
                                   (KVGW_NOFSYNC, RAW_WRITE_NOFSYNC, PUT_SINK_NOFSYNC, "off")):
        for size in args.sizes:
            for c in args.clients:
                k, b = figures.get((mine, "PUT", size, c)), figures.get((raw, "PUT", size, c))
                if k is None or b is None or k.cpu_per_gib is None or b.cpu_per_gib is None:
                    continue
                ratio = paired_ratio(samples, (mine, "PUT"), (raw, "PUT"), size, c, cpu_per_gib)
                ceiling = cpu_bound_ceiling(samples, (mine, "PUT"), (raw, "PUT"), size, c)
                f = figures.get((sink, "PUT", size, c))
                f_cpu = "-" if f is None or f.cpu_per_gib is None else f"{f.cpu_per_gib:.3f}"
                over_sink = paired_ratio(samples, (mine, "PUT"), (sink, "PUT"), size, c, cpu_per_gib)
                r = figures.get((RECEIVE_SINK, "PUT", size, c)) if mine == KVGW_NOFSYNC else None
                r_cpu = "-" if r is None or r.cpu_per_gib is None else f"{r.cpu_per_gib:.3f}"
                over_r = (paired_ratio(samples, (mine, "PUT"), (RECEIVE_SINK, "PUT"), size, c, cpu_per_gib)
                          if r is not None else None)
                row(f"| {fmt_size(size)} | {c} | {fsync} | {k.cpu_per_gib:.3f} | {b.cpu_per_gib:.3f} "
                    f"| {fmt_ratio(ratio)} | {fmt_ratio(ceiling)} | {f_cpu} | {fmt_ratio(over_sink)} | {r_cpu} "
                    f"| {fmt_ratio(over_r)} |")
    table("CPU per GiB written by PUT (kvgw: the server process; raw: this process's threads running the loop); "
          "ceiling: the highest kvgw / raw throughput when both saturate the cores, load generator's CPU included; "
          "PUT sink: the floor for an HTTP PUT server (a thread per connection receiving into a buffer and "
          "writing as the loop writes; its process)",
          "size", "clients", "fsync", "kvgw CPU s/GiB", "raw loop CPU s/GiB", "kvgw / raw", "CPU-bound ceiling",
          "PUT sink CPU s/GiB", "kvgw / PUT sink", "receive-only sink CPU s/GiB", "kvgw / receive-only sink")
    for c in args.clients:
        for op in ("HEAD", f"exists {META_KEYS} keys", f"prefix {META_KEYS} keys"):
            k = figures.get((KVGW, op, 0, c))
            if k is None:
                continue
            err = f" ({k.errors} errors!)" if k.errors else ""
            for base in ((FASTAPI, NGINX) if op == "HEAD" else (RAW_RESPONDER,)):
                f = figures.get((base, op, 0, c))
                shown = "-" if f is None else f"{f.ops_per_s:.0f} ({fmt_ms(f.p50)})"
                row(f"| {op} | {c} | {k.ops_per_s:.0f}{err} | {fmt_ms(k.p50)} / {fmt_ms(k.p99)} | {base} | {shown} "
                    f"| {fmt_ratio(paired_ratio(samples, (KVGW, op), (base, op), 0, c, rate))} "
                    f"| {fmt_ratio(paired_ratio(samples, (KVGW, op), (base, op), 0, c, p50))} |")
    table(f"Small calls (exists / prefix carry {META_KEYS} keys, all present; HEAD cycles over the same keys)",
          "op", "clients", "kvgw calls/s", "kvgw p50 / p99 ms", "baseline", "baseline calls/s (p50 ms)", "rate ratio",
          "p50 ratio")
    kvgw_batch, stream = figures.get((KVGW, BATCH_GET, BATCH_PAYLOAD, 1)), figures.get((RAW_STREAM, BATCH_GET,
                                                                                         BATCH_PAYLOAD, 1))
    if kvgw_batch is not None and stream is not None:
        batch_rows = {name: figures.get((name, BATCH_GET, BATCH_PAYLOAD, 1))
                  for name in (KVGW_SERVER_VERIFIED, VERIFIED_SENDER, KVGW_CLIENT)}
        for name, f in ((KVGW, kvgw_batch), (RAW_STREAM, stream), *batch_rows.items()):
            if f is None:
                continue
            client = median_of(samples, name, BATCH_GET, BATCH_PAYLOAD, 1, client_cpu_per_gib)
            err = f" ({f.errors} errors!)" if f.errors else ""
            row(f"| {name} | {f.bytes_per_s / 1e6:.0f}{err} | {fmt_ms(f.p50)} / {fmt_ms(f.p99)} "
                f"| {f.cpu_per_gib or float('nan'):.3f} | {client or float('nan'):.3f} |")
        table(f"{BATCH_GET} warm chunks in one call, beside a raw socket stream of as many bytes written from memory "
              "and the verified sender of the same chunks as files (one client reading each answer to its end "
              "into one buffer; CPU: server process, client thread; kvgw: with x-kvgw-verify as kvgw's client "
              "sends it; kvgw client: KvgwClient.batch_get_into, its client CPU not counted)",
              "target", "MB/s", "p50 / p99 ms", "server CPU s/GiB", "client CPU s/GiB")
        for mine in (KVGW, KVGW_SERVER_VERIFIED, KVGW_CLIENT):
            for base in (RAW_STREAM, VERIFIED_SENDER):
                ratio = paired_ratio(samples, (mine, BATCH_GET), (base, BATCH_GET), BATCH_PAYLOAD, 1, throughput)
                if ratio is not None:
                    add(f"{mine} / {base} throughput: {fmt_ratio(ratio)}")
        floor = paired_ratio(samples, (VERIFIED_SENDER, BATCH_GET), (RAW_STREAM, BATCH_GET), BATCH_PAYLOAD, 1,
                             throughput)
        add(f"{VERIFIED_SENDER} / {RAW_STREAM} throughput: {fmt_ratio(floor)} (what verifying file bytes leaves "
            "of the stream, with no server around it)")
        add("")
    if rss is not None:
        peak_note = "" if rss["peak_reset"] else " (lifetime peak: reset refused)"
        rss_err = f", {rss['errors']} errors!" if rss["errors"] else ""
        add(f"Gateway memory serving {rss['clients']} concurrent {rss['size'] // MiB} MiB GETs "
            f"({rss['bytes_per_s'] / 1e6:.0f} MB/s{rss_err}): peak VmHWM {rss['vm_hwm'] / MiB:.0f} MiB{peak_note}, "
            f"VmRSS sampled max {rss['rss_sampled_max'] / MiB:.0f} MiB / median "
            f"{rss['rss_sampled_median'] / MiB:.0f} MiB (anon max {rss['rss_anon_sampled_max'] / MiB:.0f} MiB), "
            f"idle before {rss['rss_before'] / MiB:.0f} MiB")
        add("")
    if idle is not None:
        add(f"Idle, no request for {idle['seconds']:g} s: {KVGW} spent {idle[KVGW]:.1f} ms of CPU per second, "
            f"{NGINX} {idle[NGINX]:.1f} (CPU time is counted in ticks of {1e3 / os.sysconf('SC_CLK_TCK'):g} ms)")
        add("")
    others = [s.others_cores for s in samples]
    steal = [s.steal_cores for s in samples]
    sink = ""
    if "one_client_get_size" in selfcheck:
        cpu = selfcheck["one_client_get_client_cpu_per_gib"]
        sink = (f"one client thread sank {selfcheck['one_client_get_bytes_per_s'] / 1e9:.2f} GB/s of "
                f"{fmt_size(selfcheck['one_client_get_size'])} GETs from nginx, using {cpu:.2f} CPU s/GiB (so "
                f"{GiB / cpu / 1e9 if cpu else float('nan'):.1f} GB/s per core it gets); ")
    add(f"Load generator: {sink}8 clients issued {selfcheck['head_8_clients_per_s']:.0f} HEAD/s to nginx.")
    if others:
        add(f"Machine noise: other processes kept {median(others):.2f} cores busy (median over measurements, "
            f"max {max(others):.2f}) of {os.cpu_count()}; steal {median(steal):.2f} cores.")
    add("")
    add("Targets:")
    for t in tgts:
        add("  " + t.line())
    errors = sum(s.stats.errors for s in samples)
    if errors:
        add(f"  !!  {errors} requests failed during the measurements (see above and the JSON)")
    return "\n".join(lines)


# -- entry point -----------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1024, "M": MiB, "G": GiB}.get(text[-1:], 0)
    number = text[:-1] if scale else text
    return int(float(number) * (scale or MiB))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="kvgw bench io", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="1,8,32", help="chunk sizes, MiB unless suffixed K/M/G (default 1,8,32)")
    p.add_argument("--clients", default="1,8", help="concurrent clients (default 1,8)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    p.add_argument("--objects", type=int, default=8, help="distinct chunks per size that GETs cycle over (default 8)")
    p.add_argument("--data-dir", type=Path, default=Path("."),
                   help="where the temp dir for kvgw, nginx's files and the raw baselines goes (the disk measured)")
    p.add_argument("--compare-no-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure PUT against a --no-fsync gateway and raw writes without fsync")
    p.add_argument("--direct-writes", action="store_true",
                   help="run kvgw with KVGW_FS_DIRECT_WRITES=true (chunk data written with O_DIRECT), the raw write "
                        "loop and the PUT sinks writing the same way from page-aligned memory")
    p.add_argument("--keep-puts", action="store_true",
                   help="PUT cells keep what they store until the measurement ends, instead of deleting each "
                        "chunk right after its PUT (kvgw and the PUT sink: a DELETE request; the raw loop: "
                        "unlink), so every write lands in fresh page-cache memory")
    p.add_argument("--ops", default=",".join(OPS),
                   help="what to measure: put, get (with the memory phase), small (HEAD / exists / prefix), "
                        f"batch (a batch-get of {BATCH_CHUNKS} x {BATCH_CHUNK // MiB} MiB against one raw socket "
                        "stream); default all")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 MiB only, 1 round of 0.5 s")
    p.add_argument("--json", type=Path, help="write every figure (each round, medians, targets) here")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw throughput against concurrency beside the baselines (needs the bench extra)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data) afterwards")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.duration, args.rounds, args.objects = "8", 0.5, 1, 4
    try:
        args.sizes = sorted({parse_size(s) for s in str(args.sizes).split(",") if s.strip()})
        args.clients = sorted({int(c) for c in str(args.clients).split(",") if c.strip()})
        wanted = {o.strip() for o in str(args.ops).split(",") if o.strip()}
        if not wanted or wanted - set(OPS):
            raise ValueError(f"--ops takes a comma-separated subset of {', '.join(OPS)}")
        args.ops = [op for op in OPS if op in wanted]
    except ValueError as exc:
        print(f"kvgw bench io: {exc}", file=sys.stderr)
        return 2
    if not args.sizes or not args.clients or min(args.clients) < 1 or args.rounds < 1 or args.duration <= 0:
        print("kvgw bench io: need sizes, clients >= 1, rounds >= 1 and a positive duration", file=sys.stderr)
        return 2
    nginx_bin = find_nginx()
    if nginx_bin is None:
        print("kvgw bench io: nginx is not installed (it is the GET baseline)", file=sys.stderr)
        return 2
    args.data_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgw-bench-io-", dir=args.data_dir)).resolve()
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    procs: list[Any] = []
    try:
        env = DIRECT_WRITES if args.direct_writes else {}
        kvgw = kvgw_server(work / "kvgw", env=env).start()
        procs.append(kvgw)
        with_nofsync = args.compare_no_fsync and "put" in args.ops
        nofsync = kvgw_server(work / "kvgw-nofsync", fsync=False, env=env).start() if with_nofsync else None
        if nofsync is not None:
            procs.append(nofsync)
        (work / "www").mkdir()
        (work / "www" / "probe").write_bytes(b"ok")
        nginx = Nginx(nginx_bin, work / "www", work / "nginx").start("/probe")
        procs.append(nginx)
        fastapi = FastAPIApp(work / "fastapi", META_KEYS, META_CHUNK_BYTES).start()
        procs.append(fastapi)
        streams = {"/batch-get": batch_stream_bytes(BATCH_CHUNKS, BATCH_CHUNK)} if "batch" in args.ops else {}
        responder = RawResponder(work / "responder", lookup_answers(), streams, files=work / "www").start()
        procs.append(responder)
        sinks: dict[bool, PutSink] = {}
        for fsync in ((True, False) if with_nofsync else (True,)) if "put" in args.ops else ():
            sinks[fsync] = PutSink(work / "put-sink", work / f"put-sink-{'f' if fsync else 'n'}", fsync=fsync,
                                   direct=args.direct_writes).start()
            procs.append(sinks[fsync])
        receive_sink = PutSink(work / "put-sink", None, fsync=False).start() if with_nofsync else None
        if receive_sink is not None:
            procs.append(receive_sink)
        behind = (PutSink(work / "put-sink", work / "put-sink-w", fsync=False,
                          write_behind_mib=WRITE_BEHIND_MIB).start() if with_nofsync else None)
        if behind is not None:
            procs.append(behind)
        bench = Bench(args, work, kvgw, nofsync, nginx, fastapi, responder, sinks, receive_sink, behind)
        print(f"kvgw bench io, {started:%Y-%m-%d %H:%M} UTC: work dir {work} ({_fs_type(work)}), sizes "
              f"{', '.join(fmt_size(s) for s in args.sizes)}, clients {args.clients}, {args.rounds} rounds of "
              f"{args.duration:g} s, {os.cpu_count()} cores, load {load_before[0]:.2f}, ops {','.join(args.ops)}"
              f"{', direct writes' if args.direct_writes else ''}",
              flush=True)
        bench.preload(sorted({*args.sizes, RSS_CHUNK}) if "get" in args.ops else [])
        if "small" in args.ops:
            bench.check_meta()
        if "batch" in args.ops:
            bench.preload_batch()
        selfcheck = bench.selfcheck()
        idle = bench.idle_phase()
        cells = bench.cells()
        for rnd in range(args.rounds):
            t0 = time.monotonic()
            for cell in progress(cells, f"round {rnd + 1}/{args.rounds}"):
                runs = cell.runs if rnd % 2 == 0 else list(reversed(cell.runs))
                for _, run in runs:
                    run(rnd)
            print(f"  round {rnd + 1}/{args.rounds} done in {time.monotonic() - t0:.0f} s", flush=True)
        rss = bench.rss_phase() if "get" in args.ops else None
        samples = bench.samples
        figures = summarise(samples)
        tgts = targets(samples, rss)
        text = report(samples, figures, args, tgts, rss, selfcheck, idle)
        print()
        print(text)
        finished = dt.datetime.now(dt.UTC)
        if args.json is not None:
            doc = {
                "command": "kvgw bench io " + " ".join(argv),
                "started": started.isoformat(), "finished": finished.isoformat(),
                "config": {"sizes": args.sizes, "clients": args.clients, "duration_s": args.duration,
                           "rounds": args.rounds, "objects": args.objects, "compare_no_fsync": args.compare_no_fsync,
                           "ops": args.ops, "keep_puts": args.keep_puts, "direct_writes": args.direct_writes},
                "environment": {"cores": os.cpu_count(), "loadavg_before": load_before,
                                "commit": _commit(),
                                "loadavg_after": os.getloadavg(), "python": platform.python_version(),
                                "kernel": platform.release(), "nginx": nginx.version(),
                                "filesystem": _fs_type(work), "work_dir": str(work)},
                "loadgen_selfcheck": selfcheck,
                "samples": [s.as_dict() for s in samples],
                "medians": [f.as_dict() for f in figures.values()],
                "rss": rss,
                "idle_cpu_ms_per_s": idle,
                "targets": [t.as_dict() for t in tgts],
            }
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"\nfigures written to {args.json}")
        if args.plot is not None:
            plot_io([f.as_dict() for f in figures.values()], args.plot,
                    title=f"kvgw bench io, {started:%Y-%m-%d %H:%M} UTC ({os.cpu_count()} cores)")
            print(f"plot written to {args.plot}")
        failed = any(t.verdict == "FAIL" for t in tgts)
        errors = sum(s.stats.errors for s in samples) + (rss or {}).get("errors", 0) + selfcheck["errors"]
        return 1 if failed or errors else 0
    finally:
        for proc in reversed(procs):
            proc.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _commit() -> str:
    """The source tree's commit (``git describe``), or ``?`` outside a checkout."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=False).stdout.strip() or "?"
    except OSError:
        return "?"


def _fs_type(path: Path) -> str:
    """Filesystem type and device holding ``path``."""
    mount = mount_of(path)
    return f"{mount.fstype} on {mount.device}"
