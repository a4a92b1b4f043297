"""S3 XML: rendering of response documents and safe parsing of request documents.

Rendering builds strings directly (a 1000-key listing is the hot path) from small value types the
front end fills from service results. Timestamps are ISO-8601 UTC with milliseconds (``...T..:..:..
.000Z``), ETags are quoted, and ``encoding_type="url"`` percent-encodes the fields S3 encodes
(keys, prefixes, delimiter, markers) the way botocore decodes them (``unquote_plus``).

Parsing goes through ``defusedxml`` (no DTD, no entities, no external references) after a size check,
and anything unexpected is MalformedXML. The namespace is optional on input, as clients differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Literal
from urllib.parse import quote
from xml.etree.ElementTree import Element, ParseError

import defusedxml.ElementTree as safe_et
from defusedxml import DefusedXmlException

from gateway.api.s3._xmltext import escape_text
from gateway.api.s3.errors import S3Error

__all__ = [
    "MAX_DELETE_OBJECTS",
    "MAX_PARTS",
    "MAX_XML_BODY",
    "NAMESPACE",
    "BucketEntry",
    "CompletedPart",
    "DeleteError",
    "DeleteRequest",
    "ObjectEntry",
    "Owner",
    "PartEntry",
    "UploadEntry",
    "format_etag",
    "format_timestamp",
    "parse_complete_multipart_upload",
    "parse_create_bucket_configuration",
    "parse_delete",
    "render_complete_multipart_upload",
    "render_delete_result",
    "render_initiate_multipart_upload",
    "render_list_buckets",
    "render_list_multipart_uploads",
    "render_list_objects_v1",
    "render_list_objects_v2",
    "render_list_parts",
    "render_location_constraint",
]

NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
MAX_XML_BODY = 2 * 1024 * 1024  # 10,000 parts of CompleteMultipartUpload fit with room to spare
MAX_PARTS = 10_000
MAX_DELETE_OBJECTS = 1000

_DECL = '<?xml version="1.0" encoding="UTF-8"?>\n'
Timestamp = datetime | float
EncodingType = Literal["url"] | None


# -- value types ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Owner:
    id: str
    display_name: str = ""


@dataclass(frozen=True, slots=True)
class BucketEntry:
    name: str
    created: Timestamp


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    key: str
    last_modified: Timestamp
    etag: str
    size: int
    storage_class: str = "STANDARD"


@dataclass(frozen=True, slots=True)
class PartEntry:
    part_number: int
    last_modified: Timestamp
    etag: str
    size: int


@dataclass(frozen=True, slots=True)
class UploadEntry:
    key: str
    upload_id: str
    initiated: Timestamp
    storage_class: str = "STANDARD"


@dataclass(frozen=True, slots=True)
class CompletedPart:
    part_number: int
    etag: str  # without quotes


@dataclass(frozen=True, slots=True)
class DeleteRequest:
    keys: list[tuple[str, str | None]]  # (key, version id)
    quiet: bool


@dataclass(frozen=True, slots=True)
class DeleteError:
    key: str
    code: str
    message: str


# -- small formatters ------------------------------------------------------------------------------------


def format_timestamp(when: Timestamp) -> str:
    """``2024-05-01T12:00:00.123Z``; a naive datetime is taken as UTC, a float as epoch seconds."""
    if isinstance(when, datetime):
        moment = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    else:
        moment = datetime.fromtimestamp(when, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def format_etag(etag: str) -> str:
    """ETags always travel quoted; accept a stored value with or without quotes."""
    return etag if len(etag) >= 2 and etag[0] == '"' and etag[-1] == '"' else f'"{etag}"'


def _el(name: str, value: str | int | bool | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"<{name}>{'true' if value else 'false'}</{name}>"
    return f"<{name}>{escape_text(str(value))}</{name}>"


def _coded(value: str | None, encoding_type: EncodingType) -> str | None:
    if value is None or encoding_type is None:
        return value
    return quote(value, safe="/")  # as S3: a space is %20 (botocore decodes with unquote_plus, so "+" must be %2B)


def _doc(root: str, body: Iterable[str]) -> bytes:
    return (_DECL + f'<{root} xmlns="{NAMESPACE}">' + "".join(body) + f"</{root}>").encode("utf-8")


def _owner(tag: str, owner: Owner | None) -> str:
    if owner is None:
        return ""
    return f"<{tag}>{_el('ID', owner.id)}{_el('DisplayName', owner.display_name)}</{tag}>"


def _contents(entry: ObjectEntry, encoding_type: EncodingType, owner: Owner | None) -> str:
    return (
        f"<Contents>{_el('Key', _coded(entry.key, encoding_type))}"
        f"<LastModified>{format_timestamp(entry.last_modified)}</LastModified>"
        f"<ETag>{escape_text(format_etag(entry.etag))}</ETag><Size>{entry.size}</Size>"
        f"{_owner('Owner', owner)}<StorageClass>{escape_text(entry.storage_class)}</StorageClass></Contents>"
    )


def _common_prefixes(prefixes: Iterable[str], encoding_type: EncodingType) -> str:
    return "".join(f"<CommonPrefixes>{_el('Prefix', _coded(p, encoding_type))}</CommonPrefixes>" for p in prefixes)


# -- renderers -------------------------------------------------------------------------------------------


def render_list_buckets(buckets: Iterable[BucketEntry], owner: Owner) -> bytes:
    entries = "".join(
        f"<Bucket>{_el('Name', b.name)}<CreationDate>{format_timestamp(b.created)}</CreationDate></Bucket>"
        for b in buckets
    )
    return _doc("ListAllMyBucketsResult", (_owner("Owner", owner), f"<Buckets>{entries}</Buckets>"))


def render_list_objects_v2(
    *,
    bucket: str,
    prefix: str,
    contents: Sequence[ObjectEntry],
    common_prefixes: Sequence[str],
    max_keys: int,
    is_truncated: bool,
    delimiter: str | None = None,
    continuation_token: str | None = None,
    next_continuation_token: str | None = None,
    start_after: str | None = None,
    encoding_type: EncodingType = None,
    owner: Owner | None = None,
) -> bytes:
    """ListObjectsV2. ``owner`` only when the request had ``fetch-owner=true``."""
    head = (
        _el("Name", bucket),
        _el("Prefix", _coded(prefix, encoding_type)),
        _el("StartAfter", _coded(start_after, encoding_type)),
        _el("ContinuationToken", continuation_token),
        _el("NextContinuationToken", next_continuation_token if is_truncated else None),
        _el("KeyCount", len(contents) + len(common_prefixes)),
        _el("MaxKeys", max_keys),
        _el("Delimiter", _coded(delimiter, encoding_type)),
        _el("EncodingType", encoding_type),
        _el("IsTruncated", is_truncated),
    )
    body = "".join(_contents(entry, encoding_type, owner) for entry in contents)
    return _doc("ListBucketResult", (*head, body, _common_prefixes(common_prefixes, encoding_type)))


def render_list_objects_v1(
    *,
    bucket: str,
    prefix: str,
    marker: str,
    contents: Sequence[ObjectEntry],
    common_prefixes: Sequence[str],
    max_keys: int,
    is_truncated: bool,
    delimiter: str | None = None,
    next_marker: str | None = None,
    encoding_type: EncodingType = None,
    owner: Owner | None = None,
) -> bytes:
    """ListObjects (v1). S3 sends NextMarker only with a delimiter; clients without one continue
    from the last key, so pass ``next_marker`` only when ``delimiter`` is set and truncated."""
    head = (
        _el("Name", bucket),
        _el("Prefix", _coded(prefix, encoding_type)),
        _el("Marker", _coded(marker, encoding_type)),
        _el("NextMarker", _coded(next_marker, encoding_type) if is_truncated else None),
        _el("MaxKeys", max_keys),
        _el("Delimiter", _coded(delimiter, encoding_type)),
        _el("EncodingType", encoding_type),
        _el("IsTruncated", is_truncated),
    )
    body = "".join(_contents(entry, encoding_type, owner) for entry in contents)
    return _doc("ListBucketResult", (*head, body, _common_prefixes(common_prefixes, encoding_type)))


def render_initiate_multipart_upload(*, bucket: str, key: str, upload_id: str) -> bytes:
    return _doc("InitiateMultipartUploadResult", (_el("Bucket", bucket), _el("Key", key), _el("UploadId", upload_id)))


def render_complete_multipart_upload(*, location: str, bucket: str, key: str, etag: str) -> bytes:
    return _doc(
        "CompleteMultipartUploadResult",
        (_el("Location", location), _el("Bucket", bucket), _el("Key", key), _el("ETag", format_etag(etag))),
    )


def render_list_parts(
    *,
    bucket: str,
    key: str,
    upload_id: str,
    parts: Sequence[PartEntry],
    part_number_marker: int,
    next_part_number_marker: int,
    max_parts: int,
    is_truncated: bool,
    owner: Owner | None = None,
    storage_class: str = "STANDARD",
) -> bytes:
    body = "".join(
        f"<Part><PartNumber>{p.part_number}</PartNumber>"
        f"<LastModified>{format_timestamp(p.last_modified)}</LastModified>"
        f"<ETag>{escape_text(format_etag(p.etag))}</ETag><Size>{p.size}</Size></Part>"
        for p in parts
    )
    head = (
        _el("Bucket", bucket),
        _el("Key", key),
        _el("UploadId", upload_id),
        _owner("Initiator", owner),
        _owner("Owner", owner),
        _el("StorageClass", storage_class),
        _el("PartNumberMarker", part_number_marker),
        _el("NextPartNumberMarker", next_part_number_marker),
        _el("MaxParts", max_parts),
        _el("IsTruncated", is_truncated),
    )
    return _doc("ListPartsResult", (*head, body))


def render_list_multipart_uploads(
    *,
    bucket: str,
    uploads: Sequence[UploadEntry],
    common_prefixes: Sequence[str],
    max_uploads: int,
    is_truncated: bool,
    key_marker: str = "",
    upload_id_marker: str = "",
    next_key_marker: str = "",
    next_upload_id_marker: str = "",
    prefix: str | None = None,
    delimiter: str | None = None,
    encoding_type: EncodingType = None,
    owner: Owner | None = None,
) -> bytes:
    body = "".join(
        f"<Upload>{_el('Key', _coded(u.key, encoding_type))}{_el('UploadId', u.upload_id)}"
        f"{_owner('Initiator', owner)}{_owner('Owner', owner)}{_el('StorageClass', u.storage_class)}"
        f"<Initiated>{format_timestamp(u.initiated)}</Initiated></Upload>"
        for u in uploads
    )
    head = (
        _el("Bucket", bucket),
        _el("KeyMarker", _coded(key_marker, encoding_type)),
        _el("UploadIdMarker", upload_id_marker),
        _el("NextKeyMarker", _coded(next_key_marker, encoding_type)),
        _el("NextUploadIdMarker", next_upload_id_marker),
        _el("Delimiter", _coded(delimiter, encoding_type)),
        _el("Prefix", _coded(prefix, encoding_type)),
        _el("EncodingType", encoding_type),
        _el("MaxUploads", max_uploads),
        _el("IsTruncated", is_truncated),
    )
    return _doc("ListMultipartUploadsResult", (*head, body, _common_prefixes(common_prefixes, encoding_type)))


def render_delete_result(deleted: Iterable[str], errors: Iterable[DeleteError], *, quiet: bool) -> bytes:
    """DeleteObjects answer; in quiet mode S3 lists only the failures."""
    done = "" if quiet else "".join(f"<Deleted>{_el('Key', key)}</Deleted>" for key in deleted)
    failed = "".join(
        f"<Error>{_el('Key', e.key)}{_el('Code', e.code)}{_el('Message', e.message)}</Error>" for e in errors
    )
    return _doc("DeleteResult", (done, failed))


def render_location_constraint(region: str) -> bytes:
    """GetBucketLocation: us-east-1 is the empty constraint, by S3's historical convention."""
    value = "" if region == "us-east-1" else escape_text(region)
    return (_DECL + f'<LocationConstraint xmlns="{NAMESPACE}">{value}</LocationConstraint>').encode("utf-8")


# -- parsing ---------------------------------------------------------------------------------------------


def _parse(body: bytes, root: str) -> Element:
    if len(body) > MAX_XML_BODY:
        raise S3Error("MalformedXML", "The XML you provided was larger than the maximum allowed.")
    if not body.strip():
        raise S3Error("MalformedXML")
    try:
        element: Element = safe_et.fromstring(body, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except (ParseError, DefusedXmlException, ValueError):
        raise S3Error("MalformedXML") from None
    if _local(element.tag) != root:
        raise S3Error("MalformedXML")
    return element


def _local(tag: str) -> str:
    """Tag name without its namespace; an element in a foreign namespace keeps a marker and never
    matches an S3 name."""
    if tag.startswith("{"):
        namespace, _, name = tag[1:].partition("}")
        return name if namespace == NAMESPACE else "{" + tag
    return tag


def _children(element: Element) -> list[tuple[str, Element]]:
    return [(_local(child.tag), child) for child in element]


def _one_text(element: Element, name: str, *, strip: bool = True) -> str:
    found = [child for local, child in _children(element) if local == name]
    if len(found) != 1:
        raise S3Error("MalformedXML")
    text = found[0].text or ""
    return text.strip() if strip else text


def parse_complete_multipart_upload(body: bytes) -> list[CompletedPart]:
    """Parts in request order, ETags without quotes. Not ascending (or repeated) part numbers is
    InvalidPartOrder, as S3 answers it; an empty list or a bad number is MalformedXML."""
    root = _parse(body, "CompleteMultipartUpload")
    parts: list[CompletedPart] = []
    for local, child in _children(root):
        if local != "Part":
            raise S3Error("MalformedXML")
        number_text = _one_text(child, "PartNumber")
        if not number_text.isdigit() or not 1 <= int(number_text) <= MAX_PARTS:
            raise S3Error("MalformedXML")
        etag = _one_text(child, "ETag")
        if len(etag) >= 2 and etag[0] == '"' and etag[-1] == '"':
            etag = etag[1:-1]
        elif etag.startswith("&quot;") and etag.endswith("&quot;"):  # doubly escaped by some clients
            etag = etag[6:-6]
        parts.append(CompletedPart(int(number_text), etag))
    if not parts or len(parts) > MAX_PARTS:
        raise S3Error("MalformedXML")
    for previous, current in pairwise(parts):
        if current.part_number <= previous.part_number:
            raise S3Error("InvalidPartOrder")
    return parts


def parse_delete(body: bytes) -> DeleteRequest:
    """DeleteObjects request: 1 to 1000 keys (kept exactly, whitespace included) and Quiet."""
    root = _parse(body, "Delete")
    keys: list[tuple[str, str | None]] = []
    quiet = False
    for local, child in _children(root):
        if local == "Quiet":
            value = (child.text or "").strip().lower()
            if value not in ("true", "false"):
                raise S3Error("MalformedXML")
            quiet = value == "true"
        elif local == "Object":
            key = _one_text(child, "Key", strip=False)
            versions = [c for name, c in _children(child) if name == "VersionId"]
            if len(versions) > 1:
                raise S3Error("MalformedXML")
            keys.append((key, (versions[0].text or "").strip() if versions else None))
        else:
            raise S3Error("MalformedXML")
    if not keys or len(keys) > MAX_DELETE_OBJECTS:
        raise S3Error("MalformedXML")
    return DeleteRequest(keys, quiet)


def parse_create_bucket_configuration(body: bytes) -> str | None:
    """The LocationConstraint of a CreateBucket body; None for an empty body or no constraint."""
    if not body.strip():
        return None
    root = _parse(body, "CreateBucketConfiguration")
    for local, child in _children(root):
        if local == "LocationConstraint":
            return (child.text or "").strip() or None
    return None
