"""Buckets and listings through boto3: create / head / delete (empty only) / location, ListObjectsV2
and ListObjects v1 with prefix, delimiter, max-keys, continuation and markers."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess
from tests.integration.s3api.test_objects import error_code, status
from tests.integration.s3api.wire import send


def test_bucket_lifecycle(s3: Any) -> None:
    names = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert names == ["kvcache"]
    s3.create_bucket(Bucket="alpha")
    s3.head_bucket(Bucket="alpha")
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["alpha", "kvcache"]
    assert s3.get_bucket_location(Bucket="alpha")["LocationConstraint"] is None  # us-east-1
    s3.create_bucket(Bucket="alpha")  # already yours: 200 in us-east-1 (test_conformance.py has the rest)
    s3.put_object(Bucket="alpha", Key="k", Body=b"x")
    with pytest.raises(ClientError) as exc:
        s3.delete_bucket(Bucket="alpha")
    assert error_code(exc) == "BucketNotEmpty" and status(exc) == 409
    s3.delete_object(Bucket="alpha", Key="k")
    s3.delete_bucket(Bucket="alpha")
    with pytest.raises(ClientError) as exc:
        s3.head_bucket(Bucket="alpha")
    assert status(exc) == 404
    with pytest.raises(ClientError) as exc:
        s3.delete_bucket(Bucket="alpha")
    assert error_code(exc) == "NoSuchBucket"
    with pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket="alpha")
    assert error_code(exc) == "NoSuchBucket"


@pytest.mark.parametrize("name", ["Bad_Name", "ab", "bad..name", "192.168.0.1", "-start"])
def test_invalid_bucket_names(s3: Any, name: str) -> None:
    with pytest.raises(ClientError) as exc:
        s3.create_bucket(Bucket=name)
    assert error_code(exc) == "InvalidBucketName" and status(exc) == 400


def test_bucket_created_with_location_constraint(s3: Any) -> None:
    s3.create_bucket(Bucket="beta-eu", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    s3.head_bucket(Bucket="beta-eu")


def test_malformed_xml(s3_server: ServerProcess) -> None:
    r = send(s3_server.url, "POST", "/kvcache", query="delete", body=b"<Delete><Object>",
             headers={"Content-Type": "application/xml"})
    assert r.status_code == 400 and b"<Code>MalformedXML</Code>" in r.content


KEYS = ["a", "a/1", "a/2", "a/b/1", "b", "b/1", "c/x/y", "d€/1", "e", "e f"]


@pytest.fixture
def filled(s3: Any) -> Any:
    for key in KEYS:
        s3.put_object(Bucket="kvcache", Key=key, Body=key.encode())
    return s3


def _all_v2(s3: Any, **kwargs: Any) -> tuple[list[str], list[str], int]:
    keys: list[str] = []
    prefixes: list[str] = []
    pages = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kvcache", **kwargs):
        pages += 1
        keys += [o["Key"] for o in page.get("Contents", [])]
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    return keys, prefixes, pages


def test_list_v2(filled: Any) -> None:
    s3 = filled
    keys, prefixes, _ = _all_v2(s3)
    assert keys == sorted(KEYS, key=lambda k: k.encode()) and prefixes == []
    keys, prefixes, pages = _all_v2(s3, PaginationConfig={"PageSize": 3})
    assert keys == sorted(KEYS, key=lambda k: k.encode()) and pages == 4
    keys, prefixes, _ = _all_v2(s3, Delimiter="/")
    assert keys == ["a", "b", "e", "e f"] and prefixes == ["a/", "b/", "c/", "d€/"]
    keys, prefixes, pages = _all_v2(s3, Delimiter="/", PaginationConfig={"PageSize": 1})
    assert keys == ["a", "b", "e", "e f"] and prefixes == ["a/", "b/", "c/", "d€/"] and pages == 8
    keys, prefixes, _ = _all_v2(s3, Prefix="a/", Delimiter="/")
    assert keys == ["a/1", "a/2"] and prefixes == ["a/b/"]
    keys, _, _ = _all_v2(s3, StartAfter="b/1")
    assert keys == ["c/x/y", "d€/1", "e", "e f"]
    page = s3.list_objects_v2(Bucket="kvcache", MaxKeys=2)
    assert page["IsTruncated"] and page["KeyCount"] == 2 and page["NextContinuationToken"]
    entry = s3.list_objects_v2(Bucket="kvcache", Prefix="b/1")["Contents"][0]
    assert entry["Size"] == 3 and entry["ETag"] == s3.head_object(Bucket="kvcache", Key="b/1")["ETag"]
    page = s3.list_objects_v2(Bucket="kvcache", EncodingType="url", Prefix="e")
    assert [o["Key"] for o in page["Contents"]] == ["e", "e%20f"]  # asked for explicitly: botocore leaves it encoded
    with pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket="kvcache", ContinuationToken="garbage!")
    assert error_code(exc) == "InvalidArgument"


def test_list_v1(filled: Any) -> None:
    s3 = filled
    keys = []
    for page in s3.get_paginator("list_objects").paginate(Bucket="kvcache", PaginationConfig={"PageSize": 4}):
        keys += [o["Key"] for o in page.get("Contents", [])]
    assert keys == sorted(KEYS, key=lambda k: k.encode())
    page = s3.list_objects(Bucket="kvcache", Delimiter="/", MaxKeys=2)
    assert page["IsTruncated"] and page["NextMarker"] == "a/"
    nxt = s3.list_objects(Bucket="kvcache", Delimiter="/", Marker=page["NextMarker"])
    assert [o["Key"] for o in nxt["Contents"]] == ["b", "e", "e f"]
    assert [p["Prefix"] for p in nxt["CommonPrefixes"]] == ["b/", "c/", "d€/"]
    assert s3.list_objects(Bucket="kvcache", Marker="d")["Contents"][0]["Key"] == "d€/1"
