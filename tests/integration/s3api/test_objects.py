"""Objects through boto3 against a real ``kvgw serve``: write-once, reads, ranges, conditions,
metadata, checksums, errors, and cross-visibility with the native API."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess, wait_for
from tests.integration.s3api.conftest import boto3_client
from tests.integration.s3api.wire import raw_exchange, request_head, send, sign

B = "kvcache"


def error_code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return str(exc.value.response["Error"]["Code"])


def status(exc: pytest.ExceptionInfo[ClientError]) -> int:
    return int(exc.value.response["ResponseMetadata"]["HTTPStatusCode"])


def test_put_get_head_delete(s3: Any) -> None:
    data = os.urandom(100_000)
    put = s3.put_object(Bucket=B, Key="dir/obj one+€", Body=data, ContentType="application/x-kv",
                        Metadata={"model": "llama"}, CacheControl="no-cache")
    assert put["ResponseMetadata"]["HTTPHeaders"]["x-amz-request-id"]
    got = s3.get_object(Bucket=B, Key="dir/obj one+€")
    assert got["Body"].read() == data
    assert got["ETag"] == put["ETag"]
    assert got["ContentType"] == "application/x-kv"
    assert got["Metadata"] == {"model": "llama"}
    assert got["CacheControl"] == "no-cache"
    head = s3.head_object(Bucket=B, Key="dir/obj one+€")
    assert head["ContentLength"] == len(data) and head["ETag"] == put["ETag"]
    s3.delete_object(Bucket=B, Key="dir/obj one+€")
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="dir/obj one+€")
    assert error_code(exc) == "NoSuchKey" and status(exc) == 404
    assert exc.value.response["ResponseMetadata"]["HTTPHeaders"]["x-amz-request-id"]
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key="dir/obj one+€")
    assert status(exc) == 404
    s3.delete_object(Bucket=B, Key="never-existed")  # idempotent, as S3


def test_an_empty_object_is_refused_by_default(s3: Any) -> None:
    """A KV chunk is never empty: PutObject and UploadPart of no bytes answer 400 and store nothing."""
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=B, Key="empty", Body=b"")
    assert error_code(exc) == "MissingRequestBodyError" and status(exc) == 400
    assert "--allow-empty-objects" in exc.value.response["Error"]["Message"]
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key="empty")
    assert status(exc) == 404
    upload = s3.create_multipart_upload(Bucket=B, Key="empty-parts")["UploadId"]
    with pytest.raises(ClientError) as exc:
        s3.upload_part(Bucket=B, Key="empty-parts", UploadId=upload, PartNumber=1, Body=b"")
    assert error_code(exc) == "MissingRequestBodyError" and status(exc) == 400
    assert s3.list_parts(Bucket=B, Key="empty-parts", UploadId=upload).get("Parts", []) == []
    s3.abort_multipart_upload(Bucket=B, Key="empty-parts", UploadId=upload)
    s3.put_object(Bucket=B, Key="empty", Body=b"x")  # the key is free for the real write
    assert s3.get_object(Bucket=B, Key="empty")["Body"].read() == b"x"


def test_an_empty_chunked_body_is_refused(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    """A PutObject in Transfer-Encoding: chunked, no length (the body's end decides its size), that ends
    without a byte: refused when it ends, nothing published."""

    def nothing() -> Iterator[bytes]:
        yield from ()

    server = server_factory(data_dir=tmp_path / "d", extra_args=["--anonymous"]).start()
    r = httpx.put(f"{server.url}/kvcache/chunked-empty", content=nothing(), timeout=30,
                  headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    assert r.headers.get("transfer-encoding") is None and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 400 and "<Code>MissingRequestBodyError</Code>" in r.text
    assert httpx.head(f"{server.url}/kvcache/chunked-empty", timeout=30).status_code == 404


def test_empty_objects_in_a_bucket_that_allows_them(s3: Any, s3_server: ServerProcess) -> None:
    """``kvgw bucket create --allow-empty-objects``: for buckets generic S3 tools use."""
    subprocess.run([sys.executable, "-m", "gateway.cli", "bucket", "create", "generic", "--allow-empty-objects",
                    "--data-dir", str(s3_server.data_dir)], check=True, capture_output=True,
                   env={**os.environ, "KVGW_ROOT_ACCESS_KEY": "", "KVGW_ROOT_SECRET_KEY": ""})
    s3.put_object(Bucket="generic", Key="empty", Body=b"")
    assert s3.get_object(Bucket="generic", Key="empty")["Body"].read() == b""
    assert s3.head_object(Bucket="generic", Key="empty")["ContentLength"] == 0
    upload = s3.create_multipart_upload(Bucket="generic", Key="parts")["UploadId"]
    etag = s3.upload_part(Bucket="generic", Key="parts", UploadId=upload, PartNumber=1, Body=b"")["ETag"]
    s3.complete_multipart_upload(Bucket="generic", Key="parts", UploadId=upload,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert s3.head_object(Bucket="generic", Key="parts")["ContentLength"] == 0


def test_write_once_keeps_the_first_bytes(s3: Any) -> None:
    first = s3.put_object(Bucket=B, Key="once", Body=b"first")
    second = s3.put_object(Bucket=B, Key="once", Body=b"second, longer")
    assert second["ETag"] == first["ETag"]
    assert s3.get_object(Bucket=B, Key="once")["Body"].read() == b"first"
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=B, Key="once", Body=b"x", IfNoneMatch="*")
    assert error_code(exc) == "PreconditionFailed" and status(exc) == 412
    fresh = s3.put_object(Bucket=B, Key="fresh", Body=b"x", IfNoneMatch="*")
    assert fresh["ETag"]


def test_etag_is_the_chunk_checksum_not_md5(s3: Any, native: httpx.Client) -> None:
    data = os.urandom(5000)
    etag = s3.put_object(Bucket=B, Key="etag", Body=data)["ETag"]
    assert len(etag) == 18 and etag != f'"{hashlib.md5(data).hexdigest()}"'
    assert native.head(f"/v1/buckets/{B}/chunks/etag").headers["etag"] == etag


def test_ranges(s3: Any) -> None:
    data = bytes(range(256)) * 40
    s3.put_object(Bucket=B, Key="ranged", Body=data)
    cases = {"bytes=0-9": data[0:10], "bytes=100-": data[100:], "bytes=-7": data[-7:],
             "bytes=10000-20000": data[10000:], "bytes=0-99999": data}
    for spec, expected in cases.items():
        got = s3.get_object(Bucket=B, Key="ranged", Range=spec)
        assert got["Body"].read() == expected, spec
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert got["ContentRange"].endswith(f"/{len(data)}")
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="ranged", Range=f"bytes={len(data)}-")
    assert error_code(exc) == "InvalidRange" and status(exc) == 416
    assert exc.value.response["ResponseMetadata"]["HTTPHeaders"]["content-range"] == f"bytes */{len(data)}"


def test_conditional_reads(s3: Any) -> None:
    etag = s3.put_object(Bucket=B, Key="cond", Body=b"conditional")["ETag"]
    assert s3.get_object(Bucket=B, Key="cond", IfMatch=etag)["Body"].read() == b"conditional"
    assert s3.get_object(Bucket=B, Key="cond", IfMatch=etag.strip('"'), Range="bytes=0-3")["Body"].read() == b"cond"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="cond", IfMatch='"0000000000000000"')
    assert error_code(exc) == "PreconditionFailed" and status(exc) == 412
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="cond", IfNoneMatch=etag)
    assert status(exc) == 304
    assert s3.get_object(Bucket=B, Key="cond", IfNoneMatch='"other"')["Body"].read() == b"conditional"
    future, past = datetime.now(UTC) + timedelta(hours=1), datetime.now(UTC) - timedelta(hours=1)
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="cond", IfModifiedSince=future)
    assert status(exc) == 304
    assert s3.get_object(Bucket=B, Key="cond", IfModifiedSince=past)["Body"].read() == b"conditional"
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=B, Key="cond", IfUnmodifiedSince=past)
    assert error_code(exc) == "PreconditionFailed"
    assert s3.get_object(Bucket=B, Key="cond", IfUnmodifiedSince=future)["Body"].read() == b"conditional"
    # If-Match wins over a failing If-Unmodified-Since, as in S3
    assert s3.get_object(Bucket=B, Key="cond", IfMatch=etag, IfUnmodifiedSince=past)["Body"].read()
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key="cond", IfMatch='"nope"')
    assert status(exc) == 412


@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "SHA1", "SHA256"])
def test_checksums_are_verified_and_returned(s3: Any, algorithm: str) -> None:
    data = os.urandom(300_000)
    put = s3.put_object(Bucket=B, Key=f"sum-{algorithm}", Body=data, ChecksumAlgorithm=algorithm)
    field = f"Checksum{algorithm}"
    assert put[field]
    got = s3.get_object(Bucket=B, Key=f"sum-{algorithm}", ChecksumMode="ENABLED")
    assert got[field] == put[field]
    assert got["Body"].read() == data  # botocore validates the checksum while reading
    assert s3.head_object(Bucket=B, Key=f"sum-{algorithm}", ChecksumMode="ENABLED")[field] == put[field]
    if algorithm == "CRC32":
        expected = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
        assert put[field] == expected


def test_wrong_checksums_store_nothing(s3_server: ServerProcess, s3: Any) -> None:
    data = b"the real body"
    bad_md5 = base64.b64encode(hashlib.md5(b"another body").digest()).decode()
    r = send(s3_server.url, "PUT", f"/{B}/md5-bad", headers={"Content-MD5": bad_md5}, body=data)
    assert r.status_code == 400 and b"<Code>BadDigest</Code>" in r.content
    assert r.headers["x-amz-request-id"]
    r = send(s3_server.url, "PUT", f"/{B}/md5-invalid", headers={"Content-MD5": "not-base64!"}, body=data)
    assert r.status_code == 400 and b"<Code>InvalidDigest</Code>" in r.content
    bad_crc = base64.b64encode((zlib.crc32(data) ^ 1).to_bytes(4, "big")).decode()
    r = send(s3_server.url, "PUT", f"/{B}/crc-bad", headers={"x-amz-checksum-crc32": bad_crc}, body=data)
    assert r.status_code == 400 and b"<Code>BadDigest</Code>" in r.content
    r = send(s3_server.url, "PUT", f"/{B}/sha-bad", body=data, unsigned=False, sent_body=data.upper())
    assert r.status_code == 400 and b"<Code>XAmzContentSHA256Mismatch</Code>" in r.content
    for key in ("md5-bad", "md5-invalid", "crc-bad", "sha-bad"):
        with pytest.raises(ClientError) as exc:
            s3.head_object(Bucket=B, Key=key)
        assert status(exc) == 404
    good_md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    s3.put_object(Bucket=B, Key="md5-good", Body=data, ContentMD5=good_md5)
    assert s3.get_object(Bucket=B, Key="md5-good")["Body"].read() == data


def test_truncated_body_stores_nothing(s3_server: ServerProcess, s3: Any) -> None:
    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/truncated", {"Content-Length": "100000"})
    reply = raw_exchange(s3_server.url, request_head("PUT", f"/{B}/truncated", headers), b"x" * 40_000)
    assert not reply.startswith(b"HTTP/1.1 200")
    staging = s3_server.data_dir / "fs" / "staging"
    wait_for(lambda: not any(staging.iterdir()), "the truncated body's staging file removed")
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key="truncated")
    assert status(exc) == 404


def test_chunked_transfer_without_a_length_is_stored(s3_server: ServerProcess, s3: Any) -> None:
    """What some SDKs send for streams (Ceph RGW accepts it): the body's end decides the size."""

    def body() -> Any:
        yield b"streamed "
        yield b"without a length"

    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/no-length")
    with httpx.Client(timeout=10) as client:
        r = client.put(f"{s3_server.url}/{B}/no-length", headers=headers, content=body())
    assert r.status_code == 200, r.content
    assert s3.get_object(Bucket=B, Key="no-length")["Body"].read() == b"streamed without a length"


def test_chunked_transfer_over_the_size_limit_stores_nothing(s3_server: ServerProcess, s3: Any) -> None:
    def body() -> Any:
        for _ in range(300):
            yield b"x" * (1 << 20)  # 300 MiB against the default 256 MiB limit

    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/too-long")
    with httpx.Client(timeout=60) as client:
        try:
            r = client.put(f"{s3_server.url}/{B}/too-long", headers=headers, content=body())
            assert r.status_code == 400 and b"<Code>EntityTooLarge</Code>" in r.content
        except httpx.HTTPError:
            pass  # the server may close the connection while the client still sends: also a refusal
    with pytest.raises(ClientError):
        s3.head_object(Bucket=B, Key="too-long")


def test_no_length_and_no_chunked_encoding_is_411(s3_server: ServerProcess) -> None:
    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/no-length-at-all")
    reply = raw_exchange(s3_server.url, request_head("PUT", f"/{B}/no-length-at-all", headers), b"",
                         close_after_body=False)
    assert reply.startswith(b"HTTP/1.1 411") and b"<Code>MissingContentLength</Code>" in reply


def test_entity_too_large(s3_server: ServerProcess, s3: Any) -> None:
    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/huge", {"Content-Length": str(300 << 20)})
    reply = raw_exchange(s3_server.url, request_head("PUT", f"/{B}/huge", headers), b"x" * 1000,
                         close_after_body=False)
    assert reply.startswith(b"HTTP/1.1 400") and b"<Code>EntityTooLarge</Code>" in reply


def test_delete_objects(s3: Any) -> None:
    for i in range(5):
        s3.put_object(Bucket=B, Key=f"multi/{i}", Body=b"x")
    result = s3.delete_objects(Bucket=B, Delete={"Objects": [{"Key": f"multi/{i}"} for i in range(6)]})
    assert sorted(d["Key"] for d in result["Deleted"]) == [f"multi/{i}" for i in range(6)]
    assert "Contents" not in s3.list_objects_v2(Bucket=B, Prefix="multi/")
    quiet = s3.delete_objects(Bucket=B, Delete={"Objects": [{"Key": "multi/0"}], "Quiet": True})
    assert not quiet.get("Deleted")


def test_no_such_bucket_and_not_implemented(s3: Any) -> None:
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket="no-such-bucket", Key="k")
    assert error_code(exc) == "NoSuchBucket" and status(exc) == 404
    s3.put_object(Bucket=B, Key="src", Body=b"x")
    for call in (
        lambda: s3.copy_object(Bucket=B, Key="dst", CopySource={"Bucket": B, "Key": "src"}),
        lambda: s3.get_object_acl(Bucket=B, Key="src"),
        lambda: s3.put_bucket_versioning(Bucket=B, VersioningConfiguration={"Status": "Enabled"}),
        lambda: s3.get_object_tagging(Bucket=B, Key="src"),
    ):
        with pytest.raises(ClientError) as exc:
            call()
        assert error_code(exc) == "NotImplemented" and status(exc) == 501


def test_cross_visibility_with_the_native_api(s3: Any, native: httpx.Client) -> None:
    data = os.urandom(70_000)
    etag = s3.put_object(Bucket=B, Key="from/s3@1", Body=data)["ETag"]
    r = native.get(f"/v1/buckets/{B}/chunks/{quote('from/s3@1', safe='')}")
    assert r.status_code == 200 and r.content == data and r.headers["etag"] == etag
    native_data = os.urandom(50_000)
    r = native.put(f"/v1/buckets/{B}/chunks/{quote('from/native', safe='')}", content=native_data)
    assert r.status_code == 201
    got = s3.get_object(Bucket=B, Key="from/native")
    assert got["Body"].read() == native_data and got["ETag"] == r.headers["etag"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=B, Prefix="from/")["Contents"]]
    assert keys == ["from/native", "from/s3@1"]
    # write-once across APIs: the native API sees the S3 object as existing
    r = native.put(f"/v1/buckets/{B}/chunks/{quote('from/s3@1', safe='')}", content=b"other")
    assert r.status_code == 200 and r.headers["x-kvgw-existed"] == "true"


def test_virtual_hosted_style(s3_server: ServerProcess, s3: Any) -> None:
    port = s3_server.url.rsplit(":", 1)[1]
    r = send(s3_server.url, "PUT", "/vhost/key", host=f"{B}.localhost:{port}", body=b"virtual")
    assert r.status_code == 200, r.text
    assert s3.get_object(Bucket=B, Key="vhost/key")["Body"].read() == b"virtual"
    r = send(s3_server.url, "GET", "/", host=f"{B}.localhost:{port}", query="list-type=2&prefix=vhost%2F")
    assert r.status_code == 200 and b"<Key>vhost/key</Key>" in r.content


def test_response_overrides_and_part_number(s3: Any) -> None:
    s3.put_object(Bucket=B, Key="ovr", Body=b"abc", ContentType="text/plain")
    got = s3.get_object(Bucket=B, Key="ovr", ResponseContentType="application/json",
                        ResponseContentDisposition="attachment")
    assert got["ContentType"] == "application/json" and got["ContentDisposition"] == "attachment"
    assert s3.get_object(Bucket=B, Key="ovr", PartNumber=1)["Body"].read() == b"abc"


def test_http_date_conditions_raw(s3_server: ServerProcess, s3: Any) -> None:
    s3.put_object(Bucket=B, Key="dated", Body=b"x")
    later = formatdate(time.time() + 3600, usegmt=True)
    r = send(s3_server.url, "GET", f"/{B}/dated", headers={"If-Modified-Since": later})
    assert r.status_code == 304 and r.headers["x-amz-request-id"] and r.headers["etag"]


def test_anonymous_needs_a_bucket_policy(s3_server: ServerProcess, s3: Any) -> None:
    from botocore import UNSIGNED
    from botocore.config import Config

    s3.put_object(Bucket=B, Key="public", Body=b"open")
    anon = boto3_client(s3_server.url, signature_version=UNSIGNED)
    with pytest.raises(ClientError) as exc:
        anon.get_object(Bucket=B, Key="public")
    assert error_code(exc) == "AccessDenied" and status(exc) == 403
    subprocess.run([sys.executable, "-m", "gateway.cli", "bucket", "update", B, "--anonymous-read",
                    "--data-dir", str(s3_server.data_dir)], check=True, capture_output=True,
                   env={**os.environ, "KVGW_ROOT_ACCESS_KEY": "", "KVGW_ROOT_SECRET_KEY": ""})
    deadline = time.monotonic() + 10
    while True:
        try:
            assert anon.get_object(Bucket=B, Key="public")["Body"].read() == b"open"
            break
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with pytest.raises(ClientError) as exc:
        anon.put_object(Bucket=B, Key="anon-write", Body=b"x")
    assert error_code(exc) == "AccessDenied"
    assert Config  # imported for the UNSIGNED client config
