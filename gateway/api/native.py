"""The native chunk API (v1), as a raw ASGI application over the chunk service.

    PUT    /v1/buckets/{bucket}/chunks/{key}    201 stored | 200 + X-Kvgw-Existed (write-once)
    GET    /v1/buckets/{bucket}/chunks/{key}    bytes; one Range (206 / 416)
    HEAD   /v1/buckets/{bucket}/chunks/{key}
    DELETE /v1/buckets/{bucket}/chunks/{key}    root, or a credential with a delete grant on the bucket
    POST   /v1/buckets/{bucket}/exists          {"keys": [...]} -> {"exists": [bool, ...]}
    POST   /v1/buckets/{bucket}/prefix          {"keys": [...]} -> {"length": n}
    POST   /v1/buckets/{bucket}/batch-get       {"keys": [...]} -> framed stream (kvgw_client.wire)
    POST   /v1/buckets/{bucket}/prefetch        {"keys": [...]} -> {"accepted", "local", "missing"}
    POST   /v1/buckets/{bucket}/touch           {"keys": [...]} -> {"touched": n} (reads done elsewhere)
    POST   /v1/buckets/{bucket}/locate          {"keys": [...]} -> {"chunks": [location | null, ...]}
    POST   /v1/buckets/{bucket}/list            {"prefix", "after", "limit"} -> {"keys": [...], "truncated"}
    POST   /v1/buckets/{bucket}/changes         {"prefix", "after", "limit"} -> {"changes": [...], "cursor",
                                                 "head", "reset"} (the change stream: gateway.cluster.changes)
    POST   /v1/buckets/{bucket}/damaged         {"keys": [...]} -> {"quarantined": n} (a verifying reader's report)
    POST   /v1/buckets/{bucket}/hints           {"hint", "keys": [...]} -> {"applied": n} (engine hints)

GET and batch-get from a client that sends ``x-kvgw-verify: xxh3`` (it checks every chunk against its
checksum, as kvgw's client does) are answered without verifying here: the bytes go from the page
cache to the socket by ``sendfile`` (``ChunkService.open_info``'s ``reader_verifies``); other readers
(curl, S3 SDKs) get bytes verified here before the first one leaves.

A PUT may carry ``X-Kvgw-Retention`` (a retention class: ``shared``, ``normal``, ``one-off``). A PUT that
admission declines (the tier at its watermarks, the chunk predicted to be read again less than what it
would evict: ``gateway.lifecycle.admission``) answers 507 with code ``Declined`` and
``X-Kvgw-Declined: <reason>``: nothing was stored, and it is no failure of the gateway.

``exists``, ``prefix`` and ``locate`` take ``"lease_ms": n`` beside ``keys``: the chunks found are
read-leased for up to n ms (capped by the bucket's ``max_lease_ms``), so the lifecycle leaves them until
they are loaded (``gateway.leases``). The answer then carries ``"lease": {"granted_ms", "chunks",
"bytes"}``, plus ``"refused": why`` when no lease was taken (the bucket's leased-bytes cap, leases off,
the lease table unreachable): the lookup's answer stands either way.

Keys are the percent-encoded rest of the path after ``chunks/`` (they may contain ``/``). Errors are
``{"error": {"code", "message", "request_id"}}`` with the status from ``STATUS`` (keyed by error
class); nothing else in this module chooses a status for an error. A 500 never carries a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from backends.catalog.store import BucketPolicy
from backends.tiers import TierId
from gateway import errors
from gateway.access import Action, Directory
from gateway.api.frames import FrameSender
from gateway.api.http import (
    Headers,
    IndexedAnswer,
    RawHeaders,
    Receive,
    Request,
    ResponseState,
    Scope,
    Send,
    http_date,
    json_body,
    new_request_id,
    parse_range,
    parse_ttl,
    path_segment,
    send_body,
    send_response,
    sends_files,
    takes_parts,
)
from gateway.buckets import check_chunk_size
from gateway.chunks import ChunkBody, ChunkInfo, ChunkLocation
from gateway.cluster.changes import MAX_CHANGES, ChangeStream
from gateway.errors import (
    Declined,
    InternalError,
    InvalidKey,
    InvalidRange,
    InvalidRequest,
    KvgwError,
    MethodNotAllowed,
    NoSuchChunk,
    NotFound,
    PreconditionFailed,
)
from gateway.hints import parse_hint, parse_retention
from gateway.leases import MAX_LEASE_MS, LeaseGrant
from gateway.service import ChunkService
from kvgw_client import wire
from kvgw_client.keys import InvalidKeyError, is_valid_bucket_name, validate_key
from kvgw_client.wire import Hint

log = logging.getLogger("kvgw.api")

# The one table from domain error to status (``tests/unit/test_error_tables.py`` checks it is complete).
STATUS: dict[type[KvgwError], int] = {
    errors.KvgwError: 500,
    errors.NoSuchBucket: 404,
    errors.NoSuchChunk: 404,
    errors.NotFound: 404,
    errors.InvalidKey: 400,
    errors.InvalidRequest: 400,
    errors.IncompleteBody: 400,
    errors.BadDigest: 400,
    errors.InvalidRange: 416,
    errors.MissingContentLength: 411,
    errors.ChunkTooLarge: 413,
    errors.EmptyChunk: 400,
    errors.PreconditionFailed: 412,
    errors.Unauthorized: 401,
    errors.AccessDenied: 403,
    errors.MethodNotAllowed: 405,
    errors.InsufficientStorage: 507,
    errors.Declined: 507,  # with X-Kvgw-Declined: admission under pressure, not a failure
    errors.ServiceUnavailable: 503,
    errors.InternalError: 500,
    # raised by the S3 API's uploads and bucket calls only; statuses as S3 answers them
    errors.NoSuchUpload: 404,
    errors.InvalidPart: 400,
    errors.EntityTooSmall: 400,
    errors.InvalidBucketName: 400,
    errors.BucketAlreadyOwned: 409,
    errors.BucketNotEmpty: 409,
}


def status_for(exc: KvgwError) -> int:
    """The status of ``exc``: its class's, else its nearest listed base's."""
    return next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)


MAX_JSON_BYTES = 8 << 20
MAX_KEYS_PER_CALL = 100_000
MAX_LIST_KEYS = 1000
ERROR_DRAIN_LIMIT = 8 << 20
BUCKETS_PREFIX = "/v1/buckets/"


Handler = Callable[[Request, Send, str, str], Awaitable[None]]


IndexedHandler = Callable[[str, str | None, str, str, bytes], IndexedAnswer | None]


LookupCounter = Callable[[str, int, int], None]


class NativeAPI:
    def __init__(self, service: ChunkService, directory: Directory, *, body_idle_timeout: float = 60.0,
                 lookups: LookupCounter = lambda op, hits, misses: None,
                 changes: ChangeStream | None = None) -> None:
        """``body_idle_timeout``: seconds a PUT body may stall before the upload is dropped;
        ``lookups(op, hits, misses)`` is told the outcome of every HEAD, exists and prefix (metrics);
        ``changes``: the change stream (None when the cluster feed is off: ``changes`` is then refused)."""
        self.service = service
        self.directory = directory
        self.changes = changes
        self.body_idle_timeout = body_idle_timeout
        self._lookups = lookups
        self._chunk_handlers: dict[str, Handler] = {
            "GET": self._get,
            "HEAD": self._head,
            "PUT": self._put,
            "DELETE": self._delete,
        }
        self._post_handlers: dict[str, Handler] = {
            "exists": self._exists,
            "prefix": self._prefix,
            "batch-get": self._batch_get,
            "prefetch": self._prefetch,
            "touch": self._touch,
            "locate": self._locate,
            "list": self._list,
            "changes": self._changes,
            "damaged": self._damaged,
            "hints": self._hints,
        }
        # what the lookup lane (``gateway.dataplane.lane``) may answer without an ASGI request cycle
        self._indexed_chunk_handlers: dict[str, IndexedHandler] = {"HEAD": self._head_indexed}
        self._indexed_post_handlers: dict[str, IndexedHandler] = {
            op: functools.partial(self._lookup_indexed, op) for op in ("exists", "prefix")}

    @property
    def calls(self) -> frozenset[str]:
        """The batch calls (``POST /v1/buckets/{bucket}/<call>``) this API answers."""
        return frozenset(self._post_handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = Request(scope, receive)
        state = ResponseState(send)
        try:
            handler, bucket, key = _route(req.method, req.raw_path, self._chunk_handlers, self._post_handlers)
            await handler(req, state.send, bucket, key)
        except KvgwError as exc:
            await self._send_error(req, state, exc)
        except Exception:
            log.exception("unhandled error in %s %s (request %s)", req.method, req.raw_path, req.request_id)
            await self._send_error(req, state, InternalError())

    def answer_indexed(self, method: str, raw_path: str, headers: RawHeaders, body: bytes) -> IndexedAnswer | None:
        """The answer to a HEAD, exists or prefix that the index and the in-memory views give in full,
        computed without awaiting anything, for the lookup lane (``gateway.dataplane.lane``).

        None when the request needs anything more: any error, a credential or bucket the view does not
        hold yet, a miss only a tier's answer settles (``Tier.absent_now``), a lease. Nothing was
        counted or changed then, and the request must be answered by this API's ASGI path, the one
        place that decides errors and misses. Never raises."""
        authorization: str | None = None
        for name, value in headers:
            if name == b"authorization":
                if authorization is not None:
                    return None  # repeated: the ASGI path joins them (and refuses the result)
                authorization = value.decode("latin-1")
        try:
            handler, bucket, key = _route(method, raw_path, self._indexed_chunk_handlers,
                                          self._indexed_post_handlers)
            return handler(new_request_id(), authorization, bucket, key, body)
        except KvgwError:
            return None

    def takes_indexed(self, method: str, raw_path: str) -> bool:
        """Whether ``answer_indexed`` could answer this request (its body not seen yet)."""
        if not raw_path.startswith(BUCKETS_PREFIX):
            return False
        if method == "HEAD":
            return "/chunks/" in raw_path
        return method == "POST" and raw_path.rpartition("/")[2] in self._indexed_post_handlers

    # -- helpers -------------------------------------------------------------------------------

    async def _authorized_bucket(self, req: Request, name: str, action: Action) -> BucketPolicy:
        principal = await self.directory.authenticate(req.header("authorization"))
        bucket = await self.service.bucket(_valid_bucket_name(name))
        self.directory.authorize(principal, bucket, action)
        return bucket

    def _authorized_bucket_in_view(self, authorization: str | None, name: str, action: Action) -> BucketPolicy | None:
        """``_authorized_bucket`` from the directory's view as it is (None: the bucket is not in it);
        a credential it does not hold raises, like a wrong one (the ASGI path re-reads the catalog)."""
        principal = self.directory.authenticate_bearer(authorization)
        bucket = self.directory.bucket_in_view(_valid_bucket_name(name))
        if bucket is not None:
            self.directory.authorize(principal, bucket, action)
        return bucket

    def _base_headers(self, req: Request) -> Headers:
        return [(b"x-kvgw-request-id", req.request_id.encode())]

    def _chunk_headers(self, request_id: str, info: ChunkInfo, tier: TierId | None = None) -> Headers:
        headers: Headers = [(b"x-kvgw-request-id", request_id.encode())]
        headers += [
            (b"content-type", wire.CHUNK_CONTENT_TYPE.encode()),
            (b"etag", info.etag.encode()),
            (wire.H_CHECKSUM.encode(), info.checksum_hex.encode()),
            (b"last-modified", http_date(info.created).encode()),
            (b"accept-ranges", b"bytes"),
            (wire.H_TIER.encode(), (tier or info.tier).label.encode()),
        ]
        return headers

    async def _send_error(self, req: Request, state: ResponseState, exc: KvgwError) -> None:
        if state.started:
            log.warning("request %s failed after its response started: %s", req.request_id, exc.code)
            return
        answer = _error_answer(req.method, req.request_id, exc)
        headers = answer.headers
        if not await req.drain(ERROR_DRAIN_LIMIT):
            headers.append((b"connection", b"close"))
        if req.method == "HEAD":
            await state.send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await state.send({"type": "http.response.body", "body": b""})
        else:
            await send_response(state.send, answer.status, headers, answer.body)

    async def _keys(self, req: Request) -> list[str]:
        return (await self._lookup_body(req, leasable=False))[0]

    async def _lookup_body(self, req: Request, *, leasable: bool = True) -> tuple[list[str], int]:
        """``{"keys": [...]}``, and for lookups an optional ``"lease_ms"`` (0 when absent)."""
        return _lookup_doc(await req.read_body(MAX_JSON_BYTES), leasable=leasable)

    # -- chunk handlers ------------------------------------------------------------------------

    async def _put(self, req: Request, send: Send, bucket_name: str, key: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.WRITE)
        length = req.content_length()
        checksum = _parse_checksum(req.header(wire.H_CHECKSUM))
        md5 = _parse_md5(req.header("content-md5"))
        ttl = parse_ttl(req.header(wire.H_TTL))
        parent = _parse_parent(req.header(wire.H_PARENT))
        marks = parse_retention(req.header(wire.H_RETENTION))
        check_chunk_size(bucket, length)
        existing = await self.service.lookup_for_write(bucket, key)
        if existing is not None:
            if (req.header("if-none-match") or "").strip() == "*":
                await req.drain(bucket.max_chunk_bytes)
                raise PreconditionFailed("the key already exists")
            self.service.touch(bucket, [key])  # offered again: a use, as the trace simulator counts it
            await self._send_existed(req, send, existing, drain_limit=bucket.max_chunk_bytes)
            return
        try:
            self.service.admit(bucket, marks)
        except Declined:
            await req.drain(bucket.max_chunk_bytes)  # read it all: a client still sending sees the answer
            raise
        result = await self.service.put(
            bucket, key, req.body(self.body_idle_timeout),
            length=length, checksum=checksum, md5=md5, ttl=ttl, parent=parent, threaded=req.threaded_body(),
            marks=marks,
        )
        if not result.created:
            self.service.touch(bucket, [key])
            await self._send_existed(req, send, result.info, drain_limit=0)
            return
        headers = self._base_headers(req)
        headers += [(b"etag", result.info.etag.encode()),
                    (wire.H_CHECKSUM.encode(), result.info.checksum_hex.encode())]
        await send_response(send, 201, headers)

    async def _send_existed(self, req: Request, send: Send, info: ChunkInfo, drain_limit: int) -> None:
        headers = self._base_headers(req)
        headers += [(b"etag", info.etag.encode()), (wire.H_CHECKSUM.encode(), info.checksum_hex.encode()),
                    (wire.H_EXISTED.encode(), b"true")]
        if not await req.drain(drain_limit):
            headers.append((b"connection", b"close"))
        await send_response(send, 200, headers)

    async def _head(self, req: Request, send: Send, bucket_name: str, key: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        try:
            info = await self.service.head(bucket, key)
        except NoSuchChunk:
            self._lookups("head", 0, 1)
            raise
        self._lookups("head", 1, 0)
        headers = self._chunk_headers(req.request_id, info)
        headers.append((b"content-length", str(info.size).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    def _head_indexed(self, request_id: str, authorization: str | None, bucket_name: str, key: str,
                      _: bytes) -> IndexedAnswer | None:
        bucket = self._authorized_bucket_in_view(authorization, bucket_name, Action.READ)
        try:
            info = None if bucket is None else self.service.head_now(bucket, key)
        except NoSuchChunk as exc:
            self._lookups("head", 0, 1)
            return _error_answer("HEAD", request_id, exc)._replace(op="head_chunk")
        if info is None:
            return None
        self._lookups("head", 1, 0)
        headers = self._chunk_headers(request_id, info)
        headers.append((b"content-length", str(info.size).encode()))
        return IndexedAnswer("head_chunk", headers, b"")

    async def _get(self, req: Request, send: Send, bucket_name: str, key: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        byte_range = parse_range(req.header("range"))
        verifies = _reader_verifies(req)
        body = await self.service.open(bucket, key, byte_range, reader_verifies=verifies,
                                       as_file=verifies and sends_files(req.scope))
        try:
            headers = self._chunk_headers(req.request_id, body.info, body.tier)
            await send_body(send, headers, body, range_of=None if byte_range is None else body.info.size)
        finally:
            await body.close()

    async def _delete(self, req: Request, send: Send, bucket_name: str, key: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.DELETE)
        if not await self.service.delete(bucket, key):
            raise NoSuchChunk()
        await send_response(send, 204, self._base_headers(req))

    # -- batch handlers ------------------------------------------------------------------------

    async def _exists(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys, lease_ms = await self._lookup_body(req)
        both = self.service.exists_leased_now(bucket, keys, lease_ms) if lease_ms else None
        leased: Leased | None
        if both is not None:  # one index pass, the lease granted in memory
            found, leased = both
        else:
            found = await self.service.exists(bucket, keys)
            leased = await self.service.lease(bucket, _hits(keys, found), lease_ms) if lease_ms else None
        await self._send_json(req, send, self._exists_answer(keys, found, leased))

    async def _prefix(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys, lease_ms = await self._lookup_body(req)
        both = self.service.prefix_leased_now(bucket, keys, lease_ms) if lease_ms else None
        leased: Leased | None
        if both is not None:  # one index pass, the lease granted in memory
            length, leased = both
        else:
            length = await self.service.prefix(bucket, keys)
            leased = await self.service.lease(bucket, keys[:length], lease_ms) if lease_ms else None
        await self._send_json(req, send, self._prefix_answer(keys, length, leased))

    def _exists_answer(self, keys: list[str], found: list[bool], leased: Leased | None) -> dict[str, Any]:
        """``exists``'s answer (counted): a chunk a lease found removed a moment ago is absent."""
        answer: dict[str, Any] = {}
        if leased is not None:
            grant, absent = leased
            found = [hit and key not in absent for key, hit in zip(keys, found, strict=True)]
            answer["lease"] = grant.doc()
        hits = sum(found)
        self._lookups("exists", hits, len(found) - hits)
        return {"exists": found, **answer}

    def _prefix_answer(self, keys: list[str], length: int, leased: Leased | None) -> dict[str, Any]:
        """``prefix``'s answer (counted): the run ends at a chunk a lease found removed a moment ago."""
        answer: dict[str, Any] = {}
        if leased is not None:
            grant, absent = leased
            length = next((i for i, key in enumerate(keys[:length]) if key in absent), length)
            answer["lease"] = grant.doc()
        self._lookups("prefix", length, int(length < len(keys)))  # the run stops at its first miss
        return {"length": length, **answer}

    def _lookup_indexed(self, op: str, request_id: str, authorization: str | None, bucket_name: str, _: str,
                        body: bytes) -> IndexedAnswer | None:
        """``exists`` or ``prefix`` (``op``) without waiting: what ``_exists`` / ``_prefix`` answer, read
        leases included (granted in memory with the lookup's one index pass,
        ``ChunkService.exists_leased_now`` / ``prefix_leased_now``; None when only the awaited grant can
        answer: the request then takes the ASGI path)."""
        bucket = self._authorized_bucket_in_view(authorization, bucket_name, Action.READ)
        if bucket is None:
            return None
        keys, lease_ms = _lookup_doc(body)
        leased: Leased | None = None
        if op == "exists":
            if lease_ms:  # the lookup and its lease in one index pass
                both = self.service.exists_leased_now(bucket, keys, lease_ms)
                if both is None:
                    return None
                found, leased = both
            elif (plain := self.service.exists_now(bucket, keys)) is not None:
                found = plain
            else:
                return None
            return _json_answer(op, request_id, self._exists_answer(keys, found, leased))
        if lease_ms:
            run = self.service.prefix_leased_now(bucket, keys, lease_ms)
            if run is None:
                return None
            length, leased = run
        elif (plain_length := self.service.prefix_now(bucket, keys)) is not None:
            length = plain_length
        else:
            return None
        return _json_answer(op, request_id, self._prefix_answer(keys, length, leased))

    async def _prefetch(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Stage S3-held chunks into the filesystem tier ahead of reads; answers at once."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys = await self._keys(req)
        result = await self.service.prefetch(bucket, keys)
        await self._send_json(req, send, {"accepted": result.accepted, "local": result.local,
                                          "missing": result.missing})

    async def _touch(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Reads done elsewhere (direct reads of the tier directory) count for eviction too."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys = await self._keys(req)
        await self._send_json(req, send, {"touched": self.service.touch(bucket, keys)})

    async def _locate(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Where each chunk's file is, for clients that mount the filesystem tier (see docs/native-api.md)."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys, lease_ms = await self._lookup_body(req)
        located = await self.service.locate(bucket, keys)
        answer: dict[str, Any] = {}
        if lease_ms:
            grant, absent = await self.service.lease(
                bucket, [k for k, loc in zip(keys, located, strict=True) if loc is not None], lease_ms)
            located = [None if key in absent else loc for key, loc in zip(keys, located, strict=True)]
            answer["lease"] = grant.doc()
        await self._send_json(req, send, {"chunks": [_location_doc(loc) for loc in located], **answer})

    async def _damaged(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """A client that verifies what it reads (``x-kvgw-verify``) found chunks whose bytes do not match
        their checksum: each copy is verified here and quarantined if damaged, so the next read comes
        from another tier's copy (or is a miss)."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys = await self._keys(req)
        await self._send_json(req, send, {"quarantined": await self.service.report_damaged(bucket, keys)})

    async def _list(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Live keys under a prefix, strictly after ``after``, in UTF-8 byte order (S3's): for clients
        that remove what they stored (SGLang's ``clear()``). Continue with ``after`` = the last key
        while ``truncated``."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        doc = await req.read_json(MAX_JSON_BYTES)
        prefix = doc.get("prefix", "") if isinstance(doc, dict) else None
        after = doc.get("after") if isinstance(doc, dict) else None
        limit = doc.get("limit", MAX_LIST_KEYS) if isinstance(doc, dict) else None
        if (not isinstance(prefix, str) or not (after is None or isinstance(after, str))
                or isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_KEYS):
            raise InvalidRequest(f'body must be {{"prefix": string, "after": string, "limit": 1..{MAX_LIST_KEYS}}}')
        page = await self.service.list_page(bucket, prefix=prefix, after=after, max_keys=limit)
        await self._send_json(req, send, {"keys": [info.key for info in page.contents],
                                          "truncated": page.truncated})

    async def _hints(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Engine hints (``gateway.hints``): marks set on the named chunks, for eviction and admission.
        ``applied``: how many of the keys are stored (the others are ignored)."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.WRITE)
        hint, keys = _hints_doc(await req.read_body(MAX_JSON_BYTES))
        applied = await self.service.hint(bucket, keys, hint)
        await self._send_json(req, send, {"applied": applied})

    async def _changes(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """The bucket's changes under a prefix after a cursor (``gateway.cluster.changes``): what other
        clients stored and what the lifecycle removed. ``after`` null: from now on (the answer's cursor
        is the feed's head)."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        doc = await req.read_json(MAX_JSON_BYTES)
        prefix = doc.get("prefix", "") if isinstance(doc, dict) else None
        after = doc.get("after") if isinstance(doc, dict) else None
        limit = doc.get("limit", MAX_CHANGES) if isinstance(doc, dict) else None
        if (not isinstance(prefix, str) or not (after is None or (isinstance(after, int) and not isinstance(after, bool)
                                                                   and after >= 0))
                or isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CHANGES):
            raise InvalidRequest(f'body must be {{"prefix": string, "after": cursor >= 0 or null, '
                                 f'"limit": 1..{MAX_CHANGES}}}')
        if self.changes is None:
            raise InvalidRequest("the change stream needs the cluster feed, which this gateway runs without "
                                 "(KVGW_CLUSTER_ENABLED=false)")
        page = await self.changes.page(bucket.name, prefix, after, limit)
        await self._send_json(req, send, page.doc())

    async def _send_json(self, req: Request, send: Send, doc: Any) -> None:
        headers = self._base_headers(req)
        headers.append((b"content-type", b"application/json"))
        await send_response(send, 200, headers, json_body(doc))

    async def _batch_get(self, req: Request, send: Send, bucket_name: str, _: str) -> None:
        """Stream every requested chunk in order; the next chunk is read while this one is sent."""
        bucket = await self._authorized_bucket(req, bucket_name, Action.READ)
        keys = await self._keys(req)
        verifies = _reader_verifies(req)
        as_file = verifies and sends_files(req.scope)
        infos = await self.service.open_many(bucket, keys, read_ahead=True, reader_verifies=verifies, as_file=as_file)
        headers = self._base_headers(req)
        headers.append((b"content-type", wire.BATCH_CONTENT_TYPE.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": wire.encode_batch_header(len(keys)),
                    "more_body": True})

        async def open_one(info: ChunkInfo | None) -> ChunkBody | int:
            if info is None:
                return wire.FRAME_MISSING
            try:
                return await self.service.open_info(info, reader_verifies=verifies, as_file=as_file)
            except NoSuchChunk:
                return wire.FRAME_MISSING
            except KvgwError:
                return wire.FRAME_ERROR

        frames = FrameSender(send, gather=takes_parts(req.scope))
        pending: asyncio.Task[ChunkBody | int] | None = None
        try:
            pending = asyncio.ensure_future(open_one(infos[0])) if infos else None
            for i in range(len(infos)):
                assert pending is not None
                opened = await pending
                pending = asyncio.ensure_future(open_one(infos[i + 1])) if i + 1 < len(infos) else None
                if isinstance(opened, int):
                    await frames.status(opened)
                else:
                    await frames.chunk(opened)
            await frames.flush()
        finally:
            await frames.close()
            if pending is not None:
                pending.cancel()
                try:
                    leftover = await pending
                    if not isinstance(leftover, int):
                        await leftover.close()
                except (asyncio.CancelledError, Exception):
                    pass
        await send({"type": "http.response.body", "body": wire.encode_batch_trailer(len(keys))})


H = TypeVar("H")


def _route(method: str, raw_path: str, chunk_handlers: dict[str, H], post_handlers: dict[str, H]) -> tuple[H, str, str]:
    """(handler, bucket, key) of a native request: ``chunk_handlers`` by method for
    ``/v1/buckets/{bucket}/chunks/{key}`` (key decoded and validated), ``post_handlers`` by call for
    ``POST /v1/buckets/{bucket}/{call}`` (key ""). NotFound, MethodNotAllowed or InvalidKey otherwise."""
    if not raw_path.startswith(BUCKETS_PREFIX):
        raise NotFound()
    bucket, sep, rest = raw_path[len(BUCKETS_PREFIX) :].partition("/")
    if not sep:
        raise NotFound()
    if rest.startswith("chunks/"):
        handler = chunk_handlers.get(method)
        if handler is None:
            raise MethodNotAllowed()
        try:
            key = path_segment(rest[len("chunks/") :])
            validate_key(key)
        except (InvalidKeyError, ValueError) as exc:
            raise InvalidKey(str(exc) if isinstance(exc, InvalidKeyError) else "key is not UTF-8") from None
        return handler, bucket, key
    post = post_handlers.get(rest)
    if post is None:
        raise NotFound()
    if method != "POST":
        raise MethodNotAllowed()
    return post, bucket, ""


Leased = tuple[LeaseGrant, set[str]]
"""A lookup's lease: the grant, and the keys it found removed a moment ago (answered absent)."""


def _hits(keys: list[str], found: list[bool]) -> list[str]:
    return [key for key, hit in zip(keys, found, strict=True) if hit]


def _reader_verifies(req: Request) -> bool:
    """The client checks every chunk it reads against its checksum itself (``wire.H_VERIFY``)."""
    return (req.header(wire.H_VERIFY) or "").strip().lower() == wire.VERIFY_XXH3


def _valid_bucket_name(name: str) -> str:
    if not is_valid_bucket_name(name):
        raise InvalidRequest(f"invalid bucket name {name!r}")
    return name


def _lookup_doc(raw: bytes, *, leasable: bool = True) -> tuple[list[str], int]:
    """The keys of a batch call's body ``{"keys": [...]}``, and for lookups its optional ``"lease_ms"``
    (0 when absent); InvalidRequest when the body is not that."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("request body is not valid JSON") from exc
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not set(map(type, keys)) <= {str}:
        raise InvalidRequest('body must be {"keys": [string, ...]}')
    if len(keys) > MAX_KEYS_PER_CALL:
        raise InvalidRequest(f"at most {MAX_KEYS_PER_CALL} keys per call")
    lease_ms = doc.get("lease_ms", 0) if leasable else 0
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or not 0 <= lease_ms <= MAX_LEASE_MS:
        raise InvalidRequest(f'"lease_ms" must be an integer from 0 to {MAX_LEASE_MS}')
    return keys, lease_ms  # the service validates the keys while it digests them


def _hints_doc(raw: bytes) -> tuple[Hint, list[str]]:
    """The hint and keys of a hints call's body ``{"hint": ..., "keys": [...]}``."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("request body is not valid JSON") from exc
    if not isinstance(doc, dict):
        raise InvalidRequest('body must be {"hint": string, "keys": [string, ...]}')
    hint = parse_hint(doc.get("hint"))
    keys, _ = _lookup_doc(raw, leasable=False)
    return hint, keys


def _error_answer(method: str, request_id: str, exc: KvgwError) -> IndexedAnswer:
    """The error answer to a request (no content-length: ``send_response`` adds it, a HEAD has none)."""
    status = status_for(exc)
    headers: Headers = [(b"x-kvgw-request-id", request_id.encode()), (b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="kvgw"'))
    if isinstance(exc, InvalidRange):
        headers.append((b"content-range", f"bytes */{exc.size}".encode()))
    if isinstance(exc, Declined):
        headers.append((wire.H_DECLINED.encode(), exc.reason.encode()))
    body = b"" if method == "HEAD" else json_body(
        {"error": {"code": exc.code, "message": exc.message, "request_id": request_id}})
    return IndexedAnswer("error", headers, body, status)


def _json_answer(op: str, request_id: str, doc: Any) -> IndexedAnswer:
    body = json_body(doc)
    return IndexedAnswer(op, [(b"x-kvgw-request-id", request_id.encode()), (b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode())], body)


def _location_doc(loc: ChunkLocation | None) -> dict[str, Any] | None:
    """``{"size", "checksum", "path"}`` for a file copy, ``{"size", "checksum", "tier": "s3"}`` when
    only S3 holds the chunk (read it through batch-get, which promotes it), None when absent."""
    if loc is None:
        return None
    doc: dict[str, Any] = {"size": loc.info.size, "checksum": loc.info.checksum_hex}
    if loc.path is not None:
        doc["path"] = loc.path
    else:
        doc["tier"] = TierId.S3.label
    return doc


def _parse_checksum(raw: str | None) -> int | None:
    if raw is None:
        return None
    text = raw.strip().lower()
    if len(text) != 16:
        raise InvalidRequest(f"{wire.H_CHECKSUM} must be 16 hex digits of xxh3-64")
    try:
        return int(text, 16)
    except ValueError:
        raise InvalidRequest(f"{wire.H_CHECKSUM} must be 16 hex digits of xxh3-64") from None


def _parse_md5(raw: str | None) -> bytes | None:
    if raw is None:
        return None
    try:
        digest = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        digest = b""
    if len(digest) != 16:
        raise InvalidRequest("Content-MD5 must be the base64 of a 16-byte MD5 digest")
    return digest


def _parse_parent(raw: str | None) -> str | None:
    if raw is None:
        return None
    try:
        parent = path_segment(raw.strip())
        validate_key(parent)
    except (InvalidKeyError, ValueError):
        raise InvalidKey(f"{wire.H_PARENT} is not a valid key") from None
    return parent
