"""aws-chunked decoding: AWS's published examples, botocore's own encoder, and every failure."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import random
import zlib
from typing import Any

import pytest
from botocore.httpchecksum import AwsChunkedWrapper, Crc32Checksum, Sha1Checksum, Sha256Checksum

from gateway.api.s3 import sigv4
from gateway.api.s3.auth import AuthResult, PayloadMode, authenticate
from gateway.api.s3.checksums import new_checksum
from gateway.api.s3.chunked import MAX_LINE, AwsChunkedDecoder
from gateway.api.s3.errors import (
    BadDigest,
    EntityTooLarge,
    IncompleteBody,
    MalformedChunkedEncoding,
    MalformedTrailer,
    S3Error,
    SignatureDoesNotMatch,
)
from tests.requirements import require_module
from tests.unit.s3.clients import ACCESS_KEY, SECRET, aiter_pieces, collect, split_randomly

# -- AWS's published example (sigv4-streaming.html and sigv4-streaming-trailers.html) ----------------

EXAMPLE_KEY = "AKIAIOSFODNN7EXAMPLE"
EXAMPLE_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
EXAMPLE_DATA = b"a" * 66560


def _example_request(
    content_sha256: str, signed_headers: str, seed: str, extra: list[tuple[bytes, bytes]]
) -> AuthResult:
    headers = [
        (b"host", b"s3.amazonaws.com"),
        (b"x-amz-date", b"20130524T000000Z"),
        (b"x-amz-storage-class", b"REDUCED_REDUNDANCY"),
        (b"x-amz-content-sha256", content_sha256.encode()),
        (b"content-encoding", b"aws-chunked"),
        (b"x-amz-decoded-content-length", b"66560"),
        *extra,
        (
            b"authorization",
            f"AWS4-HMAC-SHA256 Credential={EXAMPLE_KEY}/20130524/us-east-1/s3/aws4_request,"
            f"SignedHeaders={signed_headers},Signature={seed}".encode(),
        ),
    ]
    return authenticate(
        "PUT",
        b"/examplebucket/chunkObject.txt",
        b"",
        headers,
        {EXAMPLE_KEY: EXAMPLE_SECRET}.get,
        now=1369353600.0,
    )


def _example_body(signatures: list[str], tail: bytes) -> bytes:
    return (
        f"10000;chunk-signature={signatures[0]}\r\n".encode()
        + b"a" * 65536
        + f"\r\n400;chunk-signature={signatures[1]}\r\n".encode()
        + b"a" * 1024
        + f"\r\n0;chunk-signature={signatures[2]}\r\n".encode()
        + tail
    )


def example_signed() -> tuple[AuthResult, bytes]:
    auth = _example_request(
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
        "content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;"
        "x-amz-storage-class",
        "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9",
        [(b"content-length", b"66824")],
    )
    body = _example_body(
        [
            "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
            "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
            "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9",
        ],
        b"\r\n",
    )
    assert len(body) == 66824
    return auth, body


def example_signed_trailer() -> tuple[AuthResult, bytes]:
    auth = _example_request(
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
        "content-encoding;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;"
        "x-amz-storage-class;x-amz-trailer",
        "106e2a8a18243abcf37539882f36619c00e2dfc72633413f02d3b74544bfeb8e",
        [(b"x-amz-trailer", b"x-amz-checksum-crc32c")],
    )
    body = _example_body(
        [
            "b474d8862b1487a5145d686f57f013e54db672cee1c953b3010fb58501ef5aa2",
            "1c1344b170168f8e65b41376b44b20fe354e373826ccbbe2c1d40a8cae51e5c7",
            "2ca2aba2005185cf7159c6277faf83795951dd77a3a99e6e65d5c9f85863f992",
        ],
        b"x-amz-checksum-crc32c:sOO8/Q==\r\n"
        b"x-amz-trailer-signature:d81f82fc3505edab99d459891051a732e8730629a2e4a59689829ca17fe2e435\r\n\r\n",
    )
    return auth, body


async def decode(
    body: bytes,
    mode: PayloadMode,
    *,
    auth: AuthResult | None = None,
    trailer: str | None = None,
    decoded_length: int | None = None,
    max_length: int | None = None,
    seed: int = 0,
    max_piece: int = 65536,
) -> bytes:
    pieces = split_randomly(body, random.Random(seed), max_piece)
    decoder = AwsChunkedDecoder(
        aiter_pieces(pieces),
        mode,
        auth=auth,
        trailer_checksum=new_checksum(trailer) if trailer else None,
        decoded_length=decoded_length,
        max_length=max_length,
    )
    return await collect(decoder)


@pytest.mark.parametrize("max_piece", [1, 3, 100, 8191, 70000, 1 << 20])
async def test_aws_example_signed_chunks(max_piece: int) -> None:
    auth, body = example_signed()
    assert auth.payload_mode is PayloadMode.STREAMING_SIGNED
    data = await decode(body, auth.payload_mode, auth=auth, decoded_length=66560, max_piece=max_piece, seed=max_piece)
    assert data == EXAMPLE_DATA


@pytest.mark.parametrize("max_piece", [1, 5, 4096, 1 << 20])
async def test_aws_example_signed_trailer(max_piece: int) -> None:
    require_module("awscrt")
    auth, body = example_signed_trailer()
    assert auth.payload_mode is PayloadMode.STREAMING_SIGNED_TRAILER
    data = await decode(body, auth.payload_mode, auth=auth, trailer="crc32c", decoded_length=66560, max_piece=max_piece)
    assert data == EXAMPLE_DATA


async def test_aws_example_tampered() -> None:
    auth, body = example_signed()
    for position in (200, 65700, 66700):  # in chunk 1, chunk 2, and the final chunk's signature
        tampered = bytearray(body)
        tampered[position] ^= 0x01
        with pytest.raises((SignatureDoesNotMatch, MalformedChunkedEncoding)):
            await decode(bytes(tampered), auth.payload_mode, auth=auth, decoded_length=66560)


async def test_aws_example_bad_trailer_signature() -> None:
    require_module("awscrt")
    auth, body = example_signed_trailer()
    with pytest.raises(SignatureDoesNotMatch):
        await decode(body.replace(b"d81f82fc", b"d81f82fd"), auth.payload_mode, auth=auth, trailer="crc32c")
    # a changed checksum breaks the trailer signature before the checksum is even compared
    with pytest.raises(SignatureDoesNotMatch):
        await decode(body.replace(b"sOO8/Q==", b"AAAAAA=="), auth.payload_mode, auth=auth, trailer="crc32c")


# -- hand-built signed streams (per the spec, independent of the decoder) ---------------------------


def signed_auth(mode: PayloadMode) -> AuthResult:
    key = sigv4.signing_key(SECRET, "20240501", "us-east-1", "s3")
    return AuthResult(
        access_key=ACCESS_KEY,
        region="us-east-1",
        date="20240501",
        timestamp="20240501T120000Z",
        scope="20240501/us-east-1/s3/aws4_request",
        signed_headers=("host",),
        payload_hash=mode.value,
        payload_mode=mode,
        seed_signature=hashlib.sha256(b"seed").hexdigest(),
        signing_key=key,
        presigned=False,
    )


def build_signed(
    data: bytes, chunk_size: int, auth: AuthResult, *, trailer: list[tuple[str, str]] | None = None, minio: bool = False
) -> bytes:
    def hmac_hex(message: str) -> str:
        return hmac.new(auth.signing_key, message.encode(), hashlib.sha256).hexdigest()

    empty = hashlib.sha256(b"").hexdigest()
    chunks = [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)] + [b""]
    out = io.BytesIO()
    previous = auth.seed_signature
    for chunk in chunks:
        sts = "\n".join(
            ["AWS4-HMAC-SHA256-PAYLOAD", auth.timestamp, auth.scope, previous, empty, hashlib.sha256(chunk).hexdigest()]
        )
        previous = hmac_hex(sts)
        out.write(f"{len(chunk):x};chunk-signature={previous}\r\n".encode() + chunk)
        if chunk or trailer is None:
            out.write(b"\r\n")
    if trailer is not None:
        canonical = "".join(f"{name}:{value}\n" for name, value in trailer)
        sts = "\n".join(
            [
                "AWS4-HMAC-SHA256-TRAILER",
                auth.timestamp,
                auth.scope,
                previous,
                hashlib.sha256(canonical.encode()).hexdigest(),
            ]
        )
        lines = canonical + "\r\n" if minio else "".join(f"{n}:{v}\r\n" for n, v in trailer)
        out.write(f"{lines}x-amz-trailer-signature:{hmac_hex(sts)}\r\n\r\n".encode())
    return out.getvalue()


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


@pytest.mark.parametrize(
    ("size", "chunk_size"), [(0, 8192), (1, 8192), (8192, 8192), (100_000, 8192), (300_000, 65536)]
)
async def test_signed_chunks(size: int, chunk_size: int) -> None:
    data = random.Random(size).randbytes(size)
    auth = signed_auth(PayloadMode.STREAMING_SIGNED)
    body = build_signed(data, chunk_size, auth)
    for seed in range(3):
        assert await decode(body, auth.payload_mode, auth=auth, decoded_length=size, seed=seed, max_piece=9000) == data


@pytest.mark.parametrize("minio", [False, True], ids=["aws-layout", "minio-go-layout"])
async def test_signed_trailer(minio: bool) -> None:
    data = random.Random(1).randbytes(50_000)
    auth = signed_auth(PayloadMode.STREAMING_SIGNED_TRAILER)
    body = build_signed(data, 16384, auth, trailer=[("x-amz-checksum-crc32", crc32_b64(data))], minio=minio)
    assert (
        await decode(body, auth.payload_mode, auth=auth, trailer="crc32", decoded_length=50_000, max_piece=777) == data
    )


async def test_signed_chunks_reordered() -> None:
    data = bytes(range(256)) * 64
    auth = signed_auth(PayloadMode.STREAMING_SIGNED)
    body = build_signed(data, 8192, auth)
    first, second = body.index(b"2000;"), body.rindex(b"2000;")
    swapped = (
        body[:first]
        + body[second : body.index(b"0;", second + 5)]
        + body[first:second]
        + body[body.index(b"0;", second + 5) :]
    )
    assert len(swapped) == len(body)
    with pytest.raises(SignatureDoesNotMatch):
        await decode(swapped, auth.payload_mode, auth=auth)


async def test_signed_chunk_missing_signature() -> None:
    auth = signed_auth(PayloadMode.STREAMING_SIGNED)
    with pytest.raises(MalformedChunkedEncoding):
        await decode(b"3\r\nabc\r\n0\r\n\r\n", auth.payload_mode, auth=auth)


async def test_signed_trailer_without_its_signature() -> None:
    auth = signed_auth(PayloadMode.STREAMING_SIGNED_TRAILER)
    body = build_signed(b"abc", 8192, auth, trailer=[("x-amz-checksum-crc32", crc32_b64(b"abc"))])
    cut = body[: body.index(b"x-amz-trailer-signature")] + b"\r\n"
    with pytest.raises(IncompleteBody):
        await decode(cut, auth.payload_mode, auth=auth, trailer="crc32")


# -- botocore's encoder (STREAMING-UNSIGNED-PAYLOAD-TRAILER, what boto3 and the aws CLI send) -----------

BOTOCORE_CHECKSUMS = {"crc32": Crc32Checksum, "sha1": Sha1Checksum, "sha256": Sha256Checksum}


def botocore_checksum_cls(algorithm: str) -> Any:
    if algorithm in BOTOCORE_CHECKSUMS:
        return BOTOCORE_CHECKSUMS[algorithm]
    require_module("awscrt")
    from botocore.httpchecksum import CrtCrc32cChecksum, CrtCrc64NvmeChecksum

    return {"crc32c": CrtCrc32cChecksum, "crc64nvme": CrtCrc64NvmeChecksum}[algorithm]


def botocore_chunked(data: bytes, algorithm: str = "crc32", chunk_size: int = 1 << 20) -> bytes:
    wrapper = AwsChunkedWrapper(
        io.BytesIO(data),
        checksum_cls=botocore_checksum_cls(algorithm),
        checksum_name=f"x-amz-checksum-{algorithm}",
        chunk_size=chunk_size,
    )
    return bytes(wrapper.read())


UNSIGNED_TRAILER = PayloadMode.STREAMING_UNSIGNED_TRAILER


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "crc64nvme", "sha1", "sha256"])
@pytest.mark.parametrize(
    ("size", "chunk_size"), [(0, 1024), (1, 1024), (5000, 1), (100_000, 1000), (3_000_000, 1 << 20)]
)
async def test_botocore_unsigned_trailer(algorithm: str, size: int, chunk_size: int) -> None:
    data = random.Random(size).randbytes(size)
    body = botocore_chunked(data, algorithm, chunk_size)
    for seed, max_piece in ((0, 1), (1, 999), (2, 65536)):
        if max_piece == 1 and len(body) > 50_000:
            continue
        decoded = await decode(
            body, UNSIGNED_TRAILER, trailer=algorithm, decoded_length=size, seed=seed, max_piece=max_piece
        )
        assert decoded == data


async def test_trailer_checksum_mismatch() -> None:
    data = b"x" * 10_000
    body = botocore_chunked(data, chunk_size=4096)
    tampered = body.replace(b"x" * 10, b"x" * 9 + b"y", 1)
    with pytest.raises(BadDigest) as info:
        await decode(tampered, UNSIGNED_TRAILER, trailer="crc32")
    assert info.value.code == "BadDigest" and "CRC32" in info.value.message
    with pytest.raises(MalformedTrailer):
        await decode(body, UNSIGNED_TRAILER, trailer="sha256")  # announced sha256, but crc32 arrives
    wrong_value = body.replace(crc32_b64(data).encode(), crc32_b64(b"other").encode())
    with pytest.raises(BadDigest):
        await decode(wrong_value, UNSIGNED_TRAILER, trailer="crc32")


async def test_trailer_value_unreadable() -> None:
    body = botocore_chunked(b"abc")
    with pytest.raises(S3Error) as info:
        await decode(body.replace(crc32_b64(b"abc").encode(), b"!!notb64"), UNSIGNED_TRAILER, trailer="crc32")
    assert info.value.code == "InvalidRequest"


async def test_missing_trailer() -> None:
    with pytest.raises(IncompleteBody):
        await decode(b"3\r\nabc\r\n0\r\n\r\n", UNSIGNED_TRAILER, trailer="crc32")


async def test_trailer_without_announced_checksum_is_accepted() -> None:
    assert await decode(botocore_chunked(b"abc"), UNSIGNED_TRAILER) == b"abc"


async def test_trailer_in_non_trailer_mode() -> None:
    auth = signed_auth(PayloadMode.STREAMING_SIGNED)
    body = build_signed(b"abc", 8192, auth)
    body = body[:-2] + b"x-amz-checksum-crc32:AAAAAA==\r\n\r\n"
    with pytest.raises(MalformedChunkedEncoding):
        await decode(body, auth.payload_mode, auth=auth)


# -- truncation, lengths, framing ------------------------------------------------------------------------


async def test_every_truncation_is_incomplete() -> None:
    data = bytes(range(256)) * 20
    auth = signed_auth(PayloadMode.STREAMING_SIGNED)
    streams = [
        (botocore_chunked(data, chunk_size=1000), UNSIGNED_TRAILER, None, "crc32"),
        (build_signed(data, 2048, auth), auth.payload_mode, auth, None),
    ]
    for body, mode, stream_auth, trailer in streams:
        # the final CRLF is optional: everything verifiable has arrived by then
        for cut in range(len(body) - 2):
            with pytest.raises(IncompleteBody):
                await decode(body[:cut], mode, auth=stream_auth, trailer=trailer, max_piece=4096)


async def test_decoded_length_mismatch() -> None:
    body = botocore_chunked(b"a" * 5000, chunk_size=1000)
    with pytest.raises(IncompleteBody) as info:
        await decode(body, UNSIGNED_TRAILER, trailer="crc32", decoded_length=5001)
    assert info.value.extra == {"NumberBytesExpected": "5001", "NumberBytesProvided": "5000"}
    yielded = 0

    async def count() -> None:
        nonlocal yielded
        decoder = AwsChunkedDecoder(aiter_pieces([body]), UNSIGNED_TRAILER, decoded_length=4999)
        async for piece in decoder:
            yielded += len(piece)

    with pytest.raises(IncompleteBody):
        await count()
    assert yielded == 4000  # refused at the header of the chunk that overflows, before its data


async def test_max_length() -> None:
    body = botocore_chunked(b"a" * 5000, chunk_size=1000)
    with pytest.raises(EntityTooLarge):
        await decode(body, UNSIGNED_TRAILER, max_length=4500)
    assert await decode(body, UNSIGNED_TRAILER, max_length=5000) == b"a" * 5000


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nabc\r\n0\r\n\r\n",
        b"-3\r\nabc\r\n0\r\n\r\n",
        b"0x3\r\nabc\r\n0\r\n\r\n",
        b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
        b"\r\nabc\r\n0\r\n\r\n",
        b"3\r\nabcXY0\r\n\r\n",
        b"3\r\nabc\rX0\r\n\r\n",
        b"3\r\nabc\r\n0\r\n\r\ngarbage",
        b"1" * (MAX_LINE + 1),
    ],
)
async def test_malformed_framing(body: bytes) -> None:
    with pytest.raises(MalformedChunkedEncoding) as info:
        await decode(body, UNSIGNED_TRAILER, max_piece=7)
    assert info.value.code == "InvalidRequest" and info.value.status == 400


async def test_malformed_trailer() -> None:
    with pytest.raises(MalformedTrailer) as info:
        await decode(b"3\r\nabc\r\n0\r\nno-colon-here\r\n\r\n", UNSIGNED_TRAILER)
    assert info.value.code == "MalformedTrailerError"
    body = b"3\r\nabc\r\n0\r\nx-amz-checksum-crc32:" + crc32_b64(b"abc").encode() + b"\r\n"
    with pytest.raises(MalformedTrailer):
        await decode(body + b"x-amz-checksum-crc32:AAAAAA==\r\n\r\n", UNSIGNED_TRAILER, trailer="crc32")
    with pytest.raises(MalformedTrailer):
        await decode(body + b"x-amz-meta-late:1\r\n\r\n", UNSIGNED_TRAILER, trailer="crc32")


async def test_lenient_forms() -> None:
    # chunk extensions ignored when unsigned, bare LF line ends, upper-case hex, trailing CRLFs
    body = b"3;ext=1\r\nabc\r\nA\nabcdefghij\r\n0\r\n\r\n\r\n"
    assert await decode(body, UNSIGNED_TRAILER, max_piece=2) == b"abcabcdefghij"


async def test_zero_copy() -> None:
    data = random.Random(3).randbytes(200_000)
    pieces = split_randomly(botocore_chunked(data, chunk_size=65536), random.Random(4), 30_000)
    decoder = AwsChunkedDecoder(aiter_pieces(pieces), UNSIGNED_TRAILER, trailer_checksum=new_checksum("crc32"))
    out = []
    async for view in decoder:
        assert isinstance(view, memoryview)
        assert any(view.obj is piece for piece in pieces)
        out.append(bytes(view))
    assert b"".join(out) == data
    assert decoder.trailers == {"x-amz-checksum-crc32": crc32_b64(data)}
    assert decoder.decoded_bytes == len(data)


async def test_decode_only_once() -> None:
    decoder = AwsChunkedDecoder(aiter_pieces([b"0\r\n\r\n"]), UNSIGNED_TRAILER)
    assert await collect(decoder) == b""
    with pytest.raises(RuntimeError):
        decoder.__aiter__()


def test_constructor_guards() -> None:
    with pytest.raises(ValueError, match="not an aws-chunked payload mode"):
        AwsChunkedDecoder(aiter_pieces([]), PayloadMode.UNSIGNED)
    with pytest.raises(ValueError, match="signed chunks need the AuthResult"):
        AwsChunkedDecoder(aiter_pieces([]), PayloadMode.STREAMING_SIGNED)
    with pytest.raises(ValueError, match="no trailer to carry a checksum"):
        AwsChunkedDecoder(
            aiter_pieces([]),
            PayloadMode.STREAMING_SIGNED,
            auth=signed_auth(PayloadMode.STREAMING_SIGNED),
            trailer_checksum=new_checksum("crc32"),
        )
