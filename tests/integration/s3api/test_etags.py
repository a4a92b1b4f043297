"""ETag modes (``kvgw bucket create|update --etag md5|xxh3``) through real HTTP against a real
``kvgw serve``: boto3 over http (plain bodies, threaded receives) and over https (aws-chunked bodies
with a trailing CRC32, what boto3 sends there), the aws CLI, and the native API beside them.

An ``md5`` bucket answers S3's ETags: PutObject the body's MD5, UploadPart the part's MD5,
CompleteMultipartUpload the MD5 of the parts' binary MD5s then ``-N``; HEAD, GET, ListObjects and the
conditional headers agree. The default (``xxh3``) keeps the chunk's checksum, and the native API
answers the xxh3 (= ``X-Kvgw-Checksum``) in both modes. A chunk's ETag is fixed when it is written.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess, wait_for
from tests.integration.s3api.conftest import MIN_PART, MiB
from tests.integration.test_serve import make_tls

SYNC = "sync"  # the MD5-mode bucket
XXH3_ETAG = re.compile(r'"[0-9a-f]{16}"')


def md5_etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def multipart_etag(parts: list[bytes]) -> str:
    combined = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    return f'"{combined}-{len(parts)}"'


def kvgw_cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--data-dir", str(server.data_dir)],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, **server.env})
    assert result.returncode == 0, result.stderr
    return result


def make_bucket(server: ServerProcess, s3: Any, name: str, mode: str) -> None:
    """``kvgw bucket create NAME --etag MODE`` beside the running gateway, then wait for its catalog
    refresh to show the bucket with that mode (a probe object's ETag says which)."""
    kvgw_cli(server, "bucket", "create", name, "--etag", mode)
    want = md5_etag(b"probe") if mode == "md5" else None

    def known() -> bool:
        try:
            etag = s3.put_object(Bucket=name, Key=f"probe-{mode}-{os.urandom(4).hex()}", Body=b"probe")["ETag"]
        except ClientError:
            return False
        return etag == want if want else bool(XXH3_ETAG.fullmatch(etag))

    wait_for(known, f"bucket {name} ({mode}) is known to the gateway")


@pytest.fixture
def sync_bucket(s3_server: ServerProcess, s3: Any) -> str:
    make_bucket(s3_server, s3, SYNC, "md5")
    return SYNC


@pytest.fixture
def tls(server_factory: type[ServerProcess], tmp_path: Path) -> tuple[ServerProcess, Any]:
    """kvgw over https, where boto3 sends every PUT and UploadPart body aws-chunked with a trailing CRC32."""
    ca, cert, key = make_tls(tmp_path)
    server = server_factory(data_dir=tmp_path / "tls", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)],
                            ca_file=ca).start()
    s3 = boto3.client("s3", endpoint_url=server.url, aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                      region_name="us-east-1", verify=str(ca),
                      config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    sent: list[dict[str, str]] = []
    s3.meta.events.register("before-send.s3.*", lambda request, **_: sent.append(
        {k.lower(): (v.decode() if isinstance(v, bytes) else v) for k, v in request.headers.items()}))
    s3.sent = sent
    return server, s3


def _aws_chunked(sent: list[dict[str, str]]) -> list[dict[str, str]]:
    return [h for h in sent if h.get("x-amz-content-sha256") == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"]


def _every_answer(s3: Any, bucket: str, key: str) -> set[str]:
    """The ETag of ``key`` as HEAD, GET and ListObjectsV2 give it."""
    listed = [o["ETag"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"] if o["Key"] == key]
    return {s3.head_object(Bucket=bucket, Key=key)["ETag"], s3.get_object(Bucket=bucket, Key=key)["ETag"], *listed}


# -- ceph/s3-tests, reproduced -------------------------------------------------------------------------


def test_object_write_check_etag(s3: Any, sync_bucket: str) -> None:
    """s3-tests ``test_object_write_check_etag``: the ETag of ``bar`` is its MD5, in an MD5-mode bucket."""
    response = s3.put_object(Bucket=sync_bucket, Key="foo", Body="bar")
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert response["ETag"] == '"37b51d194a7513e45b56f6524f2d51f2"'


def test_the_default_bucket_keeps_xxh3_etags(s3: Any, native: httpx.Client, s3_server: ServerProcess) -> None:
    """``kvcache`` (and every bucket made without ``--etag``) answers the chunk's xxh3-64: no MD5 is computed."""
    etag = s3.put_object(Bucket="kvcache", Key="foo", Body="bar")["ETag"]
    assert XXH3_ETAG.fullmatch(etag) and etag != md5_etag(b"bar")
    got = native.get(s3_server.chunk_url("foo"))
    assert got.headers["etag"] == etag == f'"{got.headers["x-kvgw-checksum"]}"'


# -- PutObject -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 3 * MiB + 5])  # small: event loop; from 1 MiB: a threaded receive
def test_put_object_etag_is_the_md5_on_every_answer(s3: Any, native: httpx.Client, s3_server: ServerProcess,
                                                     sync_bucket: str, size: int) -> None:
    data = os.urandom(size)
    put = s3.put_object(Bucket=sync_bucket, Key=f"obj-{size}", Body=data)
    assert put["ETag"] == md5_etag(data)
    assert _every_answer(s3, sync_bucket, f"obj-{size}") == {md5_etag(data)}
    # the native API keeps its contract: ETag = the xxh3-64 = X-Kvgw-Checksum, in every bucket
    got = native.get(s3_server.chunk_url(f"obj-{size}", sync_bucket))
    assert got.content == data and got.headers["etag"] == f'"{got.headers["x-kvgw-checksum"]}"'


def test_aws_chunked_put_object_etag_is_the_md5(tls: tuple[ServerProcess, Any]) -> None:
    server, s3 = tls
    make_bucket(server, s3, SYNC, "md5")
    data = os.urandom(2 * MiB + 3)
    s3.sent.clear()
    assert s3.put_object(Bucket=SYNC, Key="chunked", Body=data)["ETag"] == md5_etag(data)
    assert _aws_chunked(s3.sent), "boto3 over https sends aws-chunked bodies"
    assert _every_answer(s3, SYNC, "chunked") == {md5_etag(data)}


def test_a_native_put_into_an_md5_bucket_records_the_md5_for_s3(s3: Any, native: httpx.Client,
                                                                 s3_server: ServerProcess, sync_bucket: str) -> None:
    data = os.urandom(200_000)
    put = native.put(s3_server.chunk_url("native", sync_bucket), content=data)
    assert put.status_code == 201 and put.headers["etag"] == f'"{put.headers["x-kvgw-checksum"]}"'
    assert _every_answer(s3, sync_bucket, "native") == {md5_etag(data)}


def test_write_once_answers_the_stored_md5_and_conditions_use_it(s3: Any, sync_bucket: str) -> None:
    first, second = b"first bytes", b"second bytes"
    assert s3.put_object(Bucket=sync_bucket, Key="once", Body=first)["ETag"] == md5_etag(first)
    assert s3.put_object(Bucket=sync_bucket, Key="once", Body=second)["ETag"] == md5_etag(first)
    assert s3.get_object(Bucket=sync_bucket, Key="once", IfMatch=md5_etag(first))["Body"].read() == first
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=sync_bucket, Key="once", IfNoneMatch=md5_etag(first))
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 304
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=sync_bucket, Key="once", IfMatch=md5_etag(second))
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_a_chunks_etag_is_fixed_when_it_is_written(s3_server: ServerProcess, s3: Any) -> None:
    """Switching a bucket's mode changes the ETags of chunks written afterwards, never of stored ones (a
    sync tool would take a changed ETag for a changed object)."""
    make_bucket(s3_server, s3, "switch", "xxh3")
    s3.put_object(Bucket="switch", Key="before", Body=b"before")
    before = s3.head_object(Bucket="switch", Key="before")["ETag"]
    assert XXH3_ETAG.fullmatch(before)
    kvgw_cli(s3_server, "bucket", "update", "switch", "--etag", "md5")
    wait_for(lambda: s3.put_object(Bucket="switch", Key=f"p{os.urandom(4).hex()}", Body=b"p")["ETag"]
             == md5_etag(b"p"), "the new mode is in force")
    s3.put_object(Bucket="switch", Key="after", Body=b"after")
    assert _every_answer(s3, "switch", "before") == {before}
    assert _every_answer(s3, "switch", "after") == {md5_etag(b"after")}
    kvgw_cli(s3_server, "bucket", "update", "switch", "--etag", "xxh3")
    wait_for(lambda: XXH3_ETAG.fullmatch(s3.put_object(Bucket="switch", Key=f"q{os.urandom(4).hex()}",
                                                       Body=b"q")["ETag"]) is not None, "xxh3 again")
    assert _every_answer(s3, "switch", "after") == {md5_etag(b"after")}


# -- multipart -----------------------------------------------------------------------------------------


def _multipart(s3: Any, bucket: str, key: str, parts: list[bytes]) -> tuple[list[str], str]:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = [s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=body)["ETag"]
             for n, body in enumerate(parts, 1)]
    listed = s3.list_parts(Bucket=bucket, Key=key, UploadId=upload)["Parts"]
    assert [p["ETag"] for p in listed] == etags
    chosen = {"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]}
    done = s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=chosen)
    again = s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=chosen)
    assert again["ETag"] == done["ETag"]  # a retried Complete answers as the first did
    return etags, str(done["ETag"])


def test_multipart_etags_are_computed_the_s3_way(s3: Any, sync_bucket: str) -> None:
    parts = [os.urandom(MIN_PART), os.urandom(MIN_PART + 1), b"tail"]
    etags, done = _multipart(s3, sync_bucket, "mp", parts)
    assert etags == [md5_etag(p) for p in parts]
    assert done == multipart_etag(parts)
    assert _every_answer(s3, sync_bucket, "mp") == {multipart_etag(parts)}
    assert s3.get_object(Bucket=sync_bucket, Key="mp")["Body"].read() == b"".join(parts)


def test_aws_chunked_upload_parts_with_a_trailing_checksum(tls: tuple[ServerProcess, Any]) -> None:
    server, s3 = tls
    make_bucket(server, s3, SYNC, "md5")
    parts = [os.urandom(MIN_PART), b"the last part"]
    s3.sent.clear()
    etags, done = _multipart(s3, SYNC, "mp-chunked", parts)
    assert len(_aws_chunked(s3.sent)) >= 2 and all(h.get("x-amz-trailer") for h in _aws_chunked(s3.sent))
    assert etags == [md5_etag(p) for p in parts]
    assert done == multipart_etag(parts)
    assert _every_answer(s3, SYNC, "mp-chunked") == {multipart_etag(parts)}


def test_multipart_in_an_xxh3_bucket_keeps_xxh3_etags(s3: Any) -> None:
    parts = [os.urandom(MIN_PART), b"tail"]
    etags, done = _multipart(s3, "kvcache", "mp-xxh3", parts)
    assert all(XXH3_ETAG.fullmatch(e) for e in [*etags, done])


# -- the aws CLI -----------------------------------------------------------------------------------------


def test_aws_cli_uploads_get_the_etags_s3_tools_compute(aws: Callable[..., Any], s3: Any, sync_bucket: str,
                                                        tmp_path: Path) -> None:
    """``aws s3 cp`` of a small file (one PutObject) and of a 9 MiB one (multipart, the CLI's 8 MiB parts):
    the ETags are the ones a tool computes from the file (its MD5; its 8 MiB parts' MD5s then ``-2``)."""
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(os.urandom(300_000))
    large.write_bytes(os.urandom(9 * MiB))
    aws("s3", "cp", str(small), f"s3://{sync_bucket}/small.bin")
    aws("s3", "cp", str(large), f"s3://{sync_bucket}/large.bin")
    data = large.read_bytes()
    assert s3.head_object(Bucket=sync_bucket, Key="small.bin")["ETag"] == md5_etag(small.read_bytes())
    assert s3.head_object(Bucket=sync_bucket, Key="large.bin")["ETag"] == multipart_etag([data[:8 * MiB],
                                                                                         data[8 * MiB:]])
    listed = aws("s3api", "list-objects-v2", "--bucket", sync_bucket, "--prefix", "small").stdout
    assert md5_etag(small.read_bytes()).strip('"') in listed


# -- Content-Encoding of aws-chunked uploads (ceph/s3-tests test_object_content_encoding_aws_chunked) --------

ENCODINGS = [("gzip", "gzip"), ("deflate, gzip", "deflate, gzip"), ("gzip, aws-chunked", "gzip"),
             ("aws-chunked, gzip", "gzip"), ("aws-chunked", None), ("aws-chunked, aws-chunked", None)]


def _encodings(s3: Any, bucket: str, key: str) -> set[str | None]:
    return {s3.head_object(Bucket=bucket, Key=key).get("ContentEncoding"),
            s3.get_object(Bucket=bucket, Key=key).get("ContentEncoding")}


@pytest.mark.parametrize("over", ["http", "https"])
def test_object_content_encoding_aws_chunked(s3: Any, tls: tuple[ServerProcess, Any], over: str) -> None:
    """s3-tests ``test_object_content_encoding_aws_chunked``: every coding but ``aws-chunked`` is kept.
    Over https boto3 frames the body aws-chunked and appends ``,aws-chunked`` to the header itself.

    The suite PUTs all six to one key; kvgw's keys are write-once (the first PUT's object stays, and
    its attributes with it: ``test_a_rewrite_keeps_the_first_objects_encoding``), so each goes to a key
    of its own here."""
    client = s3 if over == "http" else tls[1]
    for n, (sent, stored) in enumerate(ENCODINGS):
        client.put_object(Bucket="kvcache", Key=f"encoding-{n}", Body=b"compressed bytes", ContentEncoding=sent)
        assert _encodings(client, "kvcache", f"encoding-{n}") == {stored}, sent
    if over == "https":
        assert _aws_chunked(client.sent)


def test_a_rewrite_keeps_the_first_objects_encoding(s3: Any) -> None:
    """The suite's one-key sequence against write-once keys: the first object and its encoding stay."""
    s3.put_object(Bucket="kvcache", Key="encoding", Body=b"v", ContentEncoding="gzip")
    s3.put_object(Bucket="kvcache", Key="encoding", Body=b"v", ContentEncoding="deflate, gzip")
    assert _encodings(s3, "kvcache", "encoding") == {"gzip"}


@pytest.mark.parametrize(("sent", "stored"), [("deflate, gzip", "deflate, gzip"), ("aws-chunked, br", "br")])
def test_multipart_content_encoding_with_aws_chunked_parts(tls: tuple[ServerProcess, Any], sent: str,
                                                           stored: str) -> None:
    """CreateMultipartUpload's Content-Encoding, with every UploadPart sent aws-chunked (``Content-Encoding:
    aws-chunked``, a trailing CRC32): the object keeps the upload's codings but ``aws-chunked``."""
    _server, s3 = tls
    upload = s3.create_multipart_upload(Bucket="kvcache", Key=f"mp-{sent}", ContentEncoding=sent)["UploadId"]
    s3.sent.clear()
    etags = [s3.upload_part(Bucket="kvcache", Key=f"mp-{sent}", UploadId=upload, PartNumber=n, Body=body)["ETag"]
             for n, body in enumerate([os.urandom(MIN_PART), b"tail"], 1)]
    assert [h.get("content-encoding") for h in _aws_chunked(s3.sent)] == ["aws-chunked", "aws-chunked"]
    s3.complete_multipart_upload(Bucket="kvcache", Key=f"mp-{sent}", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]})
    assert _encodings(s3, "kvcache", f"mp-{sent}") == {stored}


def test_aws_cli_keeps_the_content_encoding(aws: Callable[..., Any], s3: Any, tmp_path: Path) -> None:
    """``aws s3 cp --content-encoding`` of a one-request file and of a multipart one."""
    for name, size in (("one.gz", 1000), ("multi.gz", 9 * MiB)):
        source = tmp_path / name
        source.write_bytes(os.urandom(size))
        aws("s3", "cp", str(source), f"s3://kvcache/{name}", "--content-encoding", "deflate, gzip")
        assert _encodings(s3, "kvcache", name) == {"deflate, gzip"}
