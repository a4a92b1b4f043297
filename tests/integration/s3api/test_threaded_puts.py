"""Threaded receives of S3 PUTs: a large plain (not aws-chunked) body is received, hashed and written by
a worker thread, as a native PUT's is, whether nothing has to be computed over it (UNSIGNED-PAYLOAD, no
checksum header, as LMCache's S3 connector and the load generator send it) or it carries a digest to
verify (a CRC32 header, a signed SHA-256: boto3's PUT over HTTP), which that thread computes too. Either
way the stored bytes are the sent ones, a wrong digest stores nothing, and a body cut short stores
nothing."""

from __future__ import annotations

import base64
import os
import zlib
from typing import Any

import pytest
from botocore.exceptions import ClientError

from gateway.dataplane.intake import INTAKE_PIECE_BYTES
from tests.conftest import ServerProcess, wait_for
from tests.integration.s3api.wire import raw_exchange, request_head, send, sign
from tests.integration.test_body_intake import ended_since, receives

B = "kvcache"
BIG = 2 * INTAKE_PIECE_BYTES + 12_345  # three intake pieces, the last one short


def test_an_unsigned_put_without_checksums_is_received_by_a_worker_thread(s3_server: ServerProcess, s3: Any) -> None:
    body = os.urandom(BIG)
    before = receives(s3_server)
    assert send(s3_server.url, "PUT", f"/{B}/threaded", body=body).status_code == 200
    assert threaded_since(before, s3_server) == 1
    assert s3.get_object(Bucket=B, Key="threaded")["Body"].read() == body


def threaded_since(before: dict[str, int], server: ServerProcess) -> int:
    """Threaded receives that took a body since ``before``, to its end unless a piece took longer
    than its deadline to arrive (then the event loop read the rest)."""
    ended = ended_since(before, server)
    return sum(ended.get(result, 0) for result in ("complete", "slow"))


@pytest.mark.parametrize("signed", [False, True], ids=["crc32 header", "signed sha256"])
def test_a_body_with_a_digest_to_verify_is_hashed_by_the_receiving_thread(
        s3_server: ServerProcess, s3: Any, signed: bool) -> None:
    body = os.urandom(BIG)
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    headers = {} if signed else {"x-amz-checksum-crc32": crc}
    before = receives(s3_server)
    r = send(s3_server.url, "PUT", f"/{B}/hashed-{signed}", headers=headers, body=body, unsigned=not signed)
    assert r.status_code == 200
    assert threaded_since(before, s3_server) == 1
    assert s3.get_object(Bucket=B, Key=f"hashed-{signed}")["Body"].read() == body
    if not signed:
        assert r.headers["x-amz-checksum-crc32"] == crc


@pytest.mark.parametrize("signed", [False, True], ids=["crc32 header", "signed sha256"])
def test_a_wrong_digest_received_by_a_thread_stores_nothing(s3_server: ServerProcess, s3: Any, signed: bool) -> None:
    """The threaded receive never bypasses a check: the digest is compared when the body ends, before
    anything is published."""
    body = os.urandom(BIG)
    tampered = body[:-1] + bytes([body[-1] ^ 1])
    wrong = base64.b64encode((zlib.crc32(body) ^ 1).to_bytes(4, "big")).decode()
    key = f"wrong-{signed}"
    before = receives(s3_server)
    if signed:  # signed for ``body``, ``tampered`` sent: its SHA-256 differs from the signed one
        r = send(s3_server.url, "PUT", f"/{B}/{key}", body=body, unsigned=False, sent_body=tampered)
        assert r.status_code == 400 and b"<Code>XAmzContentSHA256Mismatch</Code>" in r.content
    else:
        r = send(s3_server.url, "PUT", f"/{B}/{key}", headers={"x-amz-checksum-crc32": wrong}, body=body)
        assert r.status_code == 400 and b"<Code>BadDigest</Code>" in r.content
    assert threaded_since(before, s3_server) == 1
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key=key)
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    staging = s3_server.data_dir / "fs" / "staging"
    wait_for(lambda: not any(staging.iterdir()), "the refused body's staging file removed")


def test_a_threaded_body_cut_short_stores_nothing(s3_server: ServerProcess, s3: Any) -> None:
    netloc = s3_server.url.removeprefix("http://")
    headers = sign("PUT", f"http://{netloc}/{B}/cut", {"Content-Length": str(BIG)})
    before = receives(s3_server)
    sent = os.urandom(INTAKE_PIECE_BYTES + 1000)
    reply = raw_exchange(s3_server.url, request_head("PUT", f"/{B}/cut", headers), sent)
    assert not reply.startswith(b"HTTP/1.1 200")
    assert sum(ended_since(before, s3_server).values()) == 1  # a worker thread took it, and let it go
    staging = s3_server.data_dir / "fs" / "staging"
    wait_for(lambda: not any(staging.iterdir()), "the cut body's staging file removed")
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=B, Key="cut")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
