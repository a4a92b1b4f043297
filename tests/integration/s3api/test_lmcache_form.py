"""LMCache's S3 connector (``remote_url: s3://host:port``) as it puts requests on the wire: the Host
without a bucket, the path ``/<quoted key>``, SigV4 with UNSIGNED-PAYLOAD, HEAD for the size, 8 MiB
ranged GETs with If-Match, multipart above 8 MiB with unquoted part ETags and x-amz-mp-object-size.

Two ways: requests built by hand exactly as /work/shared/notes/lmcache-0.5.6.md describes them, and
awscrt's S3 client driven the way LMCache 0.5.6's ``S3Connector`` drives it."""

from __future__ import annotations

import os
import re
import threading
from typing import Any
from urllib.parse import quote

import httpx

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, require_module
from tests.integration.s3api.wire import send

MiB = 1 << 20
PART = 8 * MiB


def lmcache_key(n: int) -> str:
    return f"llama/3@1@0@{n:08x}cafe@bfloat16"


def path(key: str) -> str:
    return "/" + quote(key.replace("/", "_"))


def test_bare_host_requests(s3_server: ServerProcess, native: httpx.Client) -> None:
    url = s3_server.url
    small, exact, big = lmcache_key(1), lmcache_key(2), lmcache_key(3)
    assert send(url, "HEAD", path(small)).status_code == 404
    one_mib = os.urandom(MiB)
    assert send(url, "PUT", path(small), body=one_mib).status_code == 200
    head = send(url, "HEAD", path(small))
    assert head.status_code == 200 and int(head.headers["content-length"]) == MiB
    r = send(url, "GET", path(small), headers={"Range": f"bytes=0-{PART - 1}"})
    assert r.status_code == 206 and r.content == one_mib
    assert r.headers["content-range"] == f"bytes 0-{MiB - 1}/{MiB}"
    # exactly 8 MiB is a single PUT
    eight = os.urandom(PART)
    assert send(url, "PUT", path(exact), body=eight).status_code == 200
    # above 8 MiB: multipart with unquoted ETags and x-amz-mp-object-size
    data = os.urandom(2 * PART + 12345)
    r = send(url, "POST", path(big), query="uploads")
    assert r.status_code == 200
    upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", r.content).group(1).decode()  # type: ignore[union-attr]
    etags: dict[int, str] = {}

    def upload(number: int) -> None:
        piece = data[(number - 1) * PART : number * PART]
        resp = send(url, "PUT", path(big), query=f"partNumber={number}&uploadId={upload_id}", body=piece)
        assert resp.status_code == 200
        etags[number] = resp.headers["etag"].strip('"')

    threads = [threading.Thread(target=upload, args=(n,)) for n in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    complete = "<CompleteMultipartUpload>" + "".join(
        f"<Part><PartNumber>{n}</PartNumber><ETag>{etags[n]}</ETag></Part>" for n in (1, 2, 3)
    ) + "</CompleteMultipartUpload>"
    r = send(url, "POST", path(big), query=f"uploadId={upload_id}", body=complete.encode(),
             headers={"x-amz-mp-object-size": str(len(data))})
    assert r.status_code == 200, r.text
    head = send(url, "HEAD", path(big))
    assert int(head.headers["content-length"]) == len(data)
    first = send(url, "GET", path(big), headers={"Range": f"bytes=0-{PART - 1}"})
    assert first.status_code == 206
    got = bytearray(first.content)
    for start in range(PART, len(data), PART):
        r = send(url, "GET", path(big), headers={"Range": f"bytes={start}-{start + PART - 1}",
                                                 "If-Match": first.headers["etag"]})
        assert r.status_code == 206
        got += r.content
    assert bytes(got) == data
    r = send(url, "GET", path(big), headers={"Range": f"bytes=0-{PART - 1}", "If-Match": '"0000000000000000"'})
    assert r.status_code == 412
    # the same chunks in the default bucket, through path-style S3 and the native API
    r = native.get(f"/v1/buckets/kvcache/chunks/{quote(big.replace('/', '_'), safe='')}")
    assert r.status_code == 200 and r.content == data
    assert send(url, "GET", f"/kvcache{path(exact)}").content == eight
    # write-once: a second PUT keeps the bytes
    assert send(url, "PUT", path(small), body=os.urandom(MiB)).status_code == 200
    assert send(url, "GET", path(small)).content == one_mib


def test_bare_host_uses_the_configured_default_bucket(server_factory: type[ServerProcess], tmp_path: Any) -> None:
    server = server_factory(data_dir=tmp_path / "data", env={"KVGW_S3_API_DEFAULT_BUCKET": "lmcache-remote"}).start()
    from tests.integration.s3api.conftest import boto3_client

    s3 = boto3_client(server.url)
    s3.create_bucket(Bucket="lmcache-remote")
    key = lmcache_key(7)
    assert send(server.url, "PUT", path(key), body=b"kv").status_code == 200
    assert s3.get_object(Bucket="lmcache-remote", Key=key.replace("/", "_"))["Body"].read() == b"kv"


def test_awscrt_client_as_lmcache_drives_it(s3_server: ServerProcess) -> None:
    awscrt = require_module("awscrt")
    from awscrt import auth, io, s3
    from awscrt.http import HttpHeaders, HttpRequest

    assert awscrt
    host = s3_server.url.removeprefix("http://")
    elg = io.EventLoopGroup(2)
    bootstrap = io.ClientBootstrap(elg, io.DefaultHostResolver(elg))
    credentials = auth.AwsCredentialsProvider.new_static(ROOT_AK, ROOT_SK)
    client = s3.S3Client(bootstrap=bootstrap, region="us-east-1", tls_mode=s3.S3RequestTlsMode.DISABLED,
                         credential_provider=credentials, part_size=PART)

    def run(method: str, key: str, rtype: Any, body: bytes | None = None, operation: str | None = None
            ) -> tuple[int | None, dict[str, str], bytes]:
        headers = HttpHeaders()
        headers.add("Host", host)
        stream = None
        if body is not None:
            import io as pyio

            headers.add("Content-Length", str(len(body)))
            headers.add("Content-Type", "application/octet-stream")
            stream = pyio.BytesIO(body)
        request = HttpRequest(method, path(key), headers, body_stream=stream)
        got: dict[str, Any] = {"status": None, "headers": {}, "body": bytearray()}

        def on_headers(status_code: int, headers: Any, **_: Any) -> None:
            got["status"] = status_code
            got["headers"].update({k.lower(): v for k, v in headers})

        def on_body(chunk: bytes, offset: int, **_: Any) -> None:
            buf = got["body"]
            if len(buf) < offset + len(chunk):
                buf.extend(b"\0" * (offset + len(chunk) - len(buf)))
            buf[offset : offset + len(chunk)] = chunk

        kwargs: dict[str, Any] = {"operation_name": operation} if operation else {}
        req = s3.S3Request(client=client, type=rtype, request=request, on_headers=on_headers, on_body=on_body,
                           credential_provider=credentials, region="us-east-1", **kwargs)
        try:
            req.finished_future.result(60)
        except Exception:
            if got["status"] is None:
                raise
        return got["status"], got["headers"], bytes(got["body"])

    key = lmcache_key(42)
    status, _, _ = run("HEAD", key, s3.S3RequestType.DEFAULT, operation="HeadObject")
    assert status == 404
    data = os.urandom(2 * PART + 4096)  # above the part size: awscrt uploads it in parts
    status, _, _ = run("PUT", key, s3.S3RequestType.PUT_OBJECT, body=data)
    assert status in (200, 201)
    status, headers, _ = run("HEAD", key, s3.S3RequestType.DEFAULT, operation="HeadObject")
    assert status == 200 and int(headers["content-length"]) == len(data)
    status, _, body = run("GET", key, s3.S3RequestType.GET_OBJECT)
    assert status in (200, 206) and body == data
    small_key = lmcache_key(43)
    small = os.urandom(MiB)
    assert run("PUT", small_key, s3.S3RequestType.PUT_OBJECT, body=small)[0] == 200
    status, _, body = run("GET", small_key, s3.S3RequestType.GET_OBJECT)
    assert status in (200, 206) and body == small
