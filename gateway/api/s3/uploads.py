"""Multipart operations: CreateMultipartUpload, UploadPart, CompleteMultipartUpload,
AbortMultipartUpload, ListParts, ListMultipartUploads, over ``gateway.multipart.MultipartStore``.

ETags follow the bucket's mode: in an ``xxh3`` bucket a part's ETag is its xxh3-64 and the object's
after Complete the chunk's (xxh3-64 of the whole object), so it reads the same through both APIs; in
an ``md5`` bucket they are S3's: the part's MD5 (computed while the part streams in), and for the object
the MD5 of the parts' binary MD5s then ``-N`` (``gateway.multipart.multipart_md5_etag``).
Checksums: each part keeps the ``x-amz-checksum-*`` it came with; when every part has one of the
same algorithm, the object gets S3's composite form (the checksum of the part digests, ``-N``),
which clients know not to compare with a checksum of the whole body.
"""

from __future__ import annotations

import base64

from gateway.access import Action
from gateway.api.s3 import xml
from gateway.api.s3.checksums import ALGORITHMS, new_checksum
from gateway.api.s3.common import Call, S3Services, as_bytes, body_payload, object_key, read_small_body
from gateway.api.s3.errors import S3Error
from gateway.api.s3.listing import parse_max
from gateway.api.s3.objects import (
    CHECKSUM_PREFIX,
    CHECKSUM_TYPE,
    checksum_attrs,
    checksum_headers,
    etag_matches,
    request_attrs,
    requested_algorithms,
)
from gateway.errors import NoSuchUpload
from gateway.multipart import PartInfo, Upload

_ALGORITHM_ATTR = "x-amz-checksum-algorithm"


def composite_checksums(parts: list[PartInfo], algorithm: str | None) -> dict[str, str]:
    """S3's composite checksum of the object when every part carries the same algorithm."""
    if not parts:
        return {}
    names = {name for name in parts[0].attrs if name.startswith(CHECKSUM_PREFIX) and name != CHECKSUM_TYPE}
    if algorithm is not None:
        names &= {f"{CHECKSUM_PREFIX}{algorithm}"}
    out: dict[str, str] = {}
    for name in sorted(names):
        if not all(name in p.attrs for p in parts):
            continue
        combined = new_checksum(name[len(CHECKSUM_PREFIX):])
        for part in parts:
            combined.update(base64.b64decode(part.attrs[name]))
        out[name] = f"{combined.b64digest()}-{len(parts)}"
    if out:
        out[CHECKSUM_TYPE] = "COMPOSITE"
    return out


class UploadHandlers:
    def __init__(self, gw: S3Services) -> None:
        self.gw = gw

    async def _upload(self, call: Call, *, allow_completed: bool = False) -> Upload:
        upload_id = call.query.get("uploadId", "")
        try:
            return await self.gw.multipart.get(upload_id, call.bucket, call.key, allow_completed=allow_completed)
        except NoSuchUpload:
            raise S3Error("NoSuchUpload", UploadId=upload_id[:64]) from None

    async def create(self, call: Call) -> None:
        key = object_key(call)
        await self.gw.bucket(call, Action.WRITE)
        attrs = request_attrs(call)
        algorithm = (call.header("x-amz-checksum-algorithm") or "").strip().lower()
        extra: list[tuple[bytes, bytes]] = []
        if algorithm:
            if algorithm not in ALGORITHMS or algorithm == "md5":
                raise S3Error("InvalidRequest", "Checksum algorithm provided is unsupported.")
            attrs[_ALGORITHM_ATTR] = algorithm
            extra.append((b"x-amz-checksum-algorithm", algorithm.upper().encode()))
        upload = await self.gw.multipart.create(call.bucket, key, attrs)
        body = xml.render_initiate_multipart_upload(bucket=call.bucket, key=key, upload_id=upload.upload_id)
        await call.respond_xml(body, extra=extra)

    async def upload_part(self, call: Call) -> None:
        object_key(call)
        raw = call.query.get("partNumber", "")
        if not raw.isdigit() or not 1 <= int(raw) <= xml.MAX_PARTS:
            raise S3Error("InvalidArgument", "Part number must be an integer between 1 and 10000, inclusive",
                          ArgumentName="partNumber", ArgumentValue=raw[:16])
        bucket = await self.gw.bucket(call, Action.WRITE)
        upload = await self._upload(call)
        payload = body_payload(call, max_length=bucket.max_chunk_bytes, compute=requested_algorithms(call))
        part = await self.gw.multipart.put_part(
            upload, int(raw), as_bytes(aiter(payload)), max_bytes=bucket.max_chunk_bytes,
            allow_empty=bucket.allow_empty_objects,
            md5=bucket.etag_mode == "md5",
            attrs=lambda: {k: v for k, v in checksum_attrs(payload.checksums).items() if k != CHECKSUM_TYPE},
        )
        headers = call.headers()
        headers.append((b"etag", part.etag.encode()))
        headers.extend(checksum_headers(part.attrs))
        await call.respond(200, headers)

    async def complete(self, call: Call) -> None:
        bucket = await self.gw.bucket(call, Action.WRITE)
        body = await read_small_body(call, xml.MAX_XML_BODY, header_checksums=False)
        chosen = xml.parse_complete_multipart_upload(body)
        upload = await self._upload(call, allow_completed=True)
        service = self.gw.service
        if upload.completed is not None:  # a retried Complete: answer as the first one did
            await self._answer(call, upload.completed.s3_etag)
            return
        existing = await service.lookup_for_write(bucket, upload.key)
        if existing is not None and (call.header("if-none-match") or "").strip() == "*":
            raise S3Error("PreconditionFailed", Condition="If-None-Match")
        if_match = call.header("if-match")
        if if_match is not None and (existing is None or not etag_matches(if_match, existing.s3_etag)):
            raise S3Error("NoSuchKey") if existing is None else S3Error("PreconditionFailed", Condition="If-Match")
        parts = await self.gw.multipart.resolve_parts(
            upload, [(p.part_number, p.etag) for p in chosen], min_part_bytes=self.gw.settings.s3_api_min_part_bytes
        )
        expected = call.header("x-amz-mp-object-size")
        total = sum(p.size for p in parts)
        if expected is not None and (not expected.strip().isdigit() or int(expected) != total):
            raise S3Error("InvalidRequest", f"The provided 'x-amz-mp-object-size' header value {expected[:24]} does "
                          f"not match what was computed: {total}")
        attrs = {k: v for k, v in upload.attrs.items() if k != _ALGORITHM_ATTR}
        attrs.update(composite_checksums(parts, upload.attrs.get(_ALGORITHM_ATTR)))
        result = await self.gw.multipart.complete(service, bucket, upload, parts, attrs)
        if result.created:
            self.gw.attrs.put(result.info, attrs)
        await self._answer(call, result.info.s3_etag)

    async def _answer(self, call: Call, etag: str) -> None:
        location = f"/{call.bucket}/{call.key}"
        body = xml.render_complete_multipart_upload(location=location, bucket=call.bucket, key=call.key, etag=etag)
        await call.respond_xml(body)

    async def abort(self, call: Call) -> None:
        await self.gw.bucket(call, Action.WRITE)
        upload = await self._upload(call)
        await self.gw.multipart.abort(upload)
        await call.respond(204, call.headers())

    async def list_parts(self, call: Call) -> None:
        await self.gw.bucket(call, Action.READ)
        upload = await self._upload(call)
        max_parts = parse_max(call.query.get("max-parts"), "max-parts")
        marker_raw = call.query.get("part-number-marker", "0") or "0"
        if not marker_raw.isdigit():
            raise S3Error("InvalidArgument", "Invalid part number marker", ArgumentName="part-number-marker")
        marker = int(marker_raw)
        parts = [p for p in await self.gw.multipart.list_parts(upload) if p.number > marker]
        shown = parts[:max_parts]
        truncated = len(parts) > len(shown)
        body = xml.render_list_parts(
            bucket=call.bucket, key=call.key, upload_id=upload.upload_id,
            parts=[xml.PartEntry(p.number, p.modified, p.etag, p.size) for p in shown],
            part_number_marker=marker, next_part_number_marker=shown[-1].number if shown else marker,
            max_parts=max_parts, is_truncated=truncated, owner=_owner(call),
        )
        await call.respond_xml(body)

    async def list_uploads(self, call: Call) -> None:
        await self.gw.bucket(call, Action.READ)
        query = call.query
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter") or None
        max_uploads = parse_max(query.get("max-uploads"), "max-uploads")
        key_marker = query.get("key-marker", "")
        id_marker = query.get("upload-id-marker", "")
        uploads = [
            u for u in await self.gw.multipart.list_uploads(call.bucket)
            if u.key.startswith(prefix) and (
                not key_marker or u.key > key_marker or (u.key == key_marker and id_marker and u.upload_id > id_marker)
            )
        ]
        entries: list[xml.UploadEntry] = []
        prefixes: list[str] = []
        truncated = False
        last: Upload | None = None
        for upload in uploads:
            common = None
            if delimiter:
                at = upload.key.find(delimiter, len(prefix))
                common = upload.key[: at + len(delimiter)] if at >= 0 else None
            if common is not None and prefixes and prefixes[-1] == common:
                continue
            if len(entries) + len(prefixes) == max_uploads:
                truncated = True
                break
            if common is not None:
                prefixes.append(common)
            else:
                entries.append(xml.UploadEntry(upload.key, upload.upload_id, upload.initiated))
            last = upload
        body = xml.render_list_multipart_uploads(
            bucket=call.bucket, uploads=entries, common_prefixes=prefixes, max_uploads=max_uploads,
            is_truncated=truncated, key_marker=key_marker, upload_id_marker=id_marker,
            next_key_marker=last.key if truncated and last else "",
            next_upload_id_marker=last.upload_id if truncated and last else "",
            prefix=prefix or None, delimiter=delimiter, encoding_type="url" if query.get("encoding-type") else None,
            owner=_owner(call),
        )
        await call.respond_xml(body)


def _owner(call: Call) -> xml.Owner:
    name = call.principal.access_key or "anonymous"
    return xml.Owner(id=name, display_name=name)
