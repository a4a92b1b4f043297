"""An in-memory stand-in for kvgw's native chunk API, for client tests until ``kvgw serve`` runs.

It implements the contract the client relies on (paths, headers, error JSON, batch framing from
``gateway.wire``) and nothing of the real server (tiers, index, auth beyond one key pair). Faults are
injected per operation: an HTTP status, a dropped connection, a delay, a corrupted or cut batch
stream. Integration tests against the real server replace it in phase 2; keep the two suites'
expectations identical.

It runs on its own thread and loop so tests can call the client from plain threads as well as from
coroutines.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote

from aiohttp import web

from gateway import wire


@dataclass
class Fault:
    op: str  # "put", "get", "head", "delete", "exists", "prefix", "batch_get", "readyz", "*"
    status: int | None = None  # answer this status with an error body
    drop: bool = False  # close the connection without answering
    delay: float = 0.0  # seconds before handling
    cut_after: int | None = None  # batch_get: stop after this many frames; get: after this many bytes
    corrupt: int | None = None  # batch_get: flip a payload byte of this frame
    times: int = 1


@dataclass
class Stored:
    data: bytes
    parent: str | None
    ttl: int | None


@dataclass
class FakeGateway:
    bucket: str = "kvcache"
    credentials: tuple[str, str] | None = None
    chunks: dict[str, Stored] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    ready: bool = True

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> str:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="fake-kvgw")
        self._thread.start()
        started.wait(10)
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # ------------------------------------------------------------ helpers

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def put_chunk(self, key: str, data: bytes, parent: str | None = None) -> None:
        with self._lock:
            self.chunks[key] = Stored(data, parent, None)

    def ops(self, op: str) -> int:
        with self._lock:
            return sum(1 for o, _ in self.log if o == op)

    def _take_fault(self, op: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.op in (op, "*"):
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    @staticmethod
    def _error(status: int, code: str, message: str = "") -> web.Response:
        body = {"error": {"code": code, "message": message or code, "request_id": "fake-1"}}
        return web.json_response(body, status=status, headers={wire.H_REQUEST_ID: "fake-1"})

    # ------------------------------------------------------------ routing

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path.split("?", 1)[0]
        op, bucket, key = self._route(request.method, raw)
        with self._lock:
            self.log.append((op, key or ""))
        fault = self._take_fault(op)
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.drop:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            if fault.status is not None:
                code = wire.ErrorCode.SERVICE_UNAVAILABLE if fault.status >= 500 else wire.ErrorCode.INVALID_REQUEST
                return self._error(fault.status, code)
        if op in ("healthz", "readyz"):
            return web.json_response({"status": "ok"}, status=200 if self.ready or op == "healthz" else 503)
        if op == "unknown":
            return self._error(404, wire.ErrorCode.NOT_FOUND)
        if self.credentials is not None:
            expected = f"Bearer {self.credentials[0]}:{self.credentials[1]}"
            if request.headers.get("Authorization") != expected:
                return self._error(401, wire.ErrorCode.UNAUTHORIZED)
        if bucket != self.bucket:
            return self._error(404, wire.ErrorCode.NO_SUCH_BUCKET)
        if op == "put":
            return await self._put(request, key)
        if op == "get" and fault is not None and fault.cut_after is not None:
            return await self._cut_get(request, key, fault.cut_after)
        if op in ("get", "head"):
            return self._get(key, head=op == "head")
        if op == "delete":
            with self._lock:
                gone = self.chunks.pop(key, None)
            return web.Response(status=204) if gone else self._error(404, wire.ErrorCode.NO_SUCH_CHUNK)
        doc = await request.json()
        keys = doc["keys"]
        with self._lock:
            present = [k in self.chunks for k in keys]
        if op == "exists":
            return web.json_response({"exists": present})
        if op == "prefix":
            n = present.index(False) if False in present else len(present)
            return web.json_response({"length": n})
        return await self._batch_get(request, keys, fault)

    def _route(self, method: str, raw: str) -> tuple[str, str, str | None]:
        if raw in ("/healthz", "/readyz"):
            return raw[1:], "", None
        prefix = f"{wire.API_PREFIX}/buckets/"
        if not raw.startswith(prefix):
            return "unknown", "", None
        rest = raw[len(prefix) :]
        bucket, _, tail = rest.partition("/")
        if tail.startswith("chunks/"):
            key = unquote(tail[len("chunks/") :])
            return {"PUT": "put", "GET": "get", "HEAD": "head", "DELETE": "delete"}.get(method, "unknown"), bucket, key
        if method == "POST" and tail in ("exists", "prefix", "batch-get"):
            return tail.replace("-", "_"), bucket, None
        return "unknown", bucket, None

    async def _put(self, request: web.Request, key: str | None) -> web.Response:
        assert key is not None
        if request.content_length is None:
            return self._error(411, wire.ErrorCode.MISSING_CONTENT_LENGTH)
        body = await request.read()
        if len(body) != request.content_length:
            return self._error(400, wire.ErrorCode.INCOMPLETE_BODY)
        claimed = request.headers.get(wire.H_CHECKSUM)
        if claimed is not None and claimed != wire.checksum(body):
            return self._error(400, wire.ErrorCode.BAD_DIGEST)
        parent_raw = request.headers.get(wire.H_PARENT)
        ttl_raw = request.headers.get(wire.H_TTL)
        with self._lock:
            if key in self.chunks:
                return web.Response(status=200, headers={wire.H_EXISTED: "true"})
            parent = unquote(parent_raw) if parent_raw else None
            self.chunks[key] = Stored(body, parent, int(ttl_raw) if ttl_raw else None)
        return web.Response(status=201)

    def _get(self, key: str | None, *, head: bool) -> web.Response:
        with self._lock:
            stored = self.chunks.get(key or "")
        if stored is None:
            return self._error(404, wire.ErrorCode.NO_SUCH_CHUNK)
        headers = {wire.H_CHECKSUM: wire.checksum(stored.data), "ETag": f'"{wire.checksum(stored.data)}"'}
        if head:
            headers["Content-Length"] = str(len(stored.data))
            return web.Response(status=200, headers=headers)
        return web.Response(status=200, body=stored.data, headers=headers, content_type=wire.CHUNK_CONTENT_TYPE)

    async def _cut_get(self, request: web.Request, key: str | None, after: int) -> web.StreamResponse:
        """Announce the whole chunk, send ``after`` bytes of it, then drop the connection."""
        with self._lock:
            stored = self.chunks[key or ""]
        resp = web.StreamResponse(status=200, headers={wire.H_CHECKSUM: wire.checksum(stored.data)})
        resp.content_length = len(stored.data)
        await resp.prepare(request)
        await resp.write(stored.data[:after])
        assert request.transport is not None
        request.transport.close()
        return resp

    async def _batch_get(self, request: web.Request, keys: list[str], fault: Fault | None) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        resp.content_type = wire.BATCH_CONTENT_TYPE
        await resp.prepare(request)
        await resp.write(wire.encode_batch_header(len(keys)))
        for i, key in enumerate(keys):
            if fault is not None and fault.cut_after is not None and i >= fault.cut_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            with self._lock:
                stored = self.chunks.get(key)
            if stored is None:
                await resp.write(wire.encode_frame_header(wire.FRAME_MISSING))
                continue
            payload = bytearray(stored.data)
            header = wire.encode_frame_header(wire.FRAME_OK, len(payload), wire.checksum_int(payload))
            if fault is not None and fault.corrupt == i and payload:
                payload[0] ^= 0xFF
            # split the frame across writes so readers see partial headers and payloads
            frame = header + bytes(payload)
            for start in range(0, len(frame), 7_001):
                await resp.write(frame[start : start + 7_001])
        await resp.write(wire.encode_batch_trailer(len(keys)))
        await resp.write_eof()
        return resp


def json_body(data: object) -> bytes:
    return json.dumps(data).encode()
