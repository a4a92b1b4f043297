"""Object operations: PutObject, GetObject, HeadObject, DeleteObject, DeleteObjects.

An object is a chunk: PutObject streams the verified body into ``ChunkService.put`` (write-once: a
key that exists keeps its bytes and the answer carries the stored ETag), GetObject serves
``ChunkService.open_info``. What S3 keeps beside the bytes (content type, user metadata, the
``x-amz-checksum-*`` values) goes into the chunk's attrs and comes back on GET/HEAD; checksums only
when the client asks (``x-amz-checksum-mode: ENABLED``) and only for whole-object answers.

ETags follow the bucket's mode (``kvgw bucket create|update --etag``): in an ``xxh3`` bucket (the
default) the chunk's xxh3-64 (``"<16 hex>"``), the same as the native API's, which no engine checks
against an MD5 (botocore, the aws CLI, awscrt and rclone treat a 16-hex ETag as opaque); in an ``md5``
bucket S3's own (``ChunkInfo.s3_etag``: the MD5 of the body, computed while it streams), which
``aws s3 sync`` and rclone compare with the MD5 of their files.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from email.utils import parsedate_to_datetime

from gateway.access import Action
from gateway.api.http import Headers, http_date, parse_range, send_body, sends_files
from gateway.api.s3 import xml
from gateway.api.s3.checksums import ALGORITHMS
from gateway.api.s3.common import DRAIN_LIMIT, Call, S3Services, as_bytes, body_payload, object_key, read_small_body
from gateway.api.s3.errors import S3Error
from gateway.api.s3.payload import strip_aws_chunked
from gateway.chunks import ChunkInfo, resolve_range
from gateway.errors import KvgwError, NoSuchChunk
from kvgw_client.keys import InvalidKeyError, validate_key

# Request headers kept with the object and returned on GET/HEAD.
STORED_HEADERS = ("content-type", "content-disposition", "content-language", "cache-control", "expires",
                  "x-amz-website-redirect-location", "x-amz-tagging-count")
DEFAULT_CONTENT_TYPE = "binary/octet-stream"
MAX_METADATA_BYTES = 2048
CHECKSUM_PREFIX = "x-amz-checksum-"
CHECKSUM_TYPE = "x-amz-checksum-type"
_RESPONSE_OVERRIDES = {
    "response-content-type": b"content-type",
    "response-content-language": b"content-language",
    "response-expires": b"expires",
    "response-cache-control": b"cache-control",
    "response-content-disposition": b"content-disposition",
    "response-content-encoding": b"content-encoding",
}


def request_attrs(call: Call) -> dict[str, str]:
    """Content headers and ``x-amz-meta-*`` of a PutObject / CreateMultipartUpload, as chunk attrs."""
    attrs: dict[str, str] = {}
    meta_bytes = 0
    for name, value in call.req.headers.items():
        if name in STORED_HEADERS or name == "content-encoding":
            attrs[name] = value
        elif name.startswith("x-amz-meta-"):
            attrs[name] = value
            meta_bytes += len(name) - len("x-amz-meta-") + len(value)
    if meta_bytes > MAX_METADATA_BYTES:
        raise S3Error("MetadataTooLarge", MaxSizeAllowed=MAX_METADATA_BYTES)
    encoding = strip_aws_chunked(attrs.pop("content-encoding", None))
    if encoding is not None:
        attrs["content-encoding"] = encoding
    return attrs


def checksum_headers(attrs: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in attrs.items()
            if name.startswith(CHECKSUM_PREFIX) or name == CHECKSUM_TYPE]


def checksum_attrs(checksums: Mapping[str, str]) -> dict[str, str]:
    """Payload checksums (algorithm -> base64) as attrs; Content-MD5 is not an S3 checksum."""
    out = {f"{CHECKSUM_PREFIX}{alg}": value for alg, value in checksums.items() if alg != "md5"}
    if out:
        out[CHECKSUM_TYPE] = "FULL_OBJECT"
    return out


def requested_algorithms(call: Call) -> list[str]:
    """An algorithm named by ``x-amz-sdk-checksum-algorithm`` without a value to check: S3 computes it."""
    name = (call.header("x-amz-sdk-checksum-algorithm") or "").strip().lower()
    if name and name in ALGORITHMS and name != "md5":
        return [name]
    return []


STORED_CHECKSUM = "crc64nvme"
"""Kept with every object whose PUT carried no checksum of its own (S3's default algorithm, from awscrt:
hardware-accelerated, computed in the same pass as the body's other digests), so that any S3 client
asking for checksums on GET (``x-amz-checksum-mode: ENABLED``) can verify what it reads, and kvgw can
then send it the bytes without reading them (``get_object``)."""


def stored_algorithms(call: Call) -> list[str]:
    """The checksums a PutObject computes besides the ones it verifies: the one the SDK names without
    a value, else ``STORED_CHECKSUM`` when the request carries no checksum at all."""
    requested = requested_algorithms(call)
    if requested:
        return requested
    carries = call.header("x-amz-trailer") is not None or any(
        name.startswith(b"x-amz-checksum-") and name != b"x-amz-checksum-type" for name, _ in call.raw_headers)
    return [] if carries else [STORED_CHECKSUM]


def reader_verifies(call: Call, attrs: Mapping[str, str], whole: bool) -> bool:
    """Whether the client will check the whole object against a checksum this answer carries: it asked
    (``x-amz-checksum-mode: ENABLED``) and one is stored. The bytes are then not verified here."""
    return (whole and (call.header("x-amz-checksum-mode") or "").upper() == "ENABLED"
            and any(name.startswith(CHECKSUM_PREFIX) and name != CHECKSUM_TYPE for name in attrs))


def etag_matches(header: str, etag: str) -> bool:
    bare = etag.strip('"')
    for item in header.split(","):
        item = item.strip()
        if item == "*" or item.removeprefix("W/").strip('"') == bare:
            return True
    return False


def _http_time(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return parsedate_to_datetime(raw).timestamp()
    except (TypeError, ValueError, IndexError):
        return None  # an unreadable date is ignored, as S3 does


def check_read_conditions(call: Call, info: ChunkInfo) -> None:
    """If-Match / If-Unmodified-Since (412) and If-None-Match / If-Modified-Since (304), S3's order."""
    modified = float(int(info.created))
    if_match = call.header("if-match")
    if if_match is not None:
        if not etag_matches(if_match, info.s3_etag):
            raise S3Error("PreconditionFailed", Condition="If-Match")
    else:
        since = _http_time(call.header("if-unmodified-since"))
        if since is not None and modified > since:
            raise S3Error("PreconditionFailed", Condition="If-Unmodified-Since")
    if_none = call.header("if-none-match")
    if if_none is not None:
        if etag_matches(if_none, info.s3_etag):
            raise _not_modified(info)
    else:
        since = _http_time(call.header("if-modified-since"))
        if since is not None and modified <= since:
            raise _not_modified(info)


def _check_version(call: Call) -> None:
    """A read's versionId may only name the one version there is ("null")."""
    version = call.query.get("versionId")
    if version is not None and version != "null":
        raise S3Error("InvalidArgument", "Invalid version id specified", ArgumentName="versionId")


def _not_modified(info: ChunkInfo) -> S3Error:
    return S3Error("NotModified", headers={"ETag": info.s3_etag, "Last-Modified": http_date(info.created)})


class ObjectHandlers:
    def __init__(self, gw: S3Services) -> None:
        self.gw = gw

    # -- writes --------------------------------------------------------------------------------

    async def put_object(self, call: Call) -> None:
        key = object_key(call)
        bucket = await self.gw.bucket(call, Action.WRITE)
        attrs = request_attrs(call)
        service = self.gw.service
        existing = await service.lookup_for_write(bucket, key)
        if existing is not None or call.header("if-match") is not None:
            self._check_write_conditions(call, existing)
        if existing is not None:
            await self._existing(call, existing)
            return
        # Transfer-Encoding: chunked without a length (SDK streams) is accepted: the body's end decides;
        # neither a length nor chunked encoding is still 411, as S3 answers
        payload = body_payload(call, max_length=bucket.max_chunk_bytes, compute=stored_algorithms(call),
                               require_length=call.header("transfer-encoding") is None)
        if payload.content_encoding is not None:
            attrs["content-encoding"] = payload.content_encoding

        async def body() -> AsyncIterator[bytes]:
            async for piece in as_bytes(aiter(payload)):
                yield piece
            attrs.update(checksum_attrs(payload.checksums))  # the service records attrs after the body

        result = await service.put(bucket, key, body(), length=payload.length, attrs=attrs,
                                   threaded=payload.threaded(call.req.threaded_body()))
        if not result.created:
            await self._existing(call, result.info)
            return
        self.gw.attrs.put(result.info, dict(attrs))
        headers = call.headers()
        headers.append((b"etag", result.info.s3_etag.encode()))
        headers.extend(checksum_headers(attrs))
        await call.respond(200, headers)

    @staticmethod
    def _check_write_conditions(call: Call, existing: ChunkInfo | None) -> None:
        if_none = call.header("if-none-match")
        if if_none is not None and existing is not None and if_none.strip() == "*":
            raise S3Error("PreconditionFailed", Condition="If-None-Match")
        if_match = call.header("if-match")
        if if_match is not None:
            if existing is None:
                raise NoSuchChunk()
            if not etag_matches(if_match, existing.s3_etag):
                raise S3Error("PreconditionFailed", Condition="If-Match")

    async def _existing(self, call: Call, info: ChunkInfo) -> None:
        """Write-once: the key keeps its chunk; the answer is a success carrying the stored ETag."""
        headers = call.headers()
        headers.append((b"etag", info.s3_etag.encode()))
        if not await call.req.drain(DRAIN_LIMIT):
            headers.append((b"connection", b"close"))
        await call.respond(200, headers)

    async def delete_object(self, call: Call) -> None:
        key = object_key(call)
        bucket = await self.gw.bucket(call, Action.DELETE)
        await self.gw.service.delete(bucket, key)
        await call.respond(204, call.headers())

    async def delete_objects(self, call: Call) -> None:
        bucket = await self.gw.bucket(call, Action.DELETE)
        request = xml.parse_delete(await read_small_body(call, xml.MAX_XML_BODY))
        deleted: list[str] = []
        errors: list[xml.DeleteError] = []
        for key, _version in request.keys:
            try:
                validate_key(key)
            except InvalidKeyError as exc:
                errors.append(xml.DeleteError(key, "InvalidArgument", str(exc)))
                continue
            try:
                await self.gw.service.delete(bucket, key)
            except KvgwError as exc:
                errors.append(xml.DeleteError(key, "InternalError", exc.message))
                continue
            deleted.append(key)
        await call.respond_xml(xml.render_delete_result(deleted, errors, quiet=request.quiet))

    # -- reads ---------------------------------------------------------------------------------

    async def _resolve(self, call: Call) -> ChunkInfo:
        key = object_key(call)
        bucket = await self.gw.bucket(call, Action.READ)
        _check_version(call)
        info = await self.gw.service.lookup(bucket, key)
        if info is None:
            raise NoSuchChunk()
        return info

    def _part_number(self, call: Call) -> bool:
        """``partNumber=1`` asks for the whole object (it is one part); any other number is out of range."""
        raw = call.query.get("partNumber")
        if raw is None:
            return False
        if raw != "1":
            raise S3Error("InvalidPartNumber") if raw.isdigit() else S3Error("InvalidArgument",
                                                                              "Part number must be an integer")
        return True

    def _object_headers(self, call: Call, info: ChunkInfo, attrs: dict[str, str], *,
                        whole: bool) -> list[tuple[bytes, bytes]]:
        headers = call.headers()
        headers += [
            (b"etag", info.s3_etag.encode()),
            (b"last-modified", http_date(info.created).encode()),
            (b"accept-ranges", b"bytes"),
        ]
        overrides = {_RESPONSE_OVERRIDES[n]: v for n, v in call.query.items() if n in _RESPONSE_OVERRIDES}
        if b"content-type" not in overrides:
            content_type = attrs.get("content-type", DEFAULT_CONTENT_TYPE)
            headers.append((b"content-type", content_type.encode("latin-1", "replace")))
        for name, value in attrs.items():
            if name == "content-type" or name.startswith(CHECKSUM_PREFIX) or name == CHECKSUM_TYPE:
                continue
            raw = name.encode()
            if raw not in overrides:
                headers.append((raw, value.encode("latin-1", "replace")))
        headers.extend((name, value.encode("latin-1", "replace")) for name, value in overrides.items())
        if whole and (call.header("x-amz-checksum-mode") or "").upper() == "ENABLED":
            headers.extend(checksum_headers(attrs))
        return headers

    async def head_object(self, call: Call) -> None:
        info = await self._resolve(call)
        status, headers = self._head_answer(call, info, await self.gw.chunk_attrs(info))
        await call.send({"type": "http.response.start", "status": status, "headers": headers})
        await call.send({"type": "http.response.body", "body": b""})

    def head_indexed(self, call: Call) -> tuple[int, Headers] | None:
        """``head_object``'s answer when the directory's view, the index (or a tier telling at once
        that the chunk is absent: NoSuchChunk) and the attrs cache hold all it needs, without awaiting
        anything (the lookup lane, ``gateway.dataplane.lane``); None otherwise. Raises what ``head_object``
        raises for the same request."""
        key = object_key(call)
        bucket = self.gw.bucket_in_view(call, Action.READ)
        if bucket is None:
            return None
        _check_version(call)
        info = self.gw.service.head_now(bucket, key)
        attrs = None if info is None else self.gw.attrs.get(info)
        if info is None or attrs is None:
            return None
        return self._head_answer(call, info, attrs)

    def _head_answer(self, call: Call, info: ChunkInfo, attrs: dict[str, str]) -> tuple[int, Headers]:
        self._part_number(call)
        check_read_conditions(call, info)
        byte_range = parse_range(call.header("range"))
        status = 200
        length = info.size
        headers = self._object_headers(call, info, attrs, whole=byte_range is None)
        if byte_range is not None:
            offset, length = resolve_range(byte_range, info.size)
            status = 206
            headers.append((b"content-range", f"bytes {offset}-{offset + length - 1}/{info.size}".encode()))
        headers.append((b"content-length", str(length).encode()))
        return status, headers

    async def get_object(self, call: Call) -> None:
        info = await self._resolve(call)
        self._part_number(call)
        check_read_conditions(call, info)
        byte_range = parse_range(call.header("range"))
        attrs = await self.gw.chunk_attrs(info)
        verifies = reader_verifies(call, attrs, byte_range is None)
        service = self.gw.service
        body = await service.open_info(info, byte_range, reader_verifies=verifies,
                                       as_file=verifies and sends_files(call.req.scope))
        if body.info != info:  # the index was behind the tier: another incarnation, its own attrs
            attrs = await self.gw.chunk_attrs(body.info)
            if verifies and not reader_verifies(call, attrs, byte_range is None):
                await body.close()
                body = await service.open_info(body.info, byte_range)
        try:
            headers = self._object_headers(call, body.info, attrs, whole=byte_range is None)
            await send_body(call.send, headers, body, range_of=None if byte_range is None else body.info.size)
        finally:
            await body.close()

