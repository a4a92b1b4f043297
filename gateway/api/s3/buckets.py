"""Bucket operations: ListBuckets, CreateBucket, HeadBucket, DeleteBucket, GetBucketLocation,
ListObjects (v1) and ListObjectsV2.

Creating and deleting buckets needs root credentials (``Action.ADMIN`` on the service); other
principals see and list the buckets they hold grants on.
"""

from __future__ import annotations

from gateway.access import Action
from gateway.api.s3 import xml
from gateway.api.s3.common import Call, S3Services, read_small_body
from gateway.api.s3.errors import S3Error
from gateway.api.s3.listing import decode_token, encode_token, parse_max
from gateway.chunks import ListPage
from gateway.errors import AccessDenied, BucketAlreadyOwned, Unauthorized

_CREATE_BODY_LIMIT = 64 * 1024


LEGACY_REGION = "us-east-1"
"""The one region where CreateBucket of a bucket you already own answers 200, not 409."""


def owner_of(call: Call) -> xml.Owner:
    name = call.principal.access_key or "anonymous"
    return xml.Owner(id=name, display_name=name)


def _encoding(call: Call) -> xml.EncodingType:
    value = call.query.get("encoding-type")
    if value is None:
        return None
    if value.lower() != "url":
        raise S3Error("InvalidArgument", "Invalid Encoding Method specified in Request", ArgumentName="encoding-type")
    return "url"


class BucketHandlers:
    def __init__(self, gw: S3Services) -> None:
        self.gw = gw

    def _require_root(self, call: Call) -> None:
        if not call.principal.is_root:
            if call.principal.access_key is None:
                raise Unauthorized()
            raise AccessDenied("creating and deleting buckets needs root credentials")

    async def list_buckets(self, call: Call) -> None:
        principal = call.principal
        if principal.access_key is None and not principal.is_root:
            raise Unauthorized()
        entries = [
            xml.BucketEntry(policy.name, created)
            for policy, created in await self.gw.buckets.list()
            if principal.is_root or policy.name in principal.grants
        ]
        await call.respond_xml(xml.render_list_buckets(entries, owner_of(call)))

    async def create_bucket(self, call: Call) -> None:
        self._require_root(call)
        xml.parse_create_bucket_configuration(await read_small_body(call, _CREATE_BODY_LIMIT))
        try:
            await self.gw.buckets.create(call.bucket)
        except BucketAlreadyOwned:
            # AWS's legacy us-east-1 answers 200 to a bucket you already own; every other region 409
            if self.gw.settings.s3_api_region != LEGACY_REGION:
                raise
        headers = call.headers()
        headers.append((b"location", f"/{call.bucket}".encode()))
        await call.respond(200, headers)

    async def delete_bucket(self, call: Call) -> None:
        self._require_root(call)
        await self.gw.bucket(call, Action.ADMIN)
        await self.gw.buckets.delete(call.bucket)
        for upload in await self.gw.multipart.list_uploads(call.bucket):
            await self.gw.multipart.abort(upload)
        await call.respond(204, call.headers())

    async def head_bucket(self, call: Call) -> None:
        await self.gw.bucket(call, Action.READ)
        headers = call.headers()
        headers.append((b"x-amz-bucket-region", self.gw.settings.s3_api_region.encode()))
        await call.respond(200, headers)

    async def get_bucket_location(self, call: Call) -> None:
        await self.gw.bucket(call, Action.READ)
        await call.respond_xml(xml.render_location_constraint(self.gw.settings.s3_api_region))

    async def _list(self, call: Call, *, after: str | None, skip_prefix: str | None, max_keys: int) -> ListPage:
        prefix = call.query.get("prefix", "")
        delimiter = call.query.get("delimiter") or None
        bucket = await self.gw.bucket(call, Action.READ)
        return await self.gw.service.list_page(bucket, prefix=prefix, delimiter=delimiter, after=after,
                                               skip_prefix=skip_prefix, max_keys=max_keys)

    @staticmethod
    def _entries(page: ListPage) -> list[xml.ObjectEntry]:
        return [xml.ObjectEntry(e.key, e.created, e.s3_etag, e.size) for e in page.contents]

    async def list_objects_v2(self, call: Call) -> None:
        query = call.query
        encoding = _encoding(call)
        max_keys = parse_max(query.get("max-keys"), "max-keys")
        token = query.get("continuation-token")
        start_after = query.get("start-after") or None
        after, skip = start_after, None
        if token:  # an empty token is absent (S3 echoes it as given)
            kind, value = decode_token(token)
            after, skip = value, (value if kind == "p" else None)
        page = await self._list(call, after=after, skip_prefix=skip, max_keys=max_keys)
        body = xml.render_list_objects_v2(
            bucket=call.bucket,
            prefix=query.get("prefix", ""),
            contents=self._entries(page),
            common_prefixes=page.prefixes,
            max_keys=max_keys,
            is_truncated=page.truncated,
            delimiter=query.get("delimiter") or None,
            continuation_token=token,
            next_continuation_token=encode_token(page.last) if page.truncated and page.last else None,
            start_after=start_after,
            encoding_type=encoding,
            owner=owner_of(call) if query.get("fetch-owner", "").lower() == "true" else None,
        )
        await call.respond_xml(body)

    async def list_objects(self, call: Call) -> None:
        query = call.query
        encoding = _encoding(call)
        max_keys = parse_max(query.get("max-keys"), "max-keys")
        marker = query.get("marker", "")
        delimiter = query.get("delimiter") or None
        prefix = query.get("prefix", "")
        skip = marker if delimiter and marker.startswith(prefix) and marker.endswith(delimiter) else None
        page = await self._list(call, after=marker or None, skip_prefix=skip, max_keys=max_keys)
        next_marker = page.last[1] if delimiter and page.truncated and page.last else None
        body = xml.render_list_objects_v1(
            bucket=call.bucket,
            prefix=prefix,
            marker=marker,
            contents=self._entries(page),
            common_prefixes=page.prefixes,
            max_keys=max_keys,
            is_truncated=page.truncated,
            delimiter=delimiter,
            next_marker=next_marker,
            encoding_type=encoding,
            owner=owner_of(call),
        )
        await call.respond_xml(body)
