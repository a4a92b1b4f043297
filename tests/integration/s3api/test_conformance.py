"""S3 details real clients trip on, each as S3 answers it (found with a public S3 conformance suite)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess
from tests.integration.s3api.conftest import boto3_client
from tests.integration.s3api.test_objects import error_code, status
from tests.integration.s3api.wire import send
from tests.unit.s3.clients import frozen_clock

B = "kvcache"


def test_list_url_encoding_is_percent_twenty_for_a_space(s3_server: ServerProcess, s3: Any) -> None:
    for key in ("quux ab/one", "quux+ab/two", "plain/three"):
        s3.put_object(Bucket=B, Key=key, Body=b"x")
    raw = send(s3_server.url, "GET", f"/{B}", query="delimiter=%2F&encoding-type=url&list-type=2")
    assert raw.status_code == 200
    assert b"<Prefix>quux%20ab/</Prefix>" in raw.content
    assert b"<Prefix>quux%2Bab/</Prefix>" in raw.content  # a literal '+' must not decode to a space
    # boto3 asks for encoding-type=url by itself and decodes with unquote_plus: the prefixes come back exact
    listed = s3.list_objects_v2(Bucket=B, Delimiter="/")
    assert sorted(p["Prefix"] for p in listed["CommonPrefixes"]) == ["plain/", "quux ab/", "quux+ab/"]


def test_empty_continuation_token_is_absent_and_echoed(s3: Any) -> None:
    for i in range(3):
        s3.put_object(Bucket=B, Key=f"ct/{i}", Body=b"x")
    page = s3.list_objects_v2(Bucket=B, Prefix="ct/", ContinuationToken="")
    assert [o["Key"] for o in page["Contents"]] == ["ct/0", "ct/1", "ct/2"]
    assert page["ContinuationToken"] == ""
    with pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket=B, Prefix="ct/", ContinuationToken="not-a-token")
    assert error_code(exc) == "InvalidArgument"


@pytest.mark.parametrize(("expires", "signed_ago"), [(-7200, 0), (0, 0), (60, 7200)])
def test_expired_presigned_url_is_403_access_denied(s3_server: ServerProcess, s3: Any, expires: int,
                                                      signed_ago: int) -> None:
    """Negative, zero, and long-past expiries: S3 answers all three 403 AccessDenied "Request has expired".

    Signed by botocore's pure-Python SigV4 query signer (awscrt's refuses an expiry <= 0, the public
    conformance suite's clients do not), with the signing time set ``signed_ago`` seconds back.
    """
    s3.put_object(Bucket=B, Key="presigned", Body=b"x")
    request = AWSRequest(method="GET", url=f"{s3_server.url}/{B}/presigned")
    when = datetime.now(UTC) - timedelta(seconds=signed_ago)
    with frozen_clock(when):
        S3SigV4QueryAuth(Credentials(ROOT_AK, ROOT_SK), "s3", "us-east-1", expires=expires).add_auth(request)
    assert parse_qs(urlsplit(request.url).query)["X-Amz-Expires"] == [str(expires)]
    r = httpx.get(request.url, timeout=10)
    assert r.status_code == 403
    assert b"<Code>AccessDenied</Code>" in r.content and b"Request has expired" in r.content
    assert r.headers["x-amz-request-id"]


@pytest.mark.parametrize(
    ("sent", "stored"),
    [("aws-chunked,deflate,gzip", "deflate, gzip"), ("aws-chunked, gzip", "gzip"), ("gzip", "gzip"),
     ("aws-chunked", None)],
)
def test_only_the_aws_chunked_content_coding_is_stripped(s3: Any, sent: str, stored: str | None) -> None:
    key = f"coding-{sent}"
    s3.put_object(Bucket=B, Key=key, Body=b"compressed bytes", ContentEncoding=sent)
    assert s3.head_object(Bucket=B, Key=key).get("ContentEncoding") == stored
    assert s3.get_object(Bucket=B, Key=key).get("ContentEncoding") == stored


def test_create_owned_bucket_in_us_east_1_is_200(s3: Any) -> None:
    s3.create_bucket(Bucket="owned")
    again = s3.create_bucket(Bucket="owned")
    assert again["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]].count("owned") == 1


def test_create_owned_bucket_elsewhere_is_409(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "data", env={"KVGW_S3_API_REGION": "eu-west-1"}).start()
    s3 = boto3_client(server.url)
    s3.create_bucket(Bucket="owned", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    with pytest.raises(ClientError) as exc:
        s3.create_bucket(Bucket="owned", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    assert error_code(exc) == "BucketAlreadyOwnedByYou" and status(exc) == 409
