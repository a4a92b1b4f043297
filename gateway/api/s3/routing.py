"""Which bucket, key and operation a request names: addressing styles and the operation table.

Addressing, tried in this order:

- virtual-hosted: ``Host: <bucket>.<base domain>[:port]`` (``s3_api_base_domain``, comma-separated
  for several); the whole path is the key;
- path-style: ``/<bucket>[/<key>]``;
- bare (LMCache's ``s3://host:port``): the Host carries no bucket and the path is ``/<key>``. A path
  whose first segment contains a character no bucket name can hold, not even the legacy names
  clients still accept (``[A-Za-z0-9._-]``), is such a key in the default bucket. LMCache keys always
  contain ``@`` (``%40`` on the wire), so ``HEAD /<key>`` and ``PUT /<key>`` are objects, not
  HeadBucket / CreateBucket, while ``PUT /Bad_Name`` stays a CreateBucket answered InvalidBucketName.

The operation comes from the method and the subresources in the query (``?uploads``, ``?uploadId``,
``?list-type=2``, ...). A subresource or header this gateway does not implement (``?acl``,
``?versioning``, ``x-amz-copy-source`` ...) selects ``NotImplemented``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl

from gateway.api.http import path_segment
from gateway.api.s3.errors import S3Error

_LEGACY_BUCKET_CHARS = re.compile(r"[A-Za-z0-9._-]+")

# Query parameters that select or refine an implemented operation; anything else is a subresource
# this gateway does not implement.
_PARAMS = frozenset({
    "list-type", "prefix", "delimiter", "max-keys", "continuation-token", "start-after", "fetch-owner",
    "encoding-type", "marker", "key-marker", "upload-id-marker", "max-uploads", "part-number-marker",
    "max-parts", "uploadId", "partNumber", "x-id", "versionId", "uploads", "delete", "location",
    "response-content-type", "response-content-language", "response-expires", "response-cache-control",
    "response-content-disposition", "response-content-encoding",
})
_UNIMPLEMENTED_HEADERS = ("x-amz-copy-source", "x-amz-server-side-encryption-customer-algorithm")


@dataclass(frozen=True, slots=True)
class Target:
    bucket: str | None  # None: the service (ListBuckets)
    key: str | None  # None: the bucket itself
    bare: bool = False  # addressed in LMCache's bare form (default bucket)


class Addressing:
    def __init__(self, base_domains: str, default_bucket: str) -> None:
        self.base_domains = tuple(
            "." + d.strip().lower().lstrip(".") for d in base_domains.split(",") if d.strip()
        )
        self.default_bucket = default_bucket

    def target(self, host: str | None, raw_path: str) -> Target:
        """The bucket and key of a request; S3Error(InvalidURI-like InvalidArgument) for bad encoding."""
        path = raw_path[1:] if raw_path.startswith("/") else raw_path
        bucket = self._virtual_bucket(host)
        if bucket is not None:
            return Target(bucket, _decode(path) if path else None)
        first, sep, rest = path.partition("/")
        if not first:
            return Target(None, None)
        name = _decode(first)
        if not _LEGACY_BUCKET_CHARS.fullmatch(name):
            return Target(self.default_bucket, _decode(path), bare=True)
        return Target(name, _decode(rest) if sep and rest else None)

    def _virtual_bucket(self, host: str | None) -> str | None:
        if not host or not self.base_domains:
            return None
        name = host.strip().lower()
        if name.startswith("["):
            return None  # IPv6 literal
        name = name.rsplit(":", 1)[0] if ":" in name else name
        for domain in self.base_domains:
            if name.endswith(domain) and len(name) > len(domain):
                return name[: -len(domain)]
        return None


def _decode(raw: str) -> str:
    try:
        return path_segment(raw)
    except UnicodeDecodeError:
        raise S3Error("InvalidArgument", "The path is not valid percent-encoded UTF-8.") from None


def parse_query(query_string: str) -> dict[str, str]:
    """Query parameters (first value wins); ``?uploads`` gives ``{"uploads": ""}``."""
    if not query_string:
        return {}
    try:
        pairs = parse_qsl(query_string, keep_blank_values=True, encoding="utf-8", errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise S3Error("InvalidArgument", "The query string is not valid percent-encoded UTF-8.") from None
    out: dict[str, str] = {}
    for name, value in pairs:
        out.setdefault(name, value)
    return out


def operation(method: str, target: Target, query: Mapping[str, str], headers: Mapping[str, str]) -> str:
    """The S3 operation name, or ``NotImplemented``. ``headers`` have lower-case names."""
    unknown = [n for n in query if n not in _PARAMS and not n.lower().startswith("x-amz-")]
    if unknown:
        return "NotImplemented"
    if target.bucket is None:
        return "ListBuckets" if method == "GET" else "NotImplemented"
    if target.key is None:
        return _bucket_operation(method, query)
    if any(h in headers for h in _UNIMPLEMENTED_HEADERS):
        return "NotImplemented"
    return _object_operation(method, query)


def _bucket_operation(method: str, query: Mapping[str, str]) -> str:
    if method == "GET":
        if "location" in query:
            return "GetBucketLocation"
        if "uploads" in query:
            return "ListMultipartUploads"
        if "delete" in query or "uploadId" in query:
            return "NotImplemented"
        return "ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"
    if method == "POST" and "delete" in query:
        return "DeleteObjects"
    if query.keys() & {"location", "uploads", "delete", "uploadId", "partNumber"}:
        return "NotImplemented"
    return {"PUT": "CreateBucket", "HEAD": "HeadBucket", "DELETE": "DeleteBucket"}.get(method, "NotImplemented")


def _object_operation(method: str, query: Mapping[str, str]) -> str:
    if query.keys() & {"location", "delete"}:
        return "NotImplemented"
    upload_id = "uploadId" in query
    if method == "PUT":
        if upload_id and "partNumber" in query:
            return "UploadPart"
        return "NotImplemented" if upload_id or "uploads" in query else "PutObject"
    if method == "POST":
        if "uploads" in query and not upload_id:
            return "CreateMultipartUpload"
        return "CompleteMultipartUpload" if upload_id else "NotImplemented"
    if "uploads" in query:
        return "NotImplemented"
    if method == "GET":
        return "ListParts" if upload_id else "GetObject"
    if method == "HEAD":
        return "NotImplemented" if upload_id else "HeadObject"
    if method == "DELETE":
        return "AbortMultipartUpload" if upload_id else "DeleteObject"
    return "NotImplemented"
