"""Checksums: known vectors, agreement with botocore's own classes, incremental updates."""

from __future__ import annotations

import base64
import hashlib
import random
import sys

import pytest
from botocore.httpchecksum import Crc32Checksum, Sha1Checksum, Sha256Checksum

from gateway.api.s3.checksums import (
    ALGORITHMS,
    UnsupportedChecksum,
    algorithm_for_header,
    decode_b64_digest,
    header_for_algorithm,
    new_checksum,
)
from tests.requirements import require_module

VECTORS = {  # the CRC catalogue's check values over b"123456789"
    "crc32": 0xCBF43926,
    "crc32c": 0xE3069283,
    "crc64nvme": 0xAE8B14860A799888,
}


@pytest.mark.parametrize("algorithm", sorted(VECTORS))
def test_check_values(algorithm: str) -> None:
    if algorithm != "crc32":
        require_module("awscrt")
    checksum = new_checksum(algorithm)
    checksum.update(b"123456789")
    size = ALGORITHMS[algorithm][1]
    assert checksum.digest() == VECTORS[algorithm].to_bytes(size, "big")
    assert checksum.b64digest() == base64.b64encode(checksum.digest()).decode()


def _botocore(algorithm: str) -> object:
    classes: dict[str, type] = {"crc32": Crc32Checksum, "sha1": Sha1Checksum, "sha256": Sha256Checksum}
    if algorithm in ("crc32c", "crc64nvme"):
        require_module("awscrt")
        from botocore.httpchecksum import CrtCrc32cChecksum, CrtCrc64NvmeChecksum

        classes.update(crc32c=CrtCrc32cChecksum, crc64nvme=CrtCrc64NvmeChecksum)
    return classes[algorithm]()


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "crc64nvme", "sha1", "sha256"])
def test_incremental_matches_botocore(algorithm: str) -> None:
    theirs = _botocore(algorithm)
    data = random.Random(1).randbytes(1_000_003)
    ours = new_checksum(algorithm.upper())
    view = memoryview(data)
    for start in range(0, len(data), 65_537):
        ours.update(view[start : start + 65_537])
    theirs.update(data)  # type: ignore[attr-defined]
    assert ours.b64digest() == theirs.b64digest()  # type: ignore[attr-defined]


def test_md5_and_headers() -> None:
    md5 = new_checksum("md5")
    md5.update(bytearray(b"hello"))
    assert md5.digest() == hashlib.md5(b"hello").digest()
    assert header_for_algorithm("md5") == "content-md5"
    assert header_for_algorithm("CRC32C") == "x-amz-checksum-crc32c"
    assert algorithm_for_header("X-Amz-Checksum-SHA256") == "sha256"
    assert algorithm_for_header("content-md5") == "md5"
    assert algorithm_for_header("x-amz-checksum-md5") is None
    assert algorithm_for_header("x-amz-checksum-type") is None
    with pytest.raises(UnsupportedChecksum):
        new_checksum("md4")


def test_decode_b64_digest() -> None:
    assert decode_b64_digest("crc32", "DUoRhQ==") == base64.b64decode("DUoRhQ==")
    assert decode_b64_digest("crc32", " DUoRhQ== ") is not None
    assert decode_b64_digest("crc32", "DUoRhQ") is None  # padding missing
    assert decode_b64_digest("sha256", "DUoRhQ==") is None  # wrong size
    assert decode_b64_digest("crc32", "D!oRhQ==") is None
    assert decode_b64_digest("nope", "DUoRhQ==") is None


def test_without_awscrt_crc32c_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "awscrt", None)  # makes "import awscrt" fail
    with pytest.raises(UnsupportedChecksum, match="awscrt"):
        new_checksum("crc32c")
    new_checksum("crc32").update(b"still fine")
