"""The ASGI application: a thin dispatcher in front of the data-plane APIs and the FastAPI control plane.

    /v1/buckets/...                         native chunk API (raw ASGI, hot path)
    /healthz /readyz /v1/admin/... /docs    FastAPI (control plane, OpenAPI)
    everything else                         S3-compatible API (raw ASGI, gateway.api.s3.app)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from gateway.api.http import Receive, Scope, Send
from gateway.api.native import BUCKETS_PREFIX, NativeAPI
from gateway.api.s3.app import S3API
from gateway.buckets import BucketService
from gateway.config import Settings
from gateway.multipart import MultipartStore
from gateway.runtime import Gateway

log = logging.getLogger("kvgw")

CONTROL_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
CONTROL_PREFIX = "/v1/"  # "v1" is no valid bucket name, so S3 paths never start with it


def build_control_plane(gateway: Gateway) -> FastAPI:
    api = FastAPI(title="kvgw", version="0.1.0", description="KV-cache storage gateway: control plane")
    ready_cache: dict[str, Any] = {"at": 0.0, "ok": False, "detail": {}}

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz() -> JSONResponse:
        now = time.monotonic()
        if now - ready_cache["at"] > 1.0:
            ok, detail = await asyncio.to_thread(_readiness, gateway)
            ready_cache.update(at=now, ok=ok, detail=detail)
        status = 200 if ready_cache["ok"] else 503
        return JSONResponse({"ready": ready_cache["ok"], "checks": ready_cache["detail"]}, status_code=status)

    @api.get("/v1/admin/buckets")
    async def list_buckets(request: Request) -> dict[str, Any]:
        _require_root(gateway, request)
        return {"buckets": [b.name for b in gateway.directory.buckets()]}

    @api.get("/v1/admin/stats")
    async def stats(request: Request) -> dict[str, Any]:
        _require_root(gateway, request)
        service, lifecycle = gateway.service, gateway.lifecycle
        return {
            "chunks_indexed": gateway.index.count(),
            "write_through_pending": gateway.index.pending_count(),
            "usage": lifecycle.usage_report(),
            "lifecycle": {k: v for k, v in vars(lifecycle.totals).items() if isinstance(v, int)},
            "moved_bytes": dict(service.moved_bytes),
            "promotions": service.promotions,
            "write_through_skipped": service.write_through_skipped,
        }

    return api


def _require_root(gateway: Gateway, request: Request) -> None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    try:
        principal = (
            gateway.directory.authenticate_bearer(token.strip()) if scheme.lower() == "bearer"
            else gateway.directory.anonymous
        )
    except Exception as exc:
        raise HTTPException(401, "invalid credentials") from exc
    if not principal.is_root:
        raise HTTPException(403, "root credentials required")


def _readiness(gateway: Gateway) -> tuple[bool, dict[str, str]]:
    checks: dict[str, str] = {}
    try:
        gateway.index.count()
        checks["index"] = "ok"
    except Exception as exc:
        checks["index"] = f"error: {type(exc).__name__}"
    try:
        probe = gateway.settings.fs_root_path / "staging"
        checks["fs"] = "ok" if probe.is_dir() else "missing staging directory"
    except OSError as exc:
        checks["fs"] = f"error: {exc.strerror}"
    try:
        gateway.catalog.list_buckets()
        checks["catalog"] = "ok"
    except Exception as exc:
        checks["catalog"] = f"error: {type(exc).__name__}"
    return all(v == "ok" for v in checks.values()), checks


class GatewayApp:
    """The ASGI callable uvicorn runs. Owns the Gateway's lifecycle through ASGI lifespan."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.native = NativeAPI(gateway.service, gateway.directory)
        self.control = build_control_plane(gateway)
        settings = gateway.settings
        self.s3 = S3API(
            gateway.service, gateway.directory,
            BucketService(gateway.catalog, gateway.directory, gateway.index, max_chunk_bytes=settings.max_chunk_bytes),
            MultipartStore(settings.fs_root_path, fsync=settings.fsync),
            settings,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path.startswith(BUCKETS_PREFIX):
                await self.native(scope, receive, send)
            elif path.startswith(CONTROL_PREFIX) or path in CONTROL_PATHS:
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
                    await self.s3.start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.s3.stop()
                    await self.gateway.stop()
                finally:
                    self.gateway.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(settings: Settings) -> GatewayApp:
    return GatewayApp(Gateway(settings))
