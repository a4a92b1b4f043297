"""Streaming decoder for ``Content-Encoding: aws-chunked`` request bodies.

Wire format (sizes in hex, every line ends in CRLF; a bare LF is tolerated)::

    body     := chunk* last-chunk trailer* CRLF
    chunk    := hex-size [";chunk-signature=" sig] CRLF data CRLF
    last     := "0" [";chunk-signature=" sig] CRLF
    trailer  := name ":" value CRLF          (e.g. x-amz-checksum-crc32:sOO8/Q==)

With ``STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]`` every chunk carries a signature chained from
the seed (the request signature); the signed-trailer variant ends with
``x-amz-trailer-signature:<sig>`` over the ``name:value\\n`` trailer lines. With
``STREAMING-UNSIGNED-PAYLOAD-TRAILER`` (botocore >= 1.36, aws CLI) chunks are unsigned and integrity
comes from the trailing checksum named by ``x-amz-trailer``.

Data is yielded as memoryviews of the incoming pieces (no copy) as soon as it arrives, BEFORE its
chunk signature, the trailing checksum and the decoded length have been checked: those failures are
raised from the iterator before it ends. A caller must therefore treat the data as provisional and
commit it only after the iterator is exhausted without error. Memory stays bounded by one header
line (``MAX_LINE``) and the trailer section (``MAX_TRAILER``) whatever the chunk sizes are.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import AsyncIterable, AsyncIterator

from gateway.api.s3 import sigv4
from gateway.api.s3.auth import AuthResult, PayloadMode
from gateway.api.s3.checksums import Checksum, decode_b64_digest, header_for_algorithm
from gateway.api.s3.errors import (
    BadDigest,
    EntityTooLarge,
    IncompleteBody,
    MalformedChunkedEncoding,
    MalformedTrailer,
    S3Error,
    SignatureDoesNotMatch,
)

__all__ = ["MAX_LINE", "MAX_TRAILER", "AwsChunkedDecoder"]

MAX_LINE = 4096
MAX_TRAILER = 16 * 1024

_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)
_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIG = re.compile(rb"chunk-signature=([0-9a-f]{64})")
_TRAILER_SIGNATURE = "x-amz-trailer-signature"
_TRAILER_LINE = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")


class AwsChunkedDecoder:
    """Decode (and verify) one aws-chunked body; iterate it once, to the end.

    ``auth`` is required when ``mode.signed_chunks``. ``trailer_checksum`` is the checksum named by
    ``x-amz-trailer`` (only for trailer modes): it is fed the decoded data and must match the
    trailer. ``decoded_length`` is ``x-amz-decoded-content-length`` when sent; ``max_length`` caps
    the decoded size when it is not. After iteration, ``trailers`` holds the received trailers.
    """

    def __init__(
        self,
        body: AsyncIterable[bytes],
        mode: PayloadMode,
        *,
        auth: AuthResult | None = None,
        trailer_checksum: Checksum | None = None,
        decoded_length: int | None = None,
        max_length: int | None = None,
    ) -> None:
        if not mode.streaming:
            raise ValueError(f"{mode} is not an aws-chunked payload mode")
        if mode.signed_chunks and auth is None:
            raise ValueError("signed chunks need the AuthResult of the request")
        if trailer_checksum is not None and not mode.has_trailer:
            raise ValueError(f"{mode} has no trailer to carry a checksum")
        self._body = body
        self._mode = mode
        self._auth = auth if mode.signed_chunks else None
        self._checksum = trailer_checksum
        self._decoded_length = decoded_length
        self._max_length = max_length
        self._started = False
        self.trailers: dict[str, str] = {}
        self.decoded_bytes = 0
        self._trailer_size = 0
        self._trailer_canonical: list[bytes] = []
        self._trailer_verified = False

    def __aiter__(self) -> AsyncIterator[memoryview]:
        if self._started:
            raise RuntimeError("an aws-chunked body can be decoded only once")
        self._started = True
        return self._decode()

    async def _decode(self) -> AsyncIterator[memoryview]:
        # One state machine in one function: attribute lookups and calls per piece cost throughput.
        state = _SIZE
        line = bytearray()
        remaining = 0  # data bytes left in the current chunk
        crlf = 0  # bytes of the CRLF after chunk data seen so far
        checksum = self._checksum
        auth = self._auth
        chunk_hash: hashlib._Hash | None = None
        chunk_sig = b""
        previous_sig = auth.seed_signature if auth is not None else ""
        async for piece in self._body:
            n = len(piece)
            pos = 0
            view = memoryview(piece)
            while pos < n:
                if state == _DATA:
                    end = pos + remaining if pos + remaining < n else n
                    out = view[pos:end]
                    remaining -= end - pos
                    pos = end
                    if checksum is not None:
                        checksum.update(out)
                    if chunk_hash is not None:
                        chunk_hash.update(out)
                    yield out
                    if not remaining:
                        state = _CRLF
                elif state == _CRLF:
                    if piece[pos] != (13 if crlf == 0 else 10):
                        raise MalformedChunkedEncoding("Chunk data is not followed by CRLF.")
                    pos += 1
                    crlf += 1
                    if crlf == 2:
                        crlf = 0
                        state = _SIZE
                        if auth is not None and chunk_hash is not None:
                            previous_sig = self._check_chunk(auth, previous_sig, chunk_sig, chunk_hash)
                elif state == _DONE:
                    if piece[pos:].strip():
                        raise MalformedChunkedEncoding("Data after the end of the aws-chunked body.")
                    break
                else:
                    newline = piece.find(b"\n", pos)
                    end = n if newline < 0 else newline
                    if len(line) + end - pos > MAX_LINE:
                        raise MalformedChunkedEncoding("aws-chunked header line too long.")
                    line += view[pos:end]
                    if newline < 0:
                        break
                    pos = newline + 1
                    text = bytes(line[:-1] if line.endswith(b"\r") else line)
                    line.clear()
                    if state == _SIZE:
                        size, chunk_sig = self._parse_size_line(text)
                        self._count(size)
                        if auth is not None:
                            chunk_hash = hashlib.sha256()
                        if size:
                            remaining = size
                            state = _DATA
                        else:
                            if auth is not None and chunk_hash is not None:
                                previous_sig = self._check_chunk(auth, previous_sig, chunk_sig, chunk_hash)
                            state = _TRAILER
                    elif self._trailer_line(text, previous_sig):
                        self._finish()
                        state = _DONE
        if state == _TRAILER and not line and self._trailer_complete():
            self._finish()  # the closing CRLF is missing, but everything that matters arrived
        elif state != _DONE:
            raise IncompleteBody("The aws-chunked body ended before its last chunk.", extra=self._length_extra())

    # -- pieces of the state machine ----------------------------------------------------------------

    def _parse_size_line(self, text: bytes) -> tuple[int, bytes]:
        size_part, _, extension = text.partition(b";")
        size_part = size_part.strip()
        if not _HEX_SIZE.fullmatch(size_part):
            raise MalformedChunkedEncoding("Invalid aws-chunked chunk size.")
        if self._auth is None:
            return int(size_part, 16), b""
        match = _CHUNK_SIG.fullmatch(extension.strip())
        if match is None:
            raise MalformedChunkedEncoding("A signed aws-chunked chunk has no chunk-signature.")
        return int(size_part, 16), match.group(1)

    def _count(self, size: int) -> None:
        total = self.decoded_bytes + size
        if self._decoded_length is not None and total > self._decoded_length:
            raise IncompleteBody(
                "The aws-chunked body is longer than x-amz-decoded-content-length.",
                NumberBytesExpected=self._decoded_length,
                NumberBytesProvided=total,
            )
        if self._max_length is not None and total > self._max_length:
            raise EntityTooLarge(ProposedSize=total, MaxSizeAllowed=self._max_length)
        self.decoded_bytes = total

    @staticmethod
    def _check_chunk(auth: AuthResult, previous: str, provided: bytes, chunk_hash: hashlib._Hash) -> str:
        sts = sigv4.chunk_string_to_sign(auth.timestamp, auth.scope, previous, chunk_hash.hexdigest())
        expected = sigv4.sign(auth.signing_key, sts).encode("ascii")
        if not hmac.compare_digest(expected, provided):
            raise SignatureDoesNotMatch("The chunk signature we calculated does not match the signature you provided.")
        return provided.decode("ascii")

    def _trailer_line(self, text: bytes, previous_sig: str) -> bool:
        """Take one line of the trailer section; True when it closed the body."""
        if not text.strip():
            # minio-go writes "name:value\n\r\n" before the signature line: blank lines only close
            # the section once everything required has arrived.
            return self._trailer_complete()
        self._trailer_size += len(text)
        if self._trailer_size > MAX_TRAILER:
            raise MalformedTrailer("aws-chunked trailer section too long.")
        if not self._mode.has_trailer:
            raise MalformedChunkedEncoding("Trailing headers need a *-TRAILER x-amz-content-sha256.")
        raw_name, sep, raw_value = text.partition(b":")
        name = raw_name.strip().lower().decode("latin-1")
        value = raw_value.strip().decode("latin-1")
        if not sep or not _TRAILER_LINE.fullmatch(name):
            raise MalformedTrailer("Malformed aws-chunked trailing header.")
        if name == _TRAILER_SIGNATURE and self._auth is not None:
            self._check_trailer_signature(self._auth, previous_sig, value)
            return False
        announced = self._checksum is None or name == header_for_algorithm(self._checksum.algorithm)
        if not announced or name in self.trailers or self._trailer_verified:
            raise MalformedTrailer(f"Unexpected trailing header {name}.")
        self.trailers[name] = value
        self._trailer_canonical.append(f"{name}:{value}\n".encode("latin-1"))
        return False

    def _check_trailer_signature(self, auth: AuthResult, previous_sig: str, provided: str) -> None:
        sts = sigv4.trailer_string_to_sign(auth.timestamp, auth.scope, previous_sig, b"".join(self._trailer_canonical))
        if not sigv4.signatures_equal(sigv4.sign(auth.signing_key, sts), provided):
            raise SignatureDoesNotMatch(
                "The trailer signature we calculated does not match the signature you provided."
            )
        self._trailer_verified = True

    def _trailer_complete(self) -> bool:
        if self._mode is PayloadMode.STREAMING_SIGNED_TRAILER and not self._trailer_verified:
            return False
        checksum = self._checksum
        return checksum is None or header_for_algorithm(checksum.algorithm) in self.trailers

    def _finish(self) -> None:
        """Checks that need the whole body: decoded length, then the trailing checksum."""
        if self._decoded_length is not None and self.decoded_bytes != self._decoded_length:
            raise IncompleteBody(extra=self._length_extra())
        checksum = self._checksum
        if checksum is None:
            return
        header = header_for_algorithm(checksum.algorithm)
        expected = decode_b64_digest(checksum.algorithm, self.trailers[header])
        if expected is None:
            raise S3Error("InvalidRequest", f"Value for {header} trailing header is invalid.")
        if not hmac.compare_digest(expected, checksum.digest()):
            raise BadDigest(f"The {checksum.algorithm.upper()} you specified did not match the calculated checksum.")

    def _length_extra(self) -> dict[str, str | int]:
        if self._decoded_length is None:
            return {"NumberBytesProvided": self.decoded_bytes}
        return {"NumberBytesExpected": self._decoded_length, "NumberBytesProvided": self.decoded_bytes}
