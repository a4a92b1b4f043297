"""Incremental checksums that S3 clients send: ``x-amz-checksum-*`` and ``Content-MD5``.

One interface for all (``update``, ``digest``, ``b64digest``), so the body verifier treats a header
checksum, a trailing checksum and Content-MD5 alike. Digests are big-endian, sent base64-encoded.

CRC32 is ``zlib.crc32`` (~5 GB/s here); CRC32C and CRC64NVME come from ``awscrt`` (hardware
accelerated, ~14 GB/s, and accepts memoryviews), the library botocore itself uses for them.
``awscrt`` is imported on first use so the module imports without it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "ALGORITHMS",
    "BytesLike",
    "Checksum",
    "UnsupportedChecksum",
    "algorithm_for_header",
    "decode_b64_digest",
    "header_for_algorithm",
    "new_checksum",
]

BytesLike = bytes | bytearray | memoryview


class Checksum(Protocol):
    algorithm: str  # "crc32", "crc32c", "crc64nvme", "sha1", "sha256", "md5"

    def update(self, data: BytesLike) -> None: ...

    def digest(self) -> bytes: ...

    def b64digest(self) -> str: ...


class UnsupportedChecksum(ValueError):
    """The algorithm is not one S3 defines (or its library is missing); callers map this to InvalidRequest."""


class _Crc:
    __slots__ = ("_fn", "_size", "_value", "algorithm")

    def __init__(self, algorithm: str, fn: Callable[[BytesLike, int], int], size: int) -> None:
        self.algorithm = algorithm
        self._fn = fn
        self._size = size
        self._value = 0

    def update(self, data: BytesLike) -> None:
        self._value = self._fn(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._size, "big")

    def b64digest(self) -> str:
        return base64.b64encode(self.digest()).decode("ascii")


class _Hash:
    __slots__ = ("_hash", "algorithm")

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._hash = hashlib.new(algorithm)

    def update(self, data: BytesLike) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.digest()

    def b64digest(self) -> str:
        return base64.b64encode(self._hash.digest()).decode("ascii")


def _crt(algorithm: str) -> Any:
    try:
        from awscrt import checksums  # optional dependency, loaded on first use
    except ImportError:
        raise UnsupportedChecksum(f"{algorithm} needs the awscrt package") from None
    return checksums


def _crc32c() -> Checksum:
    return _Crc("crc32c", _crt("crc32c").crc32c, 4)


def _crc64nvme() -> Checksum:
    return _Crc("crc64nvme", _crt("crc64nvme").crc64nvme, 8)


ALGORITHMS: dict[str, tuple[Callable[[], Checksum], int]] = {
    "crc32": (lambda: _Crc("crc32", zlib.crc32, 4), 4),
    "crc32c": (_crc32c, 4),
    "crc64nvme": (_crc64nvme, 8),
    "sha1": (lambda: _Hash("sha1"), 20),
    "sha256": (lambda: _Hash("sha256"), 32),
    "md5": (lambda: _Hash("md5"), 16),
}
"""algorithm -> (factory, digest size in bytes)."""


def new_checksum(algorithm: str) -> Checksum:
    """A fresh checksum; ``algorithm`` is case-insensitive ("CRC32" as x-amz-sdk-checksum-algorithm)."""
    try:
        factory, _ = ALGORITHMS[algorithm.lower()]
    except KeyError:
        raise UnsupportedChecksum(algorithm) from None
    return factory()


def header_for_algorithm(algorithm: str) -> str:
    """``crc32`` -> ``x-amz-checksum-crc32``; ``md5`` -> ``content-md5``."""
    algorithm = algorithm.lower()
    return "content-md5" if algorithm == "md5" else f"x-amz-checksum-{algorithm}"


def algorithm_for_header(name: str) -> str | None:
    """Inverse of ``header_for_algorithm``; None for any other header."""
    name = name.lower()
    if name == "content-md5":
        return "md5"
    if name.startswith("x-amz-checksum-") and name[15:] in ALGORITHMS and name[15:] != "md5":
        return name[15:]
    return None


def decode_b64_digest(algorithm: str, value: str) -> bytes | None:
    """The digest a client sent, or None if it is not base64 of the algorithm's digest size."""
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    entry = ALGORITHMS.get(algorithm.lower())
    if entry is None or len(raw) != entry[1]:
        return None
    return raw
