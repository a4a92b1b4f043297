"""XML documents: rendered ones must parse in botocore to what was meant; parsed ones come from botocore."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

import pytest

from gateway.api.s3 import xml as s3xml
from gateway.api.s3.errors import S3Error
from tests.unit.s3.clients import make_client, wire_from_prepared

WHEN = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)
ODD_KEYS = [
    "plain",
    "with space",
    "a+b",
    "100%",
    "ünïcødé/日本語",
    "tab\there",
    "ctl\x01char",
    "cr\rlf\n",
    "<&>\"'",
    "  lead and trail  ",
    "dir/",
]


def botocore_parse(call: Any, body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """What a botocore client makes of ``body`` as the answer to ``call``."""
    client = make_client(response=(status, headers or {}, body))
    return call(client)


def test_timestamp_and_etag_format() -> None:
    assert s3xml.format_timestamp(WHEN) == "2024-05-01T12:00:00.123Z"
    assert s3xml.format_timestamp(datetime(2024, 5, 1)) == "2024-05-01T00:00:00.000Z"
    assert s3xml.format_timestamp(0.5) == "1970-01-01T00:00:00.500Z"
    assert s3xml.format_etag("abc") == '"abc"'
    assert s3xml.format_etag('"abc"') == '"abc"'


def test_list_buckets() -> None:
    body = s3xml.render_list_buckets(
        [s3xml.BucketEntry("a", WHEN), s3xml.BucketEntry("b-2", 1714564800.0)], s3xml.Owner("id1", "me")
    )
    result = botocore_parse(lambda c: c.list_buckets(), body)
    assert [b["Name"] for b in result["Buckets"]] == ["a", "b-2"]
    assert result["Buckets"][0]["CreationDate"] == WHEN.replace(microsecond=123000)
    assert result["Owner"] == {"ID": "id1", "DisplayName": "me"}


def _entries(keys: list[str]) -> list[s3xml.ObjectEntry]:
    return [s3xml.ObjectEntry(k, WHEN, f"etag{i}", i * 10) for i, k in enumerate(keys)]


def test_list_objects_v2_url_encoding_round_trip() -> None:
    """botocore asks for EncodingType=url by default and decodes: keys must come back exact."""
    body = s3xml.render_list_objects_v2(
        bucket="bkt",
        prefix="pre fix+",
        contents=_entries(ODD_KEYS),
        common_prefixes=["cp 1/", "cp+2/ü/"],
        max_keys=1000,
        is_truncated=True,
        delimiter="/",
        continuation_token="tok+/=",
        next_continuation_token="next+/=",
        start_after="after me",
        encoding_type="url",
    )
    result = botocore_parse(lambda c: c.list_objects_v2(Bucket="bkt"), body)
    assert [o["Key"] for o in result["Contents"]] == ODD_KEYS
    assert [p["Prefix"] for p in result["CommonPrefixes"]] == ["cp 1/", "cp+2/ü/"]
    assert result["Prefix"] == "pre fix+"
    assert result["StartAfter"] == "after me"
    assert result["Delimiter"] == "/"
    assert result["IsTruncated"] is True
    assert result["NextContinuationToken"] == "next+/="
    assert result["ContinuationToken"] == "tok+/="
    assert result["KeyCount"] == len(ODD_KEYS) + 2
    first = result["Contents"][1]
    assert first["ETag"] == '"etag1"' and first["Size"] == 10 and first["StorageClass"] == "STANDARD"
    assert first["LastModified"] == WHEN.replace(microsecond=123000)


def test_list_objects_v2_plain_escaping() -> None:
    keys = [k for k in ODD_KEYS if k.isprintable() or "\t" in k]
    body = s3xml.render_list_objects_v2(
        bucket="bkt", prefix="", contents=_entries(keys), common_prefixes=[], max_keys=5, is_truncated=False
    )
    assert b"NextContinuationToken" not in body and b"EncodingType" not in body
    result = botocore_parse(lambda c: c.list_objects_v2(Bucket="bkt", EncodingType=""), body)
    assert [o["Key"] for o in result["Contents"]] == keys


def test_carriage_return_survives_without_encoding() -> None:
    body = s3xml.render_list_objects_v2(
        bucket="bkt", prefix="", contents=_entries(["a\rb"]), common_prefixes=[], max_keys=5, is_truncated=False
    )
    assert b"a&#xD;b" in body
    from xml.etree import ElementTree

    root = ElementTree.fromstring(body)
    assert root.find(f"{{{s3xml.NAMESPACE}}}Contents/{{{s3xml.NAMESPACE}}}Key").text == "a\rb"  # type: ignore[union-attr]


def test_list_objects_v1_with_owner_and_marker() -> None:
    body = s3xml.render_list_objects_v1(
        bucket="bkt",
        prefix="p/",
        marker="p/a b",
        contents=_entries(["p/x y", "p/z"]),
        common_prefixes=["p/sub/"],
        max_keys=2,
        is_truncated=True,
        delimiter="/",
        next_marker="p/z",
        encoding_type="url",
        owner=s3xml.Owner("id1", "me"),
    )
    result = botocore_parse(lambda c: c.list_objects(Bucket="bkt"), body)
    assert [o["Key"] for o in result["Contents"]] == ["p/x y", "p/z"]
    assert result["Marker"] == "p/a b" and result["NextMarker"] == "p/z"
    assert result["Contents"][0]["Owner"] == {"ID": "id1", "DisplayName": "me"}
    assert result["CommonPrefixes"] == [{"Prefix": "p/sub/"}]


def test_multipart_documents() -> None:
    body = s3xml.render_initiate_multipart_upload(bucket="bkt", key="a b", upload_id="u+1/=")
    result = botocore_parse(lambda c: c.create_multipart_upload(Bucket="bkt", Key="a b"), body)
    assert (result["Bucket"], result["Key"], result["UploadId"]) == ("bkt", "a b", "u+1/=")

    body = s3xml.render_complete_multipart_upload(location="/bkt/a%20b", bucket="bkt", key="a b", etag="abc-2")
    result = botocore_parse(
        lambda c: c.complete_multipart_upload(
            Bucket="bkt", Key="a b", UploadId="u", MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": "x"}]}
        ),
        body,
    )
    assert result["ETag"] == '"abc-2"' and result["Key"] == "a b" and result["Location"] == "/bkt/a%20b"

    parts = [s3xml.PartEntry(n, WHEN, f"e{n}", 8 << 20) for n in (3, 4)]
    body = s3xml.render_list_parts(
        bucket="bkt",
        key="k",
        upload_id="u",
        parts=parts,
        part_number_marker=2,
        next_part_number_marker=4,
        max_parts=2,
        is_truncated=True,
        owner=s3xml.Owner("id1"),
    )
    result = botocore_parse(lambda c: c.list_parts(Bucket="bkt", Key="k", UploadId="u"), body)
    assert [(p["PartNumber"], p["ETag"], p["Size"]) for p in result["Parts"]] == [
        (3, '"e3"', 8 << 20),
        (4, '"e4"', 8 << 20),
    ]
    assert result["NextPartNumberMarker"] == 4 and result["IsTruncated"] is True

    uploads = [s3xml.UploadEntry("k 1", "u1", WHEN), s3xml.UploadEntry("k+2", "u2", WHEN)]
    body = s3xml.render_list_multipart_uploads(
        bucket="bkt",
        uploads=uploads,
        common_prefixes=["d/"],
        max_uploads=10,
        is_truncated=False,
        prefix="",
        delimiter="/",
        encoding_type="url",
    )
    result = botocore_parse(lambda c: c.list_multipart_uploads(Bucket="bkt", EncodingType="url"), body)
    # botocore decodes only object listings; a caller asking for url encoding decodes uploads itself
    assert [(unquote_plus(u["Key"]), u["UploadId"]) for u in result["Uploads"]] == [("k 1", "u1"), ("k+2", "u2")]
    assert result["CommonPrefixes"] == [{"Prefix": "d/"}]


@pytest.mark.parametrize("quiet", [False, True])
def test_delete_result(quiet: bool) -> None:
    body = s3xml.render_delete_result(
        ["a", "b c"], [s3xml.DeleteError("x", "AccessDenied", "Access Denied")], quiet=quiet
    )
    result = botocore_parse(lambda c: c.delete_objects(Bucket="bkt", Delete={"Objects": [{"Key": "a"}]}), body)
    assert result.get("Deleted", []) == ([] if quiet else [{"Key": "a"}, {"Key": "b c"}])
    assert result["Errors"] == [{"Key": "x", "Code": "AccessDenied", "Message": "Access Denied"}]


@pytest.mark.parametrize(("region", "expected"), [("us-east-1", None), ("eu-west-1", "eu-west-1")])
def test_location_constraint(region: str, expected: str | None) -> None:
    result = botocore_parse(lambda c: c.get_bucket_location(Bucket="bkt"), s3xml.render_location_constraint(region))
    assert result.get("LocationConstraint") == expected


# -- parsing -----------------------------------------------------------------------------------------------


def _captured_body(call: Any) -> bytes:
    captured: list[Any] = []
    call(make_client(captured=captured))
    return wire_from_prepared(captured[-1]).body


def test_parse_complete_multipart_upload_from_botocore() -> None:
    body = _captured_body(
        lambda c: c.complete_multipart_upload(
            Bucket="bkt",
            Key="k",
            UploadId="u",
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"aa"'}, {"PartNumber": 2, "ETag": "bb"}]},
        )
    )
    assert s3xml.parse_complete_multipart_upload(body) == [
        s3xml.CompletedPart(1, "aa"),
        s3xml.CompletedPart(2, "bb"),
    ]


def test_parse_complete_multipart_upload_lmcache_shape() -> None:
    """No namespace, no declaration, unquoted ETags, whitespace between elements."""
    body = b"""<CompleteMultipartUpload>
      <Part><ETag>0123abcd</ETag><PartNumber>1</PartNumber></Part>
      <Part><PartNumber> 2 </PartNumber><ETag>&quot;4567&quot;</ETag></Part>
    </CompleteMultipartUpload>"""
    assert s3xml.parse_complete_multipart_upload(body) == [
        s3xml.CompletedPart(1, "0123abcd"),
        s3xml.CompletedPart(2, "4567"),
    ]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "MalformedXML"),
        (b"<CompleteMultipartUpload/>", "MalformedXML"),
        (b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber></Part></CompleteMultipartUpload>", "MalformedXML"),
        (
            b"<CompleteMultipartUpload><Part><PartNumber>x</PartNumber><ETag>a</ETag></Part></CompleteMultipartUpload>",
            "MalformedXML",
        ),
        (
            b"<CompleteMultipartUpload><Part><PartNumber>0</PartNumber><ETag>a</ETag></Part></CompleteMultipartUpload>",
            "MalformedXML",
        ),
        (
            b"<CompleteMultipartUpload><Part><PartNumber>10001</PartNumber><ETag>a</ETag></Part>"
            b"</CompleteMultipartUpload>",
            "MalformedXML",
        ),
        (
            b"<CompleteMultipartUpload><Part><PartNumber>2</PartNumber><ETag>a</ETag></Part>"
            b"<Part><PartNumber>1</PartNumber><ETag>b</ETag></Part></CompleteMultipartUpload>",
            "InvalidPartOrder",
        ),
        (
            b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>a</ETag></Part>"
            b"<Part><PartNumber>1</PartNumber><ETag>b</ETag></Part></CompleteMultipartUpload>",
            "InvalidPartOrder",
        ),
        (b"<Other><Part/></Other>", "MalformedXML"),
        (b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>a</ETag>", "MalformedXML"),
        (b'<x:CompleteMultipartUpload xmlns:x="urn:other"/>', "MalformedXML"),
    ],
)
def test_parse_complete_multipart_upload_rejects(body: bytes, code: str) -> None:
    with pytest.raises(S3Error) as info:
        s3xml.parse_complete_multipart_upload(body)
    assert info.value.code == code


@pytest.mark.parametrize(
    "body",
    [
        b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY e "x">]><Delete><Object><Key>&e;</Key></Object></Delete>',
        b'<!DOCTYPE Delete SYSTEM "http://127.0.0.1/evil.dtd"><Delete><Object><Key>a</Key></Object></Delete>',
        b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>'
        b"<Delete><Object><Key>&lol2;</Key></Object></Delete>",
        b'<!DOCTYPE Delete [<!ENTITY x SYSTEM "file:///etc/passwd">]><Delete><Object><Key>&x;</Key></Object></Delete>',
    ],
    ids=["internal-entity", "external-dtd", "billion-laughs", "external-entity"],
)
def test_dtd_and_entities_are_rejected(body: bytes) -> None:
    with pytest.raises(S3Error) as info:
        s3xml.parse_delete(body)
    assert info.value.code == "MalformedXML"


def test_oversized_body() -> None:
    part = b"<Part><PartNumber>1</PartNumber><ETag>a</ETag></Part>"
    body = b"<CompleteMultipartUpload>" + part * (s3xml.MAX_XML_BODY // len(part) + 1) + b"</CompleteMultipartUpload>"
    with pytest.raises(S3Error, match="larger"):
        s3xml.parse_complete_multipart_upload(body)


@pytest.mark.parametrize("quiet", [True, False])
def test_parse_delete_from_botocore(quiet: bool) -> None:
    keys = ["a", " spaced key ", "ü/x", "<&>"]
    body = _captured_body(
        lambda c: c.delete_objects(
            Bucket="bkt",
            Delete={"Objects": [{"Key": k} for k in keys] + [{"Key": "v", "VersionId": "v1"}], "Quiet": quiet},
        )
    )
    request = s3xml.parse_delete(body)
    assert request.quiet is quiet
    assert request.keys == [(k, None) for k in keys] + [("v", "v1")]


@pytest.mark.parametrize(
    "body",
    [
        b"<Delete/>",
        b"<Delete><Quiet>maybe</Quiet><Object><Key>a</Key></Object></Delete>",
        b"<Delete><Object/></Delete>",
        b"<Delete><Object><Key>a</Key><Key>b</Key></Object></Delete>",
        b"<Delete><Thing/><Object><Key>a</Key></Object></Delete>",
        b"<Delete>" + b"<Object><Key>a</Key></Object>" * 1001 + b"</Delete>",
    ],
)
def test_parse_delete_rejects(body: bytes) -> None:
    with pytest.raises(S3Error) as info:
        s3xml.parse_delete(body)
    assert info.value.code == "MalformedXML"


def test_parse_create_bucket_configuration() -> None:
    body = _captured_body(
        lambda c: c.create_bucket(Bucket="bkt", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    )
    assert s3xml.parse_create_bucket_configuration(body) == "eu-west-1"
    assert s3xml.parse_create_bucket_configuration(b"") is None
    assert s3xml.parse_create_bucket_configuration(b"<CreateBucketConfiguration/>") is None
    with pytest.raises(S3Error):
        s3xml.parse_create_bucket_configuration(b"<nope")
