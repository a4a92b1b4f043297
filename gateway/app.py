"""The ASGI application: a thin dispatcher in front of the data-plane APIs and the FastAPI control plane.

    /v1/buckets/...                         native chunk API (raw ASGI, hot path)
    /healthz /readyz /v1/admin/... /docs    FastAPI (control plane, OpenAPI)
    everything else                         S3-compatible API (raw ASGI, gateway.api.s3.app)

The control plane answers like the data plane: every response carries ``x-kvgw-request-id`` (its own
routes, FastAPI's 404 and 405 too; ``with_request_id``), and credentials are checked by the same
``Directory.authenticate`` the native API uses, which re-reads the catalog before refusing an access key
it does not know: a credential works on ``/metrics`` and ``/v1/admin/*`` the moment ``kvgw cred create``
returns, as on the data plane. ``/healthz`` and ``/readyz`` answer ``HEAD`` as well as ``GET``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi import Request as ControlRequest  # gateway.api.http.Request is the data plane's
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api.http import (
    IndexedAnswer,
    Message,
    RawHeaders,
    Receive,
    Scope,
    Send,
    new_request_id,
    path_segment,
)
from gateway.api.native import BUCKETS_PREFIX, NativeAPI
from gateway.api.s3.app import S3API
from gateway.buckets import BucketService, new_bucket_policy
from gateway.config import Settings
from gateway.dataplane.lane import LookupLane
from gateway.errors import KvgwError
from gateway.logs import current_request_id
from gateway.loopwatch import LoopWatch
from gateway.metrics import RequestMetrics, StatsCollector, native_op
from gateway.multipart import MultipartStore
from gateway.readiness import Readiness, ReadinessCache, ReadinessCollector
from gateway.runtime import Gateway
from gateway.stats import gateway_stats
from gateway.version import kvgw_version

log = logging.getLogger("kvgw")

CONTROL_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                           "/openapi.json"})
CONTROL_PREFIX = "/v1/"  # "v1" is no valid bucket name, so S3 paths never start with it
REQUEST_ID = "kvgw.request_id"
"""ASGI scope key: the id ``with_request_id`` gave a control-plane request (its error bodies repeat it)."""


METRICS_READINESS_WAIT = 2.0
"""Seconds ``/metrics`` waits for a fresh readiness check before it reports the last one."""


def build_control_plane(gateway: Gateway, registry: CollectorRegistry, readiness: ReadinessCache) -> FastAPI:
    api = FastAPI(title="kvgw", version=kvgw_version(), description="KV-cache storage gateway: control plane")
    _json_errors(api)

    @api.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": kvgw_version()}

    @api.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz() -> JSONResponse:
        report = await readiness.current()
        return JSONResponse({"ready": report.ready, "checks": report.checks}, status_code=200 if report.ready else 503)

    @api.get("/v1/admin/buckets")
    async def list_buckets(request: ControlRequest) -> dict[str, Any]:
        await _require_root(gateway, request)
        return {"buckets": [b.name for b in gateway.directory.buckets()]}

    @api.get("/v1/admin/stats")
    async def stats(request: ControlRequest) -> dict[str, Any]:
        await _require_root(gateway, request)
        return gateway_stats(gateway)

    @api.get("/metrics")
    async def metrics(request: ControlRequest) -> Response:
        await _require_root(gateway, request)  # like the admin stats (Prometheus sends the bearer token)
        with contextlib.suppress(TimeoutError):  # kvgw_readiness: fresh, unless the checks hang
            await asyncio.wait_for(asyncio.shield(readiness.current()), METRICS_READINESS_WAIT)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return api


CONTROL_CODES = {400: "InvalidRequest", 401: "Unauthorized", 403: "AccessDenied", 404: "NotFound",
                 405: "MethodNotAllowed", 422: "InvalidRequest"}


def _json_errors(api: FastAPI) -> None:
    """Control-plane errors in kvgw's one error form, with a request id (FastAPI's is ``{"detail"}``)."""

    def answer(request: ControlRequest, status: int, message: str,
               headers: Mapping[str, str] | None = None) -> JSONResponse:
        request_id = request.scope.get(REQUEST_ID) or new_request_id()
        body = {"error": {"code": CONTROL_CODES.get(status, "InternalError" if status >= 500 else "InvalidRequest"),
                          "message": message, "request_id": request_id}}
        return JSONResponse(body, status_code=status, headers={**(headers or {}), "x-kvgw-request-id": request_id})

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: ControlRequest, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, exc.status_code, str(exc.detail), exc.headers)

    @api.exception_handler(RequestValidationError)
    async def validation_error(request: ControlRequest, exc: RequestValidationError) -> JSONResponse:
        return answer(request, 422, "; ".join(str(e.get("msg")) for e in exc.errors()))


def with_request_id(app: Any) -> Any:
    """``app`` with a request id on every HTTP response it sends (``x-kvgw-request-id``, unless the
    response set it), in the scope (``REQUEST_ID``, for error bodies) and on every record logged while
    it runs (``gateway.logs``), as the data plane's requests have."""

    async def tagged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request_id = new_request_id()
        scope[REQUEST_ID] = request_id
        header = (b"x-kvgw-request-id", request_id.encode())

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == header[0] for name, _ in headers):
                    headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await app(scope, receive, send_tagged)
        finally:
            current_request_id.reset(token)

    return tagged


async def _require_root(gateway: Gateway, request: ControlRequest) -> None:
    """Root credentials, checked as the native API checks any: ``Directory.authenticate`` (a key not
    in the view yet is looked up in the catalog before it is refused)."""
    try:
        principal = await gateway.directory.authenticate(request.headers.get("authorization"))
    except KvgwError as exc:
        raise HTTPException(401, "invalid credentials") from exc
    if principal.access_key is None and not principal.is_root:
        raise HTTPException(401, "root credentials required")  # anonymous: credentials would help
    if not principal.is_root:
        raise HTTPException(403, "root credentials required")


class GatewayApp:
    """The ASGI callable kvgw's HTTP server (``gateway.dataplane``) runs. Owns the Gateway's lifecycle
    through ASGI lifespan."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        settings = gateway.settings
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(self.registry)
        self.registry.register(StatsCollector(lambda: gateway_stats(gateway)))
        self.readiness = ReadinessCache(Readiness(gateway))
        self.registry.register(ReadinessCollector(lambda: self.readiness.last))
        self.loop_watch = LoopWatch(self.registry, threshold=settings.loop_stall_seconds)
        native = NativeAPI(gateway.service, gateway.directory, body_idle_timeout=settings.body_idle_timeout,
                           lookups=self.metrics.count_lookup, changes=gateway.changes)
        calls = native.calls
        self.native = self.metrics.wrap("native", native,
                                        lambda scope: native_op(scope["method"], scope["path"], calls))
        control = with_request_id(build_control_plane(gateway, self.registry, self.readiness))
        self.control = self.metrics.wrap("control", control, lambda scope: str(scope["path"]))
        self.s3_api = S3API(
            gateway.service, gateway.directory,
            BucketService(gateway.catalog, gateway.directory, gateway.index,
                          new_policy=functools.partial(new_bucket_policy, settings=settings)),
            MultipartStore(settings.fs_root_path, fsync=settings.fsync),
            settings,
        )
        self.s3 = self.metrics.wrap("s3", self.s3_api, lambda scope: str(scope.get("kvgw.op", "unknown")))
        self._native_api = native
        # answers index-only lookups inside the HTTP protocol (gateway.dataplane.lane; serve.run_worker installs it)
        self.lane = LookupLane(self, self.metrics) if settings.lookup_lane else None

    @staticmethod
    def api_of(path: str) -> str:
        """Which API serves a request for ``path`` (decoded): "native", "control" or "s3"."""
        if path.startswith(BUCKETS_PREFIX):
            return "native"
        if path.startswith(CONTROL_PREFIX) or path in CONTROL_PATHS:
            return "control"
        return "s3"

    def takes_indexed(self, method: str, raw_path: str) -> bool:
        """Whether ``answer_indexed`` could answer this request (its body not seen yet)."""
        api = self.api_of(path_segment(raw_path, errors="replace"))
        if api == "native":
            return self._native_api.takes_indexed(method, raw_path)
        return api == "s3" and method == "HEAD"

    def answer_indexed(self, method: str, raw_path: str, headers: RawHeaders, body: bytes,
                       notes: dict[str, Any]) -> tuple[str, IndexedAnswer] | None:
        """(API, answer) for a lookup its API answers without awaiting anything (native HEAD, exists
        and prefix; S3 HeadObject), or None: the request must go to ``__call__``, with ``notes`` (work
        already done, such as a verified signature) added to its scope. Never raises."""
        api = self.api_of(path_segment(raw_path, errors="replace"))
        if api == "native":
            found = self._native_api.answer_indexed(method, raw_path, headers, body)
        elif api == "s3" and not body:
            found = self.s3_api.answer_indexed(method, raw_path, headers, notes)
        else:
            return None
        return None if found is None else (api, found)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            api = self.api_of(scope["path"])
            if api == "native":
                await self.native(scope, receive, send)
            elif api == "control":
                await self.control(scope, receive, send)
            else:
                await self.s3(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.control(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gateway.start()
                    await self.s3_api.start()
                    if self.loop_watch.threshold > 0:
                        self.loop_watch.start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.loop_watch.stop()
                try:
                    await self.s3_api.stop()
                    await self.gateway.stop()
                finally:
                    self.gateway.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(settings: Settings) -> GatewayApp:
    return GatewayApp(Gateway(settings))
