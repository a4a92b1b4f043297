"""The request body as the headers promised it: one pass that decodes and verifies everything.

``open_payload(auth, headers, body)`` reads the body-related headers once and returns a
``Payload`` whose iteration yields the object bytes (memoryviews) and checks, in the same pass:

- aws-chunked framing, chunk and trailer signatures, the trailing checksum (``chunked``);
- the hex ``x-amz-content-sha256`` of a signed single-chunk body (XAmzContentSHA256Mismatch);
- ``x-amz-checksum-<alg>`` and ``Content-MD5`` headers (BadDigest; unreadable values: InvalidRequest,
  InvalidDigest);
- the length: ``x-amz-decoded-content-length`` or ``Content-Length`` (IncompleteBody) and
  ``max_length`` (EntityTooLarge).

Bytes are yielded before the end-of-body checks run, so the service must commit only after the
iteration finished without error (write the blob, then commit the index). A plain (not aws-chunked)
payload can lend the body's leading part to a threaded receive instead (``threaded``): those bytes skip
the iteration, are hashed in the receiving thread and still count toward its checks. Framing is decided by
``x-amz-content-sha256`` alone, as S3 does: ``Content-Encoding: aws-chunked`` on a plainly signed
body is only stripped from the stored encoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from gateway.api.s3 import sigv4
from gateway.api.s3.auth import AuthResult, Headers, PayloadMode
from gateway.api.s3.checksums import (
    BytesLike,
    Checksum,
    UnsupportedChecksum,
    algorithm_for_header,
    decode_b64_digest,
    new_checksum,
)
from gateway.api.s3.chunked import AwsChunkedDecoder
from gateway.api.s3.errors import (
    BadDigest,
    EntityTooLarge,
    IncompleteBody,
    InvalidDigest,
    S3Error,
    XAmzContentSHA256Mismatch,
)
from gateway.chunks import ThreadedBody, ThreadedOutcome
from gateway.dataplane.intake import THREADED_RECEIVERS

__all__ = ["Payload", "open_payload", "strip_aws_chunked"]

HASH_BATCH_BYTES = 1 << 20
"""Body checksums (the SHA-256 of a signed payload, a CRC32 header: ~6 ms of CPU per 8 MiB) are
computed in a worker thread, this many bytes at a time, while the event loop receives the next
pieces and serves other requests. hashlib and zlib release the GIL on such buffers, so the hashing
runs beside the loop on another core. Smaller bodies (XML, small objects) are hashed inline."""


_HASHING = concurrent.futures.ThreadPoolExecutor(THREADED_RECEIVERS, thread_name_prefix="kvgw-body-hash")
"""Where a threaded receive's pieces are hashed for the payload's checks (a signed SHA-256: 2 ms per
2 MiB piece here) while the receiving thread hashes (xxh3) and writes the same piece: one per
receiving thread, so none waits for another's."""


class Payload:
    """A request body being verified. Iterate once, to the end; then read ``checksums``.

    ``length`` is the object size announced by the client (None if only the end of the stream will
    tell); ``content_encoding`` is the encoding to store, without ``aws-chunked``; ``checksums``
    (algorithm -> base64) holds every checksum computed: verified ones and those asked for.
    """

    def __init__(
        self,
        stream: AsyncIterable[bytes] | AwsChunkedDecoder,
        *,
        length: int | None,
        content_encoding: str | None,
        checks: list[_Check],
        hashers: list[Checksum],
        reported: list[Checksum],
        max_length: int | None,
    ) -> None:
        self.length = length
        self.content_encoding = content_encoding
        self.checksums: dict[str, str] = {}
        self._stream = stream
        self._checks = checks
        self._hashers = hashers
        self._reported = reported
        self._max_length = max_length
        self._started = False
        self._threaded: ThreadedBody | None = None  # the request's, while this payload lends itself as one
        self._threaded_bytes = 0  # handed to a threaded receive's consumer before the iteration

    def threaded(self, body: ThreadedBody | None) -> ThreadedBody | None:
        """This payload as a ``ThreadedBody`` over ``body`` (the request's: ``Request.threaded_body``)
        where its leading bytes may skip the iteration: a plain body (not aws-chunked), as an
        UNSIGNED-PAYLOAD PUT (LMCache's S3 connector's, the load generator's) or boto3's (a signed
        SHA-256 and a CRC32 header) is. The receiving thread feeds what it hands over to this payload's
        hashers before the consumer sees it, and it counts toward the length the iteration checks at
        its end; iterate the payload for the rest as usual, which checks every digest. None for an
        aws-chunked body (every byte must pass its decoder) or where ``body`` is None."""
        if body is None or isinstance(self._stream, AwsChunkedDecoder) or self._started:
            return None
        self._threaded = body
        return self

    async def consume_in_thread(self, consume: Callable[[memoryview], None]) -> ThreadedOutcome:
        """``ThreadedBody``, once ``threaded`` lent this payload as one, and before the iteration: each
        piece is hashed (the same hashers, in body order, as the iteration's), then consumed, in the
        receiving thread."""
        assert self._threaded is not None and not self._started
        hashers = self._hashers

        def counted(piece: memoryview) -> None:
            hashing = _HASHING.submit(_update, hashers, [piece]) if hashers else None
            try:
                consume(piece)
            finally:
                if hashing is not None:
                    hashing.result()  # before the receiving thread reuses the piece's buffer
            self._threaded_bytes += len(piece)

        return await self._threaded.consume_in_thread(counted)

    def __aiter__(self) -> AsyncIterator[memoryview]:
        if self._started:
            raise RuntimeError("a request body can be read only once")
        self._started = True
        return self._run()

    async def _run(self) -> AsyncIterator[memoryview]:
        hashers = self._hashers
        chunked = isinstance(self._stream, AwsChunkedDecoder)
        limit = self._max_length
        received = self._threaded_bytes
        batch: list[BytesLike] = []  # pieces not hashed yet
        batch_bytes = 0
        hashing: asyncio.Future[None] | None = None  # the previous batch, hashed in a worker thread
        async for piece in self._stream:
            if not chunked:
                received += len(piece)
                if limit is not None and received > limit:
                    raise EntityTooLarge(ProposedSize=received, MaxSizeAllowed=limit)
            if hashers:
                batch.append(piece)
                batch_bytes += len(piece)
                if batch_bytes >= HASH_BATCH_BYTES:
                    if hashing is not None:
                        await hashing
                    hashing = asyncio.get_running_loop().run_in_executor(None, _update, hashers, batch)
                    batch, batch_bytes = [], 0
            yield piece if isinstance(piece, memoryview) else memoryview(piece)
        if hashing is not None:
            await hashing
        _update(hashers, batch)
        if not chunked and self.length is not None and received != self.length:
            raise IncompleteBody(NumberBytesExpected=self.length, NumberBytesProvided=received)
        for check in self._checks:
            if not hmac.compare_digest(check.checksum.digest(), check.expected):
                raise check.error
        for checksum in (*hashers, *self._reported):
            self.checksums[checksum.algorithm] = checksum.b64digest()


def _update(hashers: list[Checksum], pieces: list[BytesLike]) -> None:
    for piece in pieces:
        for hasher in hashers:
            hasher.update(piece)


@dataclass(frozen=True, slots=True)
class _Check:
    checksum: Checksum
    expected: bytes
    error: S3Error


def strip_aws_chunked(content_encoding: str | None) -> str | None:
    """``Content-Encoding`` without the ``aws-chunked`` token (S3 never stores it); None if empty."""
    if content_encoding is None:
        return None
    tokens = [t.strip() for t in content_encoding.split(",")]
    kept = [t for t in tokens if t and t.lower() != "aws-chunked"]
    return ", ".join(kept) or None


def open_payload(
    auth: AuthResult,
    headers: Headers,
    body: AsyncIterable[bytes],
    *,
    max_length: int | None = None,
    compute: Iterable[str] = (),
    header_checksums: bool = True,
) -> Payload:
    """Set up verification of ``body`` (ASGI body pieces) for a request authenticated as ``auth``.

    Header problems (bad lengths, unreadable digests, unknown trailer) raise here, before any byte
    is read; body problems raise from the iteration. ``compute`` names extra algorithms
    (``"md5"`` for an S3 ETag, ...) computed in the same pass. ``header_checksums=False`` ignores
    ``x-amz-checksum-*`` headers that describe something else than the body (CompleteMultipartUpload).
    """
    hmap = sigv4.header_map(headers)
    mode = auth.payload_mode
    checks = _header_checks(hmap) if header_checksums else []
    if mode is PayloadMode.SHA256:
        checks.append(_Check(new_checksum("sha256"), bytes.fromhex(auth.payload_hash), XAmzContentSHA256Mismatch()))
    encoding = strip_aws_chunked(_text(hmap, b"content-encoding"))

    trailer: Checksum | None = None
    if mode.streaming:
        length = _length(hmap, b"x-amz-decoded-content-length")
        if mode.has_trailer:
            trailer = _trailer_checksum(hmap, has_header_checksum=any(c.checksum.algorithm != "md5" for c in checks))
        stream: AsyncIterable[bytes] | AwsChunkedDecoder = AwsChunkedDecoder(
            body, mode, auth=auth, trailer_checksum=trailer, decoded_length=length, max_length=max_length
        )
    else:
        length = _length(hmap, b"content-length")
        stream = body
    if length is not None and max_length is not None and length > max_length:
        raise EntityTooLarge(ProposedSize=length, MaxSizeAllowed=max_length)

    # One hasher per algorithm: a header checksum, the SHA-256 check and ``compute`` share it.
    hashers: dict[str, Checksum] = {}
    for check in checks:
        hashers.setdefault(check.checksum.algorithm, check.checksum)
    checks = [_Check(hashers[c.checksum.algorithm], c.expected, c.error) for c in checks]
    for algorithm in compute:
        algorithm = algorithm.lower()
        if trailer is not None and algorithm == trailer.algorithm:
            continue
        if algorithm not in hashers:
            try:
                hashers[algorithm] = new_checksum(algorithm)
            except UnsupportedChecksum:
                raise ValueError(f"unknown checksum algorithm {algorithm!r}") from None
    return Payload(
        stream,
        length=length,
        content_encoding=encoding,
        checks=checks,
        hashers=list(hashers.values()),
        reported=[trailer] if trailer is not None else [],
        max_length=max_length,
    )


def _text(hmap: sigv4.HeaderMap, name: bytes) -> str | None:
    values = hmap.get(name)
    return ",".join(v.decode("latin-1") for v in values) if values else None


def _length(hmap: sigv4.HeaderMap, name: bytes) -> int | None:
    text = _text(hmap, name)
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit() or len(text) > 19:
        raise S3Error("InvalidArgument", f"Invalid {name.decode()} header.", ArgumentName=name.decode())
    return int(text)


_NOT_CHECKSUMS = frozenset({b"x-amz-checksum-type", b"x-amz-checksum-mode"})


def _header_checks(hmap: sigv4.HeaderMap) -> list[_Check]:
    """Content-MD5 and at most one x-amz-checksum-<alg> header, as S3 accepts them."""
    checks: list[_Check] = []
    md5 = _text(hmap, b"content-md5")
    if md5 is not None:
        digest = decode_b64_digest("md5", md5)
        if digest is None:
            raise InvalidDigest()
        checks.append(_Check(new_checksum("md5"), digest, BadDigest()))
    names = [n for n in hmap if n.startswith(b"x-amz-checksum-") and n not in _NOT_CHECKSUMS]
    if len(names) > 1:
        raise S3Error(
            "InvalidRequest", "Expecting a single x-amz-checksum- header. Multiple checksum Types are not allowed."
        )
    for name in names:
        header = name.decode("latin-1")
        algorithm = algorithm_for_header(header)
        if algorithm is None:
            raise S3Error("InvalidRequest", "The algorithm type you specified in x-amz-checksum- header is invalid.")
        digest = decode_b64_digest(algorithm, _text(hmap, name) or "")
        if digest is None:
            raise S3Error("InvalidRequest", f"Value for {header} header is invalid.")
        message = f"The {algorithm.upper()} you specified did not match the calculated checksum."
        checks.append(_Check(_checksum(algorithm), digest, BadDigest(message)))
    return checks


def _trailer_checksum(hmap: sigv4.HeaderMap, *, has_header_checksum: bool) -> Checksum | None:
    """The checksum named by ``x-amz-trailer`` (None when the client announced no trailer)."""
    text = _text(hmap, b"x-amz-trailer")
    if text is None:
        return None
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    algorithm = algorithm_for_header(names[0]) if len(names) == 1 else None
    if algorithm is None or algorithm == "md5":
        raise S3Error("InvalidRequest", "The value specified in the x-amz-trailer header is not supported")
    if has_header_checksum:
        raise S3Error(
            "InvalidRequest", "Expecting a single x-amz-checksum- header. Multiple checksum Types are not allowed."
        )
    return _checksum(algorithm)


def _checksum(algorithm: str) -> Checksum:
    try:
        return new_checksum(algorithm)
    except UnsupportedChecksum as exc:
        raise S3Error("InvalidRequest", f"Checksum algorithm not supported by this server: {exc}") from None
