"""open_payload: requests captured from botocore, authenticated, then their bodies verified in one pass."""

from __future__ import annotations

import base64
import hashlib
import random
import sys
import zlib
from typing import Any

import pytest

from gateway.api.s3.auth import PayloadMode
from gateway.api.s3.errors import (
    BadDigest,
    EntityTooLarge,
    IncompleteBody,
    InvalidDigest,
    S3Error,
    XAmzContentSHA256Mismatch,
)
from gateway.api.s3.payload import HASH_BATCH_BYTES, Payload, open_payload, strip_aws_chunked
from tests.unit.s3.clients import Wire, aiter_pieces, boto_wire, collect, split_randomly

DATA = random.Random(7).randbytes(3 * 1024 * 1024 + 17)


def _put(body: bytes = DATA, **kwargs: Any) -> Any:
    return lambda c: c.put_object(Bucket="bkt", Key="k", Body=body, **kwargs)


def _open(wire: Wire, body: bytes | None = None, *, seed: int = 0, **kwargs: Any) -> Payload:
    auth = wire.authenticate()
    pieces = split_randomly(wire.body if body is None else body, random.Random(seed), 65536)
    return open_payload(auth, wire.headers, aiter_pieces(pieces), **kwargs)


async def test_botocore_https_trailer_end_to_end() -> None:
    wire = boto_wire(_put(), endpoint="https://gw.example")
    payload = _open(wire, compute=["md5"])
    assert wire.authenticate().payload_mode is PayloadMode.STREAMING_UNSIGNED_TRAILER
    assert payload.length == len(DATA)
    assert payload.content_encoding is None
    assert await collect(payload) == DATA
    assert payload.checksums["md5"] == base64.b64encode(hashlib.md5(DATA).digest()).decode()
    assert "crc32" in payload.checksums


async def test_botocore_http_signed_payload_with_crc32_header() -> None:
    wire = boto_wire(_put())
    payload = _open(wire)
    assert await collect(payload) == DATA
    assert set(payload.checksums) == {"sha256", "crc32"}


async def test_large_body_hashed_in_batches_off_the_loop() -> None:
    """Past HASH_BATCH_BYTES the checksums are computed in a worker thread, batch by batch: the
    digests equal one-shot ones, and a byte changed inside a middle batch is still caught."""
    assert len(DATA) > 2 * HASH_BATCH_BYTES
    wire = boto_wire(_put())
    payload = _open(wire)
    assert await collect(payload) == DATA
    assert payload.checksums["sha256"] == base64.b64encode(hashlib.sha256(DATA).digest()).decode()
    assert payload.checksums["crc32"] == base64.b64encode(zlib.crc32(DATA).to_bytes(4, "big")).decode()
    damaged = bytearray(DATA)
    damaged[HASH_BATCH_BYTES + 5] ^= 1
    with pytest.raises(BadDigest):  # the CRC32 header is checked first, then the signed SHA-256
        await collect(_open(wire, bytes(damaged)))


async def test_sha256_mismatch() -> None:
    wire = boto_wire(_put(b"hello"), request_checksum_calculation="when_required")
    with pytest.raises(XAmzContentSHA256Mismatch) as info:
        await collect(_open(wire, b"hellO"))
    assert info.value.status == 400


async def test_header_checksum_mismatch() -> None:
    wire = boto_wire(_put(b"hello"), endpoint="https://gw.example", s3={"payload_signing_enabled": False})
    assert wire.header("x-amz-checksum-crc32") is None  # https + streaming: the checksum is a trailer
    wire = boto_wire(_put(b"hello", ChecksumAlgorithm="SHA256"))
    assert wire.header("x-amz-checksum-sha256") is not None
    with pytest.raises((BadDigest, XAmzContentSHA256Mismatch)):
        await collect(_open(wire, b"hellO"))


async def test_content_md5() -> None:
    md5 = base64.b64encode(hashlib.md5(b"hello").digest()).decode()
    wire = boto_wire(_put(b"hello", ContentMD5=md5), request_checksum_calculation="when_required")
    assert await collect(_open(wire)) == b"hello"
    auth = wire.authenticate()
    bad = wire.with_header("content-md5", base64.b64encode(hashlib.md5(b"other").digest()))
    with pytest.raises(BadDigest):
        await collect(open_payload(auth, bad.headers, aiter_pieces([b"hello"])))
    with pytest.raises(InvalidDigest):
        open_payload(auth, wire.with_header("content-md5", b"not base64!").headers, aiter_pieces([b"hello"]))
    with pytest.raises(InvalidDigest):
        open_payload(auth, wire.with_header("content-md5", b"AAAA").headers, aiter_pieces([b"hello"]))


def test_checksum_header_problems() -> None:
    wire = boto_wire(_put(b"hello"))
    auth = wire.authenticate()

    def header_error(*extra: tuple[bytes, bytes]) -> S3Error:
        with pytest.raises(S3Error) as info:
            open_payload(auth, [*wire.headers, *extra], aiter_pieces([]))
        return info.value

    assert header_error((b"x-amz-checksum-sha1", b"AAAA")).code == "InvalidRequest"  # two algorithms
    plain = [(k, v) for k, v in wire.headers if k != b"x-amz-checksum-crc32"]
    with pytest.raises(S3Error, match="invalid"):
        open_payload(auth, [*plain, (b"x-amz-checksum-crc32", b"!!")], aiter_pieces([]))
    with pytest.raises(S3Error, match="algorithm"):
        open_payload(auth, [*plain, (b"x-amz-checksum-md4", b"AAAA")], aiter_pieces([]))
    # headers that are not body checksums
    open_payload(auth, [*wire.headers, (b"x-amz-checksum-mode", b"ENABLED")], aiter_pieces([]))
    open_payload(auth, [*wire.headers, (b"x-amz-checksum-crc32", b"bogus")], aiter_pieces([]), header_checksums=False)


async def test_content_length_enforced() -> None:
    wire = boto_wire(
        _put(b"hello"),
        endpoint="https://gw.example",
        s3={"payload_signing_enabled": False},
        request_checksum_calculation="when_required",
    )
    assert wire.authenticate().payload_mode is PayloadMode.UNSIGNED
    with pytest.raises(IncompleteBody):
        await collect(_open(wire, b"hell"))
    with pytest.raises(IncompleteBody):
        await collect(_open(wire, b"hello!"))
    with pytest.raises(EntityTooLarge):
        _open(wire, max_length=4)


async def test_max_length_without_declared_length() -> None:
    wire = boto_wire(
        _put(b"hello"),
        endpoint="https://gw.example",
        s3={"payload_signing_enabled": False},
        request_checksum_calculation="when_required",
    ).with_header("content-length", None)
    with pytest.raises(EntityTooLarge):
        await collect(_open(wire, b"hello", max_length=4))
    streaming = boto_wire(_put(), endpoint="https://gw.example")
    with pytest.raises(EntityTooLarge):
        _open(streaming, max_length=1024)
    no_decoded_length = streaming.with_header("x-amz-decoded-content-length", None)
    with pytest.raises(S3Error):  # the header is signed: dropping it breaks the signature
        no_decoded_length.authenticate()


def test_invalid_lengths() -> None:
    wire = boto_wire(_put(b"hello"))
    auth = wire.authenticate()
    with pytest.raises(S3Error) as info:
        open_payload(auth, wire.with_header("content-length", b"-1").headers, aiter_pieces([]))
    assert info.value.code == "InvalidArgument"


def test_trailer_header_problems() -> None:
    wire = boto_wire(_put(b"hello"), endpoint="https://gw.example")
    auth = wire.authenticate()
    for value in (b"x-amz-checksum-md4", b"x-amz-checksum-crc32,x-amz-checksum-sha1", b"content-md5"):
        with pytest.raises(S3Error):
            open_payload(auth, wire.with_header("x-amz-trailer", value).headers, aiter_pieces([]))
    with pytest.raises(S3Error):
        open_payload(auth, [*wire.headers, (b"x-amz-checksum-sha256", b"A" * 43 + b"=")], aiter_pieces([]))


def test_strip_aws_chunked() -> None:
    assert strip_aws_chunked(None) is None
    assert strip_aws_chunked("aws-chunked") is None
    assert strip_aws_chunked("gzip,aws-chunked") == "gzip"
    assert strip_aws_chunked("aws-chunked, gzip") == "gzip"
    assert strip_aws_chunked("br") == "br"


async def test_read_once_and_compute_unknown() -> None:
    wire = boto_wire(_put(b"hello"))
    payload = _open(wire)
    await collect(payload)
    with pytest.raises(RuntimeError):
        payload.__aiter__()
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        _open(wire, compute=["md4"])


def test_checksum_library_missing_is_a_client_error(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = boto_wire(_put(b"hello"))
    auth = wire.authenticate()
    plain = [(k, v) for k, v in wire.headers if k != b"x-amz-checksum-crc32"]
    monkeypatch.setitem(sys.modules, "awscrt", None)  # makes "import awscrt" fail
    with pytest.raises(S3Error) as info:
        open_payload(auth, [*plain, (b"x-amz-checksum-crc32c", b"AAAAAA==")], aiter_pieces([]))
    assert info.value.code == "InvalidRequest"
