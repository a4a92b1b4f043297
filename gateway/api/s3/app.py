"""The S3-compatible API: a raw ASGI application over the chunk service, beside the native API.

Per request: addressing (``routing``: virtual-hosted, path-style, LMCache's bare ``/<key>``) →
authentication (SigV4 header or presigned URL, verified against the catalog's credentials; no
credentials at all is the anonymous principal, whose rights come from the bucket's policy) →
operation (method + subresources) → handler (``buckets``, ``objects``, ``uploads``). Handlers call
``ChunkService``, ``BucketService`` and ``MultipartStore``, the same service layer as the native API,
so an object written here is a chunk there and the other way round.

Errors: handlers raise ``S3Error`` or a domain ``KvgwError``; ``to_s3`` maps domain errors to S3
codes through ``DOMAIN_CODES`` (keyed by class) and ``errors.error_response`` renders S3's XML.
Nothing else picks a status for an error. Every response carries ``x-amz-request-id``; a 500 never
carries a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import errors
from gateway.access import Directory, Principal
from gateway.api.http import (
    RETRIED,
    IndexedAnswer,
    Message,
    RawHeaders,
    Receive,
    Request,
    ResponseState,
    Scope,
    Send,
)
from gateway.api.s3 import auth as sigv4_auth
from gateway.api.s3.auth import AuthResult
from gateway.api.s3.buckets import BucketHandlers
from gateway.api.s3.common import DRAIN_LIMIT, Call, S3Services, client_retried
from gateway.api.s3.errors import ERRORS, InvalidAccessKeyId, S3Error, error_response
from gateway.api.s3.objects import ObjectHandlers
from gateway.api.s3.routing import Addressing, Target, operation, parse_query
from gateway.api.s3.uploads import UploadHandlers
from gateway.buckets import BucketService
from gateway.config import Settings
from gateway.errors import InvalidRange, KvgwError, NoSuchChunk
from gateway.multipart import MultipartStore
from gateway.service import ChunkService

log = logging.getLogger("kvgw.s3")

VERIFIED = "kvgw.s3.verified"
"""ASGI scope key: (AuthResult | None, Principal) of a request the lookup lane authenticated."""


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _no_send(message: Message) -> None:
    raise AssertionError("an indexed answer is returned, never sent")

Handler = Callable[[Call], Awaitable[None]]

# Domain error -> S3 error code (its status and default message are in ``errors.ERRORS``). Keyed by
# class; ``tests/unit/test_error_tables.py`` checks every domain error is listed.
DOMAIN_CODES: dict[type[KvgwError], str] = {
    errors.KvgwError: "InternalError",
    errors.NoSuchBucket: "NoSuchBucket",
    errors.NoSuchChunk: "NoSuchKey",
    errors.InvalidKey: "InvalidArgument",
    errors.InvalidRequest: "InvalidRequest",
    errors.IncompleteBody: "IncompleteBody",
    errors.BadDigest: "BadDigest",
    errors.InvalidRange: "InvalidRange",
    errors.MissingContentLength: "MissingContentLength",
    errors.ChunkTooLarge: "EntityTooLarge",
    errors.EmptyChunk: "MissingRequestBodyError",
    errors.PreconditionFailed: "PreconditionFailed",
    errors.Unauthorized: "AccessDenied",
    errors.AccessDenied: "AccessDenied",
    errors.InsufficientStorage: "ServiceUnavailable",
    errors.Declined: "ServiceUnavailable",  # S3 writes are never declined (gateway.lifecycle.admission)
    errors.ServiceUnavailable: "ServiceUnavailable",
    errors.InternalError: "InternalError",
    errors.NoSuchUpload: "NoSuchUpload",
    errors.InvalidPart: "InvalidPart",
    errors.EntityTooSmall: "EntityTooSmall",
    errors.InvalidBucketName: "InvalidBucketName",
    errors.BucketAlreadyOwned: "BucketAlreadyOwnedByYou",
    errors.BucketNotEmpty: "BucketNotEmpty",
    # the native API's routing errors; the S3 front end never raises them
    errors.MethodNotAllowed: "MethodNotAllowed",
    errors.NotFound: "InternalError",
}


def s3_code(exc: KvgwError) -> str:
    """The S3 code of ``exc``: its class's, else its nearest listed base's."""
    return next(DOMAIN_CODES[cls] for cls in type(exc).__mro__ if cls in DOMAIN_CODES)


def to_s3(exc: KvgwError, target: Target) -> S3Error:
    """The S3 answer for a domain error (most specific data first: key, bucket, range)."""
    code = s3_code(exc)
    specific = exc.message != type(exc).default_message and code not in ("InternalError", "ServiceUnavailable")
    message = exc.message if specific else None
    if code == "NoSuchKey" and target.key is not None:
        return S3Error(code, Key=target.key)
    if code in ("NoSuchBucket", "BucketNotEmpty", "BucketAlreadyOwnedByYou", "InvalidBucketName"):
        return S3Error(code, message if code != "NoSuchBucket" else None, BucketName=target.bucket or "")
    if isinstance(exc, InvalidRange):
        return S3Error(code, headers={"Content-Range": f"bytes */{exc.size}"}, ActualObjectSize=exc.size)
    return S3Error(code, message)


class S3API:
    """The ASGI callable for every request that is not the native API or the control plane."""

    def __init__(self, service: ChunkService, directory: Directory, buckets: BucketService,
                 multipart: MultipartStore, settings: Settings, *, clock: Callable[[], float] = time.time) -> None:
        self.gw = S3Services(service, directory, buckets, multipart, settings)
        self.directory = directory
        self.settings = settings
        self.clock = clock
        self.addressing = Addressing(settings.s3_api_base_domain, settings.s3_default_bucket)
        objects, bucket_ops, uploads = ObjectHandlers(self.gw), BucketHandlers(self.gw), UploadHandlers(self.gw)
        self.objects = objects
        self.handlers: dict[str, Handler] = {
            "ListBuckets": bucket_ops.list_buckets,
            "CreateBucket": bucket_ops.create_bucket,
            "HeadBucket": bucket_ops.head_bucket,
            "DeleteBucket": bucket_ops.delete_bucket,
            "GetBucketLocation": bucket_ops.get_bucket_location,
            "ListObjects": bucket_ops.list_objects,
            "ListObjectsV2": bucket_ops.list_objects_v2,
            "PutObject": objects.put_object,
            "GetObject": objects.get_object,
            "HeadObject": objects.head_object,
            "DeleteObject": objects.delete_object,
            "DeleteObjects": objects.delete_objects,
            "CreateMultipartUpload": uploads.create,
            "UploadPart": uploads.upload_part,
            "CompleteMultipartUpload": uploads.complete,
            "AbortMultipartUpload": uploads.abort,
            "ListParts": uploads.list_parts,
            "ListMultipartUploads": uploads.list_uploads,
        }
        self._sweeper: asyncio.Task[None] | None = None

    # -- lifecycle (the stale-upload sweeper) --------------------------------------------------

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvgw-s3-multipart-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep_forever(self) -> None:
        while True:
            try:
                removed = await self.gw.multipart.sweep(max_age=self.settings.s3_api_multipart_max_age_seconds)
                if removed:
                    log.info("removed %d stale or completed multipart uploads", removed)
            except Exception:
                log.exception("multipart sweep failed")
            await asyncio.sleep(self.settings.s3_api_sweep_interval_seconds)

    # -- requests ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = Request(scope, receive)
        state = ResponseState(send)
        target = Target(None, None)
        if client_retried(req):
            scope[RETRIED] = True  # for the request metrics
        try:
            target = self.addressing.target(req.header("host"), req.raw_path)
            query = parse_query(req.query_string)
            verified = scope.get(VERIFIED)  # by the lookup lane, for this very request
            auth, principal = verified if verified is not None else await self._authenticate(req)
            op = operation(req.method, target, query, req.headers)
            scope["kvgw.op"] = op  # for the request metrics (gateway.metrics)
            call = Call(req, state.send, target, query, principal, auth,
                        idle_timeout=self.settings.body_idle_timeout, operation=op)
            handler = self.handlers.get(op)
            if handler is None:
                raise S3Error("NotImplemented", "This operation is not implemented by kvgw's S3 API.")
            await handler(call)
        except S3Error as exc:
            await self._send_error(req, state, exc)
        except KvgwError as exc:
            await self._send_error(req, state, to_s3(exc, target))
        except Exception:
            log.exception("unhandled error in S3 %s %s (request %s)", req.method, req.raw_path, req.request_id)
            await self._send_error(req, state, S3Error("InternalError"))

    def answer_indexed(self, method: str, raw_path: str, headers: RawHeaders,
                       notes: dict[str, Any]) -> IndexedAnswer | None:
        """A HeadObject's answer when the directory's view, the index and the attrs cache hold all it
        needs, computed without awaiting anything, for the lookup lane (``gateway.dataplane.lane``); the
        signature is verified as always. None when the request needs anything more (any error, a query
        string, a credential, bucket or chunk not in view): nothing was counted or changed then, and
        ``__call__`` must answer it. Never raises.

        A signature verified here is not verified twice: it goes into ``notes``, which the lane puts
        into the request's ASGI scope when it hands the request over (most of vLLM's HEADs are misses,
        and SigV4 is most of what a miss costs before the tiers are asked)."""
        if method != "HEAD":
            return None
        req = Request({"method": method, "raw_path": raw_path.encode("latin-1"), "query_string": b"",
                       "headers": headers}, _no_body)
        try:
            target = self.addressing.target(req.header("host"), req.raw_path)
            if operation(method, target, {}, req.headers) != "HeadObject":
                return None
            claim = self._claim(req)
            auth, principal = (None, self.directory.anonymous) if claim is None else self._verified(claim)
            notes[VERIFIED] = (auth, principal)
            found = self.objects.head_indexed(Call(req, _no_send, target, {}, principal, auth))
        except NoSuchChunk as exc:  # certainly absent: the answer, as __call__ would give it
            return self._error_answer(req, to_s3(exc, target))._replace(op="HeadObject", retried=client_retried(req))
        except (S3Error, KvgwError):
            return None
        if found is None:
            return None
        status, answer_headers = found
        return IndexedAnswer("HeadObject", answer_headers, b"", status, client_retried(req))

    async def _authenticate(self, req: Request) -> tuple[AuthResult | None, Principal]:
        claim = self._claim(req)
        if claim is None:
            return None, self.directory.anonymous
        await self.directory.knows(claim.access_key)  # created a moment ago: re-read the catalog first
        return self._verified(claim)

    def _claim(self, req: Request) -> sigv4_auth.SignedRequest | None:
        """The request's SigV4 claim, parsed and its clock checked; None for an unsigned request."""
        signed = req.header("authorization") is not None or "X-Amz-" in req.query_string or \
            "AWSAccessKeyId=" in req.query_string
        if not signed:
            return None
        return sigv4_auth.parse_request(req.method, req.raw_path.encode("latin-1"), req.query_string,
                                        req.scope["headers"], now=self.clock())

    def _verified(self, claim: sigv4_auth.SignedRequest) -> tuple[AuthResult, Principal]:
        """The claim checked against the view's secret for its access key (InvalidAccessKeyId: none)."""
        secret = self.directory.secret_for(claim.access_key)
        if secret is None:
            raise InvalidAccessKeyId(AWSAccessKeyId=claim.access_key)
        return sigv4_auth.verify(claim, secret), self.directory.principal_for(claim.access_key)

    async def _send_error(self, req: Request, state: ResponseState, exc: S3Error) -> None:
        if state.started:
            log.warning("S3 request %s failed after its response started: %s", req.request_id, exc.code)
            return
        answer = self._error_answer(req, exc)
        headers = answer.headers
        if not await req.drain(DRAIN_LIMIT):
            headers.insert(-1, (b"connection", b"close"))  # before content-length, as it always was
        await state.send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await state.send({"type": "http.response.body", "body": answer.body})

    @staticmethod
    def _error_answer(req: Request, exc: S3Error) -> IndexedAnswer:
        """S3's XML error answer to ``req`` (content-length included)."""
        if exc.status >= 500 and exc.code not in ERRORS:
            exc = S3Error("InternalError")
        answer = error_response(exc, resource=req.raw_path, request_id=req.request_id, head=req.method == "HEAD")
        headers = answer.headers
        headers.append((b"x-amz-id-2", req.request_id.encode()))
        headers.append((b"content-length", str(len(answer.body)).encode()))
        return IndexedAnswer("error", headers, answer.body, answer.status)
