"""Baselines a benchmark measures in the same run, on the same disk, with the same load generator.

- ``Nginx``: nginx serving a directory on loopback (``sendfile on``, ``worker_processes auto``), the
  reference for GET throughput and server CPU per GiB.
- ``dict_app`` / ``FastAPIApp``: a plain FastAPI app whose ``HEAD/GET /items/{key}`` route looks the
  key up in a dict, under uvicorn with uvloop + httptools like kvgw: the reference for HEAD.
  ``python -m gateway.bench.baselines --port N`` runs it.
- ``serve_raw`` / ``RawResponder``: a minimal raw-socket HTTP responder answering canned bytes, the floor
  for a lookup's round trip (``--raw``), and with ``--stream`` for a bulk read: N bytes held in memory
  written on one keep-alive connection, the physical limit of one loopback stream (``batch-get``). With
  ``--files DIR`` it is also the **verified sender** (``VerifiedFiles``): chunk files mapped and their
  xxh3-64 checked before they are written, with nothing else around it: the floor of any server that
  verifies the bytes it reads from files, as kvgw does by default (GET, ``batch-get``).
- ``raw_write_op`` / ``raw_read_op``: the same bytes written (temp file, fsync, link, fsync dir) and
  read (``readinto`` a preallocated buffer) straight from Python, the reference for PUT and GET.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import orjson

from backends.fileio import DIRECT_ALIGN, aligned_buffer, fsync_dir, open_direct, start_writeback, write_direct
from backends.index import alive_in
from backends.posix import FOLIO_BYTES
from gateway.bench import procstat
from gateway.bench.launcher import free_port, stop_process, wait_until
from gateway.bench.loadgen import Address, LoadRequest, Op, Stats, request_once, run_load
from kvgw_client import wire
from kvgw_client.keys import digest_many

if TYPE_CHECKING:
    from fastapi import FastAPI


def http_ok(address: Address, target: str) -> bool:
    status, _ = request_once(address, LoadRequest("GET", target), timeout=2.0)
    return status == 200


# -- nginx ---------------------------------------------------------------------------------------

NGINX_CONF = """\
{user}worker_processes auto;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    keepalive_timeout 75s;
    keepalive_requests 100000000;
    default_type application/octet-stream;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx") if os.path.exists(p)),
        None,
    )


class Nginx:
    """nginx serving ``root`` on a free loopback port, run from ``workdir`` (config, pid, error log)."""

    def __init__(self, binary: str, root: Path, workdir: Path) -> None:
        self.binary = binary
        self.root = root
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "nginx.out"

    @property
    def address(self) -> Address:
        return ("127.0.0.1", self.port)

    def start(self, probe: str) -> Nginx:
        """Start nginx and wait until ``probe`` (a path under root) answers 200."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "nginx.conf"
        # As root, nginx's workers would drop to "nobody", which cannot enter a 0700 temp dir.
        user = "user root;\n" if os.geteuid() == 0 else ""
        conf.write_text(NGINX_CONF.format(user=user, dir=self.workdir, port=self.port, root=self.root))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "-p", str(self.workdir), "-c", str(conf), "-g", "daemon off;"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        wait_until(lambda: http_ok(self.address, probe), self.proc, "nginx", self.workdir / "error.log")
        return self

    def pids(self) -> list[int]:
        """The master and its workers (CPU is summed over all of them)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *procstat.children(self.proc.pid)]

    def version(self) -> str:
        done = subprocess.run([self.binary, "-v"], capture_output=True, text=True, check=False)
        return (done.stderr or done.stdout).strip()

    def stop(self) -> None:
        stop_process(self.proc)


# -- plain FastAPI dict-lookup app ---------------------------------------------------------------

def item_keys(count: int) -> list[str]:
    return [f"k{i:04d}" for i in range(count)]


def dict_app(items: dict[str, int]) -> FastAPI:
    """FastAPI app: ``HEAD /items/{key}`` answers the item's size and ETag from a dict (404 if absent),
    ``GET`` the same as JSON. The plainest FastAPI route that does what kvgw's HEAD does."""
    from fastapi import FastAPI, HTTPException, Response

    app = FastAPI()
    etags = {key: f'"{hash(key) & 0xFFFFFFFF:08x}"' for key in items}

    def lookup(key: str) -> int:
        size = items.get(key)
        if size is None:
            raise HTTPException(status_code=404, detail="no such item")
        return size

    @app.head("/items/{key}")
    async def head_item(key: str) -> Response:
        return Response(headers={"content-length": str(lookup(key)), "etag": etags[key]})

    @app.get("/items/{key}")
    async def get_item(key: str) -> Response:
        size = lookup(key)
        return Response(content=f'{{"key":"{key}","size":{size}}}', media_type="application/json",
                        headers={"etag": etags[key]})

    return app


class BaselineProcess:
    """A baseline server in its own process (``python -m gateway.bench.baselines ...``) on a free
    loopback port, so its CPU is measured apart from the load generator's."""

    name = "baseline"
    module = "gateway.bench.baselines"  # what ``python -m`` runs (a bench's own servers: its module)

    def __init__(self, workdir: Path, wrapper: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.wrapper = list(wrapper)  # a command prefix (``gateway.bench.callgrind``)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / f"{self.name}.out"

    @property
    def address(self) -> Address:
        return ("127.0.0.1", self.port)

    def _spawn(self, args: Sequence[str], probe: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.wrapper, sys.executable, "-m", self.module, "--port", str(self.port), *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        wait_until(lambda: http_ok(self.address, probe), self.proc, self.name, self.log,
                   timeout=300.0 if self.wrapper else 30.0)

    def pids(self) -> list[int]:
        return [] if self.proc is None else [self.proc.pid]

    def stop(self) -> None:
        stop_process(self.proc)


class FastAPIApp(BaselineProcess):
    """``dict_app``: the reference for HEAD."""

    name = "fastapi"

    def __init__(self, workdir: Path, keys: int, size: int, wrapper: Sequence[str] = ()) -> None:
        super().__init__(workdir, wrapper)
        self.keys = keys
        self.size = size

    def start(self) -> FastAPIApp:
        self._spawn(["--keys", str(self.keys), "--size", str(self.size)], f"/items/{item_keys(1)[0]}")
        return self


class PutSink(BaselineProcess):
    """``serve_put_sink``: the floor for a PUT server (issue 14, item 3). ``directory`` None: the
    receive-only sink (issue 31), each body received into one reused buffer and dropped. ``direct``:
    bodies received into page-aligned memory and written with ``O_DIRECT`` from it, as kvgw's direct
    writes do (``KVGW_FS_DIRECT_WRITES``). ``write_behind_mib``: the write-behind sink (no fsync),
    acknowledging from an arena of that size and writing with ``O_DIRECT`` behind."""

    def __init__(self, workdir: Path, directory: Path | None, *, fsync: bool, direct: bool = False,
                 write_behind_mib: int = 0) -> None:
        super().__init__(workdir)
        kind = ("receive-only" if directory is None else "write-behind" if write_behind_mib
                else "direct" if direct else "file")
        self.name = f"put-sink-{kind}{'' if fsync else '-no-fsync'}"
        self.log = workdir / f"{self.name}.out"
        self.directory = directory
        self.fsync = fsync
        self.direct = direct
        self.write_behind_mib = write_behind_mib

    def start(self) -> PutSink:
        where = ["--receive-only"] if self.directory is None else ["--put-sink", str(self.directory)]
        behind = ["--write-behind-mib", str(self.write_behind_mib)] if self.write_behind_mib else []
        self._spawn([*where, *([] if self.fsync else ["--no-fsync"]), *(["--direct"] if self.direct else []),
                     *behind], "/probe")
        return self

    def clear(self) -> None:
        """Remove the files written so far."""
        if self.directory is not None:
            for path in (self.directory / "final").glob("*"):
                path.unlink(missing_ok=True)


class RawResponder(BaselineProcess):
    """``serve_raw``: the floor for an HTTP lookup here (issue 14): a keep-alive connection, the request
    read up to the end of its body, canned answer bytes written back, nothing else. ``streams`` maps a
    path part to a byte count: such requests are answered with that many bytes, the floor for a bulk
    read over one connection (batch-get). ``files``: a directory the verified sender serves
    (``VerifiedFiles``). ``index``: a kvgw index directory and bucket whose ``exists`` calls it answers
    (``IndexedLookups``)."""

    name = "raw-responder"

    def __init__(self, workdir: Path, answers: dict[str, bytes], streams: dict[str, int] | None = None,
                 files: Path | None = None, index: tuple[Path, str] | None = None,
                 wrapper: Sequence[str] = ()) -> None:
        super().__init__(workdir, wrapper)
        self.answers = answers
        self.streams = streams or {}
        self.files = files
        self.index = index

    def start(self) -> RawResponder:
        args = ["--raw"]
        for path_part, body in self.answers.items():
            args += ["--answer", f"{path_part}={body.decode()}"]
        for path_part, size in self.streams.items():
            args += ["--stream", f"{path_part}={size}"]
        if self.files is not None:
            args += ["--files", str(self.files)]
        if self.index is not None:
            args += ["--index", str(self.index[0]), "--bucket", self.index[1]]
        self._spawn(args, "/probe")
        return self


def batch_stream_bytes(count: int, size: int) -> int:
    """The body length of a batch-get answering ``count`` chunks of ``size`` bytes (``kvgw_client.wire``):
    what the raw socket stream sends in its place, so both carry the same bytes."""
    return wire.BATCH_HEADER.size + count * (wire.FRAME_HEADER.size + size) + wire.BATCH_TRAILER.size


VERIFY_HEADER = (wire.H_VERIFY, wire.VERIFY_XXH3)
"""What kvgw's client sends on every GET and batch-get: it checks each chunk's xxh3 itself, so the gateway
sends the chunk files unverified (``sendfile``)."""


def batch_request(bucket: str, keys: Sequence[str], *, verify: bool = True,
                  credential: tuple[str, str] | None = None) -> LoadRequest:
    """A native batch-get of ``keys``, as ``kvgw_client`` sends it (POST of ``{"keys": [...]}``, with
    ``x-kvgw-verify: xxh3`` unless ``verify`` is False: a reader that leaves verifying to the gateway;
    ``credential``: an access key and secret, sent as kvgw's client sends them); the raw responder
    answers it with its ``/batch-get`` stream."""
    headers = [("Content-Type", "application/json"), *([VERIFY_HEADER] if verify else [])]
    if credential is not None:
        headers.append(("Authorization", f"Bearer {credential[0]}:{credential[1]}"))
    return LoadRequest("POST", f"/v1/buckets/{bucket}/batch-get", body=json.dumps({"keys": list(keys)}).encode(),
                       headers=headers)


def read_streams(address: Address, request: LoadRequest, body_bytes: int, *, duration: float | None = None,
                 count: int | None = None, verify: bool = False) -> Stats:
    """``request`` again and again on one keep-alive connection, each answer read to its end into one
    buffer of ``body_bytes``: how a batch-get and the raw socket stream it is compared with are both
    measured (the same client code for both, so the ratio is the servers'). ``verify``: each answer's
    bytes are xxh3-64-hashed as soon as they are in, timed with the read (the least a reader that checks
    every byte it consumes adds, on the same thread)."""
    return run_load(address, lambda i, seq: request, 1, duration=duration, count=count, body_buffer_bytes=body_bytes,
                    hash_bodies=verify)


FILES_PATH = "/files/"  # the verified sender: GET /files/<path under its directory>
FILES_BATCH_PATH = "/files-batch/"  # ... and /files-batch/<folder>: every file in it, framed as a batch-get


def files_target(relative: str) -> str:
    """The verified sender's path for one file under its directory (``relative`` uses ``/``)."""
    return FILES_PATH + relative


def files_batch_request(folder: str, body: bytes | memoryview | None) -> LoadRequest:
    """A request the verified sender answers with every file of ``folder`` (name order) framed as a
    batch-get; ``body`` is not read, only skipped: pass a real batch-get's so both move the same bytes."""
    return LoadRequest("POST", FILES_BATCH_PATH + folder, body=body, headers=[("Content-Type", "application/json")])


class VerifiedFiles:
    """The verified sender's work per request, and nothing more: open, map (``MAP_POPULATE``, as kvgw's
    filesystem tier maps a chunk), xxh3-64 the mapping against the value its first read found, write the
    mapping. No thread hops, no index, no framework, all on the event loop: the least a Python server
    that verifies the bytes it serves from files can spend, so kvgw's GET and batch-get can be measured
    against it (and against nginx's ``sendfile``, which verifies nothing)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.checksums: dict[str, int] = {}  # path -> xxh3-64 of the first read (files never change)

    def mapped(self, path: str) -> tuple[memoryview, int]:
        """The file's bytes (a mapping) and their xxh3-64; OSError if they changed since the first read."""
        import mmap

        import xxhash

        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            view = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        digest = xxhash.xxh3_64_intdigest(view)
        if self.checksums.setdefault(path, digest) != digest:
            raise OSError(f"{path}: checksum mismatch")
        return view, digest

    def answer(self, target: str) -> list[bytes | memoryview]:
        """The response to a GET of ``target`` (``FILES_PATH`` or ``FILES_BATCH_PATH``), head first. A
        batch is framed as kvgw frames one (``kvgw_client.wire``), so kvgw's client can parse it."""
        if target.startswith(FILES_BATCH_PATH):
            folder = self.root / target.removeprefix(FILES_BATCH_PATH)
            files = [self.mapped(str(p)) for p in sorted(folder.iterdir())]
            parts: list[bytes | memoryview] = [wire.encode_batch_header(len(files))]
            for view, digest in files:
                parts += [wire.encode_frame_header(wire.FRAME_OK, view.nbytes, digest), view]
            parts.append(wire.encode_batch_trailer(len(files)))
        else:
            parts = [self.mapped(str(self.root / target.removeprefix(FILES_PATH)))[0]]
        length = sum(len(p) for p in parts)
        return [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % length, *parts]


class IndexedLookups:
    """``exists`` answered from kvgw's own LMDB index (opened read-only beside the gateway that owns
    it) by the same code as kvgw's lookup lane (``digest_many``, ``alive_in``), with nothing else
    around it: the raw responder plus this is the floor of an LMDB-indexed lookup here."""

    def __init__(self, index_dir: Path, bucket: str) -> None:
        import lmdb

        self._env = lmdb.open(str(index_dir), readonly=True, lock=True, max_dbs=16)
        self._chunks = self._env.open_db(b"chunks", create=False)
        self._expiry = self._env.open_db(b"expiry", create=False)
        self._bucket = bucket

    def exists_json(self, body: bytes) -> bytes:
        """The answer's JSON body alone (``kvgw bench dataplane``'s servers frame it themselves)."""
        keys = orjson.loads(body)["keys"]
        with self._env.begin(db=self._chunks) as txn:
            alive = alive_in(txn, digest_many(self._bucket, keys), time.time(), self._expiry)
        answer: bytes = orjson.dumps({"exists": alive})
        return answer

    def exists(self, body: bytes) -> bytes:
        answer = self.exists_json(body)
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(answer), answer)


def serve_raw(port: int, answers: dict[bytes, bytes], files: Path | None = None,
              indexed: IndexedLookups | None = None) -> None:
    """Answer every request on 127.0.0.1:``port`` with the body of the first ``answers`` key found in
    its request line (``ok`` otherwise; a HEAD with a head alone, as for a 4 KiB chunk): an asyncio
    protocol on uvloop, as kvgw runs, that finds the end of the headers and the Content-Length and
    writes one canned response.

    A bulk answer (``--stream``) is canned too: its bytes sit in this process's memory and go out with
    one ``transport.write``, so nothing but the socket is between them and the client. Measured here,
    one loopback stream carried ~4 GB/s from memory against ~2.3 GB/s ``sendfile``-d from a page-cache-
    warm file, so memory is the faster sender, hence the honest ceiling for a server's stream.

    With ``files``, requests for ``FILES_PATH`` / ``FILES_BATCH_PATH`` are answered by ``VerifiedFiles``;
    with ``indexed``, ``exists`` calls by ``IndexedLookups``."""
    import asyncio

    import uvloop

    canned = [(part, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
               % len(body) + body) for part, body in answers.items()]
    head_answer = b"HTTP/1.1 200 OK\r\ncontent-length: 4096\r\n\r\n"  # a HEAD: a head alone
    sender = None if files is None else VerifiedFiles(files)
    file_prefixes = (FILES_PATH.encode(), FILES_BATCH_PATH.encode())

    class Responder(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.WriteTransport, transport)  # uvloop's TCPTransport
            self.buffer = bytearray()

        def data_received(self, data: bytes) -> None:
            buffer = self.buffer
            buffer += data
            while (end := buffer.find(b"\r\n\r\n")) >= 0:
                head = bytes(buffer[:end]).lower()
                at = head.find(b"content-length:")
                length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
                if len(buffer) < end + 4 + length:
                    return
                line = head.split(b"\r\n", 1)[0]
                target = bytes(buffer[:end]).split(b" ", 2)[1]  # not lower-cased: a file name
                if sender is not None and target.startswith(file_prefixes):
                    self.transport.writelines(sender.answer(target.decode()))
                elif line.startswith(b"head "):
                    self.transport.write(head_answer)
                elif indexed is not None and b"/exists " in line:
                    self.transport.write(indexed.exists(bytes(buffer[end + 4 : end + 4 + length])))
                else:
                    self.transport.write(next((r for part, r in canned if part in line), canned[-1][1]))
                del buffer[:end + 4 + length]

    loop = uvloop.new_event_loop()
    loop.run_until_complete(loop.create_server(Responder, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


SINK_WAKE_BYTES = 512 << 10  # as kvgw's threaded receives (``intake.THREADED_WAKE_BYTES``): woken per 512 KiB


class WriteBehind:
    """The write-behind sink's arena and writer (``serve_put_sink``): bodies wait in page-aligned slots,
    faulted in when first made and reused after (as a store's DRAM arena is), until one writer thread
    has written them with ``O_DIRECT`` (no fsync) and linked them. Slots are per body size; at most
    ``arena_bytes`` of them exist, and ``slot`` waits while none is free. Thread-safe."""

    def __init__(self, staging: str, final_dir: str, arena_bytes: int) -> None:
        import queue
        import threading

        self.staging, self.final_dir, self.arena_bytes = staging, final_dir, arena_bytes
        self._lock = threading.Condition()
        self._free: dict[int, list[memoryview]] = {}
        self._made = 0  # bytes of slots in existence
        self._pending: dict[str, threading.Event] = {}  # final path -> set once written
        self._queue: queue.SimpleQueue[tuple[str, memoryview, int]] = queue.SimpleQueue()
        threading.Thread(target=self._writer, name="write-behind", daemon=True).start()

    def slot(self, size: int) -> memoryview:
        """A free slot of ``size`` bytes (waiting for the writer to free one while the arena is full)."""
        with self._lock:
            while True:
                free = self._free.get(size)
                if free:
                    return free.pop()
                if self._made + size <= self.arena_bytes or not self._made:
                    self._made += size
                    break
                spare = next((s for s, slots in self._free.items() if slots and s != size), None)
                if spare is not None:  # a free slot of another size makes room
                    self._free[spare].pop()
                    self._made -= spare
                    continue
                self._lock.wait()
        slot = aligned_buffer(size)
        slot[:] = bytes(size)  # faulted in now, not on the first receive
        return slot

    def write(self, name: str, slot: memoryview, length: int) -> str:
        """Queue ``slot``'s first ``length`` bytes for the writer; the file's final path (written later)."""
        import threading

        path = f"{self.final_dir}/{name}"
        with self._lock:
            self._pending[path] = threading.Event()
        self._queue.put((name, slot, length))
        return path

    def written(self, path: str) -> None:
        """Wait until ``path`` (a ``write`` result) is on disk."""
        with self._lock:
            event = self._pending.get(path)
        if event is not None:
            event.wait()

    def _writer(self) -> None:
        while True:
            name, slot, length = self._queue.get()
            pieces = (slot[at : min(at + WRITE_PIECE, length)] for at in range(0, length, WRITE_PIECE))
            path = store_file(self.staging, self.final_dir, name, pieces, fsync=False, direct=True)
            with self._lock:
                self._free.setdefault(len(slot), []).append(slot)
                self._pending.pop(path).set()
                self._lock.notify_all()


def serve_put_sink(port: int, directory: Path | None, *, fsync: bool, direct: bool = False,
                   write_behind_bytes: int = 0) -> None:
    """The floor for an HTTP PUT server in Python here (issue 14, item 3): a thread per keep-alive
    connection that reads each request head, receives the body straight into a 2 MiB buffer
    (``recv_into``, waking per ``SINK_WAKE_BYTES`` with ``SO_RCVLOWAT`` as kvgw's threaded receives
    do, not per segment) and stores it as ``raw_write_op`` does (``store_file``), then answers 201. No
    parsing beyond Content-Length, no hashing, no index: what is left is what receiving the bytes and
    making them durable costs. A DELETE removes the file the connection stored last and answers 204
    (a PUT+DELETE pair recycles page-cache pages, as a store whose chunks are deleted does). Any other
    request (the readiness probe) is answered 200. Other files stay under ``directory`` for the caller
    to remove. ``direct``: the buffer is page-aligned and whole pieces go to the disk with ``O_DIRECT``
    from it, no copy (kvgw's direct writes).

    ``directory`` None: the receive-only sink (issue 31): each body is received into the one buffer and
    dropped, nothing written (a DELETE answers 204, nothing to remove): the floor of any HTTP PUT here.

    ``write_behind_bytes`` (with ``directory``, no fsync): the write-behind sink, what a store that
    acknowledges from memory and keeps every chunk spends (the DRAM KV stores of issue 31: a DRAM arena
    written out to disk behind the acknowledgement). Each body is received whole into a slot of an arena
    of that many bytes (``WriteBehind``: page-aligned, faulted in once), answered 201 at once, and
    written to its file with ``O_DIRECT`` by a writer thread, which then frees the slot; a receive waits
    for room when the arena is full, so over a run longer than the arena lasts the writes set the pace."""
    import select
    import socket
    import threading

    staging, final = (directory / "staging", directory / "final") if directory is not None else (None, None)
    for folder in (staging, final):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    names = itertools.count()
    behind = (WriteBehind(str(staging), str(final), write_behind_bytes)
              if write_behind_bytes and staging is not None and final is not None else None)

    def received(conn: socket.socket, first: memoryview, length: int, buffer: memoryview, *,
                 whole: bool = False) -> Iterator[memoryview]:
        """The body in ``WRITE_PIECE`` pieces, each received into ``buffer`` (``first``: the bytes that
        came with the head); a piece is overwritten only after the caller asked for the next. ``whole``:
        each piece lands after the one before it (``buffer`` holds the whole body)."""
        at = 0
        lowat = 1
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        try:
            while at < length:
                size = min(WRITE_PIECE, length - at)
                piece = buffer[at : at + size] if whole else buffer[:size]
                got = min(len(first), size)
                piece[:got] = first[:got]
                first = first[got:]
                while got < size:
                    try:  # what has arrived, without waiting
                        n = conn.recv_into(piece[got:], 0, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        # sleep until this much has arrived, not per segment, as kvgw's threaded receives
                        # do: never more than the piece has left, and never in a blocking recv (a recv
                        # that copied part of it would wait for SO_RCVLOWAT more bytes than will come)
                        wanted = min(size - got, SINK_WAKE_BYTES)
                        if wanted != lowat:
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                            lowat = wanted
                        poller.poll()
                        continue
                    if not n:
                        raise ConnectionError("the client went away mid-body")
                    got += n
                yield piece
                at += size
        finally:
            if lowat != 1:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # request heads are small

    def store(conn: socket.socket, first: memoryview, length: int, buffer: memoryview) -> str | None:
        if behind is not None:
            slot = behind.slot(length)
            for _ in received(conn, first, length, slot, whole=True):
                pass
            return behind.write(f"{os.getpid()}-{next(names)}", slot, length)
        pieces = received(conn, first, length, buffer)
        if staging is None or final is None:
            for _ in pieces:
                pass
            return None
        return store_file(str(staging), str(final), f"{os.getpid()}-{next(names)}", pieces, fsync=fsync,
                          direct=direct)

    def handle(conn: socket.socket) -> None:
        buffer = aligned_buffer(WRITE_PIECE) if direct else memoryview(bytearray(WRITE_PIECE))
        pending = bytearray()
        stored: str | None = None  # the file this connection stored last
        with conn:
            while True:
                while (end := pending.find(b"\r\n\r\n")) < 0:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head = bytes(pending[:end]).lower()
                rest = memoryview(bytes(pending[end + 4:]))
                at = head.find(b"content-length:")
                length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
                if head.startswith(b"put "):
                    stored = store(conn, rest, length, buffer)
                    pending = bytearray(rest[length:])
                    conn.sendall(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
                elif head.startswith(b"delete ") and (stored is not None or directory is None):
                    if stored is not None:
                        if behind is not None:
                            behind.written(stored)
                        os.unlink(stored)
                    stored = None
                    pending = bytearray(rest[length:])
                    conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
                else:
                    pending = bytearray(rest[length:])
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    with socket.create_server(("127.0.0.1", port), backlog=1024) as listener:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description="benchmark baselines: a plain FastAPI dict-lookup app, or (--raw) a minimal raw-socket HTTP "
                    "responder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--raw", action="store_true", help="run serve_raw instead of the FastAPI app")
    parser.add_argument("--answer", action="append", default=[], metavar="PATH_PART=BODY",
                        help="--raw: answer requests whose request line holds PATH_PART with BODY")
    parser.add_argument("--stream", action="append", default=[], metavar="PATH_PART=BYTES",
                        help="--raw: answer requests whose request line holds PATH_PART with BYTES random bytes")
    parser.add_argument("--files", type=Path, help=f"--raw: serve this directory's files, verified, under "
                                                   f"{FILES_PATH} and {FILES_BATCH_PATH}")
    parser.add_argument("--index", type=Path, metavar="DIR",
                        help="--raw: answer exists calls from the kvgw LMDB index in DIR (read-only)")
    parser.add_argument("--bucket", default="kvcache", help="--index: the bucket the keys are in")
    parser.add_argument("--put-sink", type=Path, metavar="DIR",
                        help="run serve_put_sink instead: PUT bodies written under DIR (the floor for a PUT server)")
    parser.add_argument("--receive-only", action="store_true",
                        help="run serve_put_sink receiving each PUT body into one buffer, storing nothing")
    parser.add_argument("--no-fsync", action="store_true", help="--put-sink: write without fsync")
    parser.add_argument("--direct", action="store_true",
                        help="--put-sink: receive into page-aligned memory and write whole pieces with O_DIRECT")
    parser.add_argument("--write-behind-mib", type=int, default=0, metavar="MIB",
                        help="--put-sink --no-fsync: answer each PUT once received into an arena of MIB MiB, "
                             "write it with O_DIRECT behind (the write-behind sink)")
    args = parser.parse_args(argv)
    if args.put_sink is not None or args.receive_only:
        serve_put_sink(args.port, args.put_sink, fsync=not args.no_fsync, direct=args.direct,
                       write_behind_bytes=args.write_behind_mib << 20)
        return 0
    if args.raw:
        answers = {k.encode(): v.encode() for k, v in (item.split("=", 1) for item in args.answer)}
        answers |= {k.encode(): os.urandom(int(n)) for k, n in (item.split("=", 1) for item in args.stream)}
        indexed = None if args.index is None else IndexedLookups(args.index, args.bucket)
        serve_raw(args.port, answers | {b"/": b"ok"}, args.files, indexed)
        return 0
    app = dict_app(dict.fromkeys(item_keys(args.keys), args.size))
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", lifespan="on",
                log_level="warning", access_log=False, timeout_keep_alive=30)
    return 0


# -- raw file I/O from Python --------------------------------------------------------------------

WRITE_PIECE = FOLIO_BYTES  # as the filesystem tier writes: aligned 2 MiB pieces, so the page cache holds 2 MiB folios


def raw_write_op(directory: Path, payload: memoryview, *, fsync: bool = True, recycle: bool = False,
                 written: list[str] | None = None, direct: bool = False) -> Callable[[int], Op]:
    """``open_client`` for ``run_ops``: each op writes ``payload`` to a fresh temp file (WRITE_PIECE at
    a time, starting each piece's writeback as the tier does), fsyncs it, links it to a distinct final
    name, removes the temp name and fsyncs the directory -- what a write-once store must do at the least
    (without fsync with ``fsync=False``; around the page cache with ``direct``). With ``recycle`` the op
    then unlinks the file, so the next write reuses its page-cache pages (what a PUT followed by a DELETE
    costs a store); otherwise final paths are appended to ``written`` so the caller can delete them
    afterwards. With ``direct`` the loop writes from a page-aligned copy of ``payload`` made here, once,
    so each whole piece goes to the disk as it is, as kvgw's threaded receives hand theirs over."""
    if direct:
        aligned = aligned_buffer(payload.nbytes)
        aligned[:] = payload.cast("B")
        payload = aligned
    staging = directory / "staging"
    final = directory / "final"
    staging.mkdir(parents=True, exist_ok=True)
    final.mkdir(parents=True, exist_ok=True)
    final_dir = str(final)
    run = os.urandom(4).hex()

    def open_client(i: int) -> Op:
        def op(seq: int) -> int:
            pieces = (payload[at : at + WRITE_PIECE] for at in range(0, payload.nbytes, WRITE_PIECE))
            target = store_file(str(staging), final_dir, f"{run}-{i}-{seq}", pieces, fsync=fsync, direct=direct)
            if recycle:
                os.unlink(target)
            elif written is not None:
                written.append(target)
            return payload.nbytes

        return op

    return open_client


def store_file(staging: str, final_dir: str, name: str, pieces: Iterable[memoryview], *, fsync: bool,
               direct: bool = False) -> str:
    """What a write-once store must do at the least, as the filesystem tier does it: ``pieces`` (each
    ``WRITE_PIECE`` long but the last, each written before the next is asked for) to a fresh temp file
    in ``staging``, each piece's writeback started, fsync, link to ``name`` in ``final_dir``, the temp
    name removed, the directory fsynced (no fsync and no writeback with ``fsync=False``). With ``direct``,
    whole blocks go around the page cache as the tier's direct writes send them (``write_direct``).
    The final path."""
    staged = StagedFile(staging, final_dir, name, fsync=fsync, direct=direct)
    try:
        for piece in pieces:
            staged.write(piece)
    except BaseException:
        staged.abort()
        raise
    return staged.finish()


class StagedFile:
    """``store_file`` for pieces that arrive one at a time (a server receiving a body): ``write`` each
    piece in order, then ``finish`` (fsync, link, directory fsync; the final path) or ``abort`` (the
    temp file removed). Pieces of any length; with ``direct``, a piece whose length is not a multiple of
    the block goes through the page cache, as ``write_direct``'s callers do."""

    def __init__(self, staging: str, final_dir: str, name: str, *, fsync: bool, direct: bool = False) -> None:
        self.tmp = f"{staging}/{name}.part"
        self.target = f"{final_dir}/{name}"
        self.final_dir = final_dir
        self.fsync = fsync
        self.at = 0
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.direct_fd: int | None = None
        if direct:
            try:
                self.direct_fd = open_direct(self.tmp)
            except BaseException:
                self.abort()
                raise

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        length = len(piece)
        if self.direct_fd is not None and length % DIRECT_ALIGN == 0:
            write_direct(self.direct_fd, [memoryview(piece)], self.at)
        else:
            view = memoryview(piece)
            while view:
                written = os.pwrite(self.fd, view, self.at + length - len(view))
                view = view[written:]
            if self.fsync:
                start_writeback(self.fd, self.at, length)  # as the tier does
        self.at += length

    def _close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd = -1, None

    def finish(self) -> str:
        try:
            if self.fsync:
                os.fsync(self.fd)
        finally:
            self._close()
        os.link(self.tmp, self.target)
        os.unlink(self.tmp)
        if self.fsync:
            fsync_dir(self.final_dir)
        return self.target

    def abort(self) -> None:
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def raw_read_op(paths: Sequence[Path], size: int) -> Callable[[int], Op]:
    """``open_client`` for ``run_ops``: each op opens one of ``paths`` (cycling) and reads ``size``
    bytes with ``readinto`` a buffer preallocated per client."""
    names = [str(p) for p in paths]

    def open_client(i: int) -> Op:
        buf = memoryview(bytearray(size))

        def op(seq: int) -> int:
            with open(names[(i + seq) % len(names)], "rb", buffering=0) as f:
                got = 0
                while got < size:
                    n = f.readinto(buf[got:])
                    if not n:
                        raise OSError(f"short read: {got} of {size} bytes")
                    got += n
            return got

        return op

    return open_client


if __name__ == "__main__":
    sys.exit(main())
