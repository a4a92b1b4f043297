"""What every S3 handler shares: the request context, the gateway parts it calls, and small helpers.

Handlers raise (``S3Error`` or a domain ``KvgwError``) and never build error responses themselves;
``gateway.api.s3.app`` turns every raised error into S3's XML through one table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import cast

from backends.catalog.store import BucketPolicy
from gateway.access import Action, Directory, Principal
from gateway.api.http import Headers, Request, Send, send_response
from gateway.api.s3.auth import AuthResult, PayloadMode
from gateway.api.s3.errors import S3Error
from gateway.api.s3.payload import Payload, open_payload
from gateway.api.s3.routing import Target
from gateway.buckets import BucketService
from gateway.chunks import ChunkInfo
from gateway.config import Settings
from gateway.errors import MissingContentLength
from gateway.multipart import MultipartStore
from gateway.service import ChunkService
from kvgw_client.keys import MAX_KEY_BYTES, InvalidKeyError, validate_key

XML = b"application/xml"
# A request body nobody needs is read and dropped up to this size so the connection stays usable;
# beyond it the response closes the connection instead.
DRAIN_LIMIT = 8 << 20


def client_retried(req: Request) -> bool:
    """Whether the client marked ``req`` as a retry: AWS SDKs (botocore, aws-sdk-cpp, the Java and Go
    SDKs) send ``amz-sdk-request: attempt=N; max=M`` on every request, N counting from 1. Absent or
    unreadable: not a retry."""
    value = req.header("amz-sdk-request")
    if value is None or value.startswith("attempt=1;") or not value.startswith("attempt="):
        return False  # the usual first attempt, at the cost of one comparison
    attempt = value[8:].partition(";")[0].strip()
    return attempt.isdigit() and int(attempt) > 1


@dataclass(slots=True)
class Call:
    """One S3 request being answered."""

    req: Request
    send: Send
    target: Target
    query: dict[str, str]
    principal: Principal
    auth: AuthResult | None  # None: anonymous
    idle_timeout: float = 60.0
    operation: str = ""

    @property
    def bucket(self) -> str:
        assert self.target.bucket is not None
        return self.target.bucket

    @property
    def key(self) -> str:
        assert self.target.key is not None
        return self.target.key

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def headers(self) -> Headers:
        rid = self.req.request_id.encode()
        return [(b"x-amz-request-id", rid), (b"x-amz-id-2", rid)]

    def header(self, name: str) -> str | None:
        return self.req.header(name)

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = self.req.scope["headers"]
        return headers

    async def respond(self, status: int, headers: Headers, body: bytes = b"") -> None:
        await send_response(self.send, status, headers, body)

    async def respond_xml(self, body: bytes, status: int = 200, extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
        headers = self.headers()
        headers.append((b"content-type", XML))
        headers.extend(extra)
        await send_response(self.send, status, headers, body)


class AttrCache:
    """Chunk attrs (content type, S3 checksums, user metadata) by chunk identity, bounded LRU.

    Chunks are immutable: (bucket, key, checksum, created) names one version, so an entry never goes
    stale; a re-written key has another ``created`` and misses.
    """

    def __init__(self, limit: int = 65536) -> None:
        self._limit = limit
        self._entries: OrderedDict[tuple[str, str, int, float], dict[str, str]] = OrderedDict()

    def get(self, info: ChunkInfo) -> dict[str, str] | None:
        ident = (info.bucket, info.key, info.checksum, info.created)
        attrs = self._entries.get(ident)
        if attrs is not None:
            self._entries.move_to_end(ident)
        return attrs

    def put(self, info: ChunkInfo, attrs: dict[str, str]) -> None:
        self._entries[(info.bucket, info.key, info.checksum, info.created)] = attrs
        if len(self._entries) > self._limit:
            self._entries.popitem(last=False)


@dataclass
class S3Services:
    """The parts of the gateway the S3 handlers call."""

    service: ChunkService
    directory: Directory
    buckets: BucketService
    multipart: MultipartStore
    settings: Settings
    attrs: AttrCache = field(default_factory=AttrCache)

    async def bucket(self, call: Call, action: Action, name: str | None = None) -> BucketPolicy:
        """The named (or addressed) bucket, if the caller may do ``action`` on it."""
        policy = await self.service.bucket(name or call.bucket)
        self.directory.authorize(call.principal, policy, action)
        return policy

    def bucket_in_view(self, call: Call, action: Action) -> BucketPolicy | None:
        """``bucket`` from the directory's view as it is (None: not in it; ``bucket`` re-reads)."""
        policy = self.directory.bucket_in_view(call.bucket)
        if policy is not None:
            self.directory.authorize(call.principal, policy, action)
        return policy

    async def chunk_attrs(self, info: ChunkInfo) -> dict[str, str]:
        attrs = self.attrs.get(info)
        if attrs is None:
            attrs = dict((await self.service.chunk_meta(info)).attrs)
            self.attrs.put(info, attrs)
        return attrs


def object_key(call: Call) -> str:
    """The addressed key, checked against the key rules."""
    key = call.key
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        if len(key.encode("utf-8", "replace")) > MAX_KEY_BYTES:
            raise S3Error("KeyTooLongError", Key=key[:64]) from None
        raise S3Error("InvalidArgument", f"Invalid object key: {exc}") from None
    return key


def body_payload(call: Call, *, max_length: int, compute: Iterable[str] = (), header_checksums: bool = True,
                 require_length: bool = True) -> Payload:
    """The request body, verified in one pass as the auth mode and headers promise."""
    auth = call.auth or anonymous_auth(call.header("x-amz-content-sha256"))
    payload = open_payload(auth, call.raw_headers, call.req.body(call.idle_timeout), max_length=max_length,
                           compute=compute, header_checksums=header_checksums)
    if require_length and payload.length is None:
        raise MissingContentLength()
    return payload


async def read_small_body(call: Call, limit: int, *, header_checksums: bool = True) -> bytes:
    """A small (XML) request body, verified; larger than ``limit``: MalformedXML-sized refusal."""
    payload = body_payload(call, max_length=limit, header_checksums=header_checksums, require_length=False)
    buf = bytearray()
    async for piece in payload:
        buf += piece
    return bytes(buf)


def as_bytes(pieces: AsyncIterator[memoryview]) -> AsyncIterator[bytes]:
    """The same iterator, typed as the service takes bodies: memoryviews are bytes-like for every
    consumer there (no generator in between, which would cost a step per piece)."""
    return cast(AsyncIterator[bytes], pieces)


def anonymous_auth(content_sha256: str | None) -> AuthResult:
    """How an anonymous body is framed: unsigned, or unsigned aws-chunked with a trailing checksum, or
    a plain body whose SHA-256 the client announced. Signed framing needs a signature: AccessDenied."""
    value = (content_sha256 or PayloadMode.UNSIGNED.value).strip()
    if value == PayloadMode.STREAMING_UNSIGNED_TRAILER.value:
        mode = PayloadMode.STREAMING_UNSIGNED_TRAILER
    elif len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        mode = PayloadMode.SHA256
    elif value == PayloadMode.UNSIGNED.value:
        mode = PayloadMode.UNSIGNED
    else:
        raise S3Error("AccessDenied", "Signed payloads need a signed request.")
    return AuthResult(access_key="", region="", date="", timestamp="", scope="", signed_headers=(),
                      payload_hash=value, payload_mode=mode, seed_signature="", signing_key=b"", presigned=False)
