"""Authentication: SigV4 header auth in every payload mode real clients use, presigned URLs, clock
skew, wrong keys and signatures, SigV2, signed aws-chunked bodies."""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess
from tests.integration.s3api.conftest import boto3_client
from tests.integration.s3api.test_objects import error_code, status
from tests.unit.s3.clients import frozen_clock

B = "kvcache"


def test_presigned_get_and_put(s3_server: ServerProcess) -> None:
    s3 = boto3_client(s3_server.url, signature_version="s3v4")  # boto3 presigns with SigV2 unless told
    put_url = s3.generate_presigned_url("put_object", Params={"Bucket": B, "Key": "presigned"}, ExpiresIn=300)
    r = httpx.put(put_url, content=b"via a presigned PUT")
    assert r.status_code == 200, r.text
    get_url = s3.generate_presigned_url("get_object", Params={"Bucket": B, "Key": "presigned"}, ExpiresIn=300)
    r = httpx.get(get_url)
    assert r.status_code == 200 and r.content == b"via a presigned PUT"
    r = httpx.get(get_url.replace("presigned", "presignee"))
    assert r.status_code == 403 and b"<Code>SignatureDoesNotMatch</Code>" in r.content
    v2_url = boto3_client(s3_server.url).generate_presigned_url("get_object", Params={"Bucket": B, "Key": "presigned"})
    r = httpx.get(v2_url)
    assert r.status_code == 400 and b"<Code>InvalidRequest</Code>" in r.content and b"AWS4-HMAC-SHA256" in r.content


def test_presigned_url_expires(s3_server: ServerProcess) -> None:
    s3 = boto3_client(s3_server.url, signature_version="s3v4")
    with frozen_clock(datetime.now(UTC) - timedelta(hours=2)):
        url = s3.generate_presigned_url("get_object", Params={"Bucket": B, "Key": "x"}, ExpiresIn=60)
    r = httpx.get(url)
    assert r.status_code == 403 and b"<Code>AccessDenied</Code>" in r.content and b"expired" in r.content


def test_clock_skew(s3_server: ServerProcess) -> None:
    s3 = boto3_client(s3_server.url)
    with frozen_clock(datetime.now(UTC) - timedelta(minutes=20)), pytest.raises(ClientError) as exc:
        s3.head_bucket(Bucket=B)
    assert status(exc) == 403
    with frozen_clock(datetime.now(UTC) - timedelta(minutes=20)), pytest.raises(ClientError) as exc:
        s3.list_objects_v2(Bucket=B)
    assert error_code(exc) == "RequestTimeTooSkewed"
    with frozen_clock(datetime.now(UTC) - timedelta(minutes=10)):
        s3.list_objects_v2(Bucket=B)  # within 15 minutes


def test_wrong_credentials(s3_server: ServerProcess) -> None:
    with pytest.raises(ClientError) as exc:
        boto3_client(s3_server.url, access_key="NOSUCHKEY").list_objects_v2(Bucket=B)
    assert error_code(exc) == "InvalidAccessKeyId" and status(exc) == 403
    with pytest.raises(ClientError) as exc:
        boto3_client(s3_server.url, secret_key="wrong-secret").list_objects_v2(Bucket=B)
    assert error_code(exc) == "SignatureDoesNotMatch" and status(exc) == 403


def test_sigv2_gets_a_clear_error(s3_server: ServerProcess) -> None:
    s3 = boto3_client(s3_server.url, signature_version="s3")
    with pytest.raises(ClientError) as exc:
        s3.list_objects(Bucket=B)
    assert error_code(exc) == "InvalidRequest" and status(exc) == 400
    assert "AWS4-HMAC-SHA256" in exc.value.response["Error"]["Message"]


def test_payload_modes_of_real_clients(s3_server: ServerProcess) -> None:
    """boto3's default (aws-chunked, unsigned, CRC32 trailer), signed single-chunk bodies, UNSIGNED-PAYLOAD."""
    data = os.urandom(2_000_000)
    for name, kwargs in {
        "trailer": {},  # botocore >= 1.36: STREAMING-UNSIGNED-PAYLOAD-TRAILER
        "signed": {"request_checksum_calculation": "when_required"},
    }.items():
        s3 = boto3_client(s3_server.url, **kwargs)
        s3.put_object(Bucket=B, Key=f"mode-{name}", Body=data)
        assert s3.get_object(Bucket=B, Key=f"mode-{name}")["Body"].read() == data


def _chunk_signature(key: bytes, timestamp: str, scope: str, previous: str, chunk: bytes) -> str:
    empty = hashlib.sha256(b"").hexdigest()
    sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", timestamp, scope, previous, empty,
                     hashlib.sha256(chunk).hexdigest()])
    return hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()


def _signing_key(secret: str, date: str) -> bytes:
    key = hmac.digest(("AWS4" + secret).encode(), date.encode(), "sha256")
    for part in ("us-east-1", "s3", "aws4_request"):
        key = hmac.digest(key, part.encode(), "sha256")
    return key


@pytest.mark.parametrize("tamper", [False, True])
def test_streaming_signed_payload(s3_server: ServerProcess, s3: Any, tamper: bool) -> None:
    """STREAMING-AWS4-HMAC-SHA256-PAYLOAD: the seed signature from botocore's signer, chunk signatures
    chained as the SigV4 streaming specification says."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from tests.conftest import ROOT_AK, ROOT_SK

    data = os.urandom(200_000)
    chunks = [data[i:i + 65536] for i in range(0, len(data), 65536)] + [b""]
    netloc = s3_server.url.removeprefix("http://")
    key = f"streamed-{tamper}"
    encoded_len = sum(len(f"{len(c):x};chunk-signature=") + 64 + 2 + len(c) + 2 for c in chunks)

    class StreamingAuth(S3SigV4Auth):
        def payload(self, request: AWSRequest) -> str:
            return "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"

    request = AWSRequest(method="PUT", url=f"http://{netloc}/{B}/{key}", headers={
        "Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data)),
        "Content-Length": str(encoded_len), "x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"})
    StreamingAuth(Credentials(ROOT_AK, ROOT_SK), "s3", "us-east-1").add_auth(request)
    headers = dict(request.headers.items())
    seed = headers["Authorization"].rsplit("Signature=", 1)[1]
    timestamp = headers["X-Amz-Date"]
    scope = f"{timestamp[:8]}/us-east-1/s3/aws4_request"
    signing_key = _signing_key(ROOT_SK, timestamp[:8])
    body = bytearray()
    previous = seed
    for chunk in chunks:
        signature = _chunk_signature(signing_key, timestamp, scope, previous, chunk)
        previous = signature
        sent = chunk[:-1] + bytes([chunk[-1] ^ 1]) if tamper and len(chunk) == 65536 else chunk
        body += f"{len(chunk):x};chunk-signature={signature}\r\n".encode() + sent + b"\r\n"
    assert len(body) == encoded_len
    r = httpx.put(f"{s3_server.url}/{B}/{key}", headers=headers, content=bytes(body))
    if tamper:
        assert r.status_code == 403 and b"<Code>SignatureDoesNotMatch</Code>" in r.content
        with pytest.raises(ClientError):
            s3.head_object(Bucket=B, Key=key)
    else:
        assert r.status_code == 200, r.text
        assert s3.get_object(Bucket=B, Key=key)["Body"].read() == data


def test_restricted_credentials(s3_server: ServerProcess, s3: Any) -> None:
    import json
    import subprocess
    import sys

    s3.create_bucket(Bucket="granted")
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "cred", "create", "--bucket", "granted",
                          "--data-dir", str(s3_server.data_dir)], check=True, capture_output=True, text=True,
                         env={**os.environ, "KVGW_ROOT_ACCESS_KEY": "", "KVGW_ROOT_SECRET_KEY": ""})
    cred = json.loads(out.stdout)
    reader = boto3_client(s3_server.url, access_key=cred["access_key"], secret_key=cred["secret_key"])
    s3.put_object(Bucket="granted", Key="k", Body=b"v")
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            assert reader.get_object(Bucket="granted", Key="k")["Body"].read() == b"v"
            break
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert [b["Name"] for b in reader.list_buckets()["Buckets"]] == ["granted"]
    for call in (lambda: reader.put_object(Bucket="granted", Key="w", Body=b"x"),
                 lambda: reader.get_object(Bucket=B, Key="k"),
                 lambda: reader.create_bucket(Bucket="mine-now")):
        with pytest.raises(ClientError) as exc:
            call()
        assert error_code(exc) == "AccessDenied" and status(exc) == 403
