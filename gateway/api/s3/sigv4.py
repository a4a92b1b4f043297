"""AWS Signature Version 4 primitives as S3 computes them: canonical request, string to sign, keys.

Pure functions over bytes; no clock, no secrets lookup, no S3 errors (``auth`` adds those).

Canonicalisation follows what real S3 clients send, not the generic SigV4 rules:

- the path is NOT normalised or double-encoded for S3. botocore, awscrt and minio-go all sign the
  path exactly as they put it on the wire, so the raw path is the first candidate; a client that
  left some characters unencoded (``@``, ``!``, UTF-8) signs the fully encoded form, the second one;
- query parameters are decoded (``+`` meaning space, as servers parse them) and re-encoded with
  RFC 3986 unreserved characters only, then sorted by name and value;
- header values are trimmed and inner whitespace runs collapse to one space; repeated headers
  join with ``,``. Values are the raw bytes; botocore sends latin-1 where it signed UTF-8, so a
  non-ASCII value gets a second, transcoded candidate.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import quote_from_bytes, unquote_to_bytes

ALGORITHM = "AWS4-HMAC-SHA256"
CHUNK_ALGORITHM = "AWS4-HMAC-SHA256-PAYLOAD"
TRAILER_ALGORITHM = "AWS4-HMAC-SHA256-TRAILER"
TERMINATOR = "aws4_request"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

HeaderMap = Mapping[bytes, Sequence[bytes]]
"""Lower-case header name -> raw values in arrival order."""


def header_map(headers: Iterable[tuple[bytes, bytes]] | Mapping[str, str]) -> dict[bytes, list[bytes]]:
    """Normalise ASGI header pairs (raw bytes) or a text mapping (encoded as UTF-8) to a HeaderMap."""
    result: dict[bytes, list[bytes]] = {}
    if isinstance(headers, Mapping):
        for name, value in headers.items():
            result.setdefault(name.lower().encode("latin-1"), []).append(value.encode("utf-8"))
    else:
        for raw_name, raw_value in headers:
            result.setdefault(raw_name.lower(), []).append(raw_value)
    return result


def uri_encode(raw: bytes, *, keep_slash: bool) -> bytes:
    """SigV4 UriEncode: everything but ``A-Za-z0-9-_.~`` (and ``/`` if kept) as upper-case %XX."""
    return quote_from_bytes(raw, safe="/" if keep_slash else "").encode("ascii")


_CANONICAL_PATH = re.compile(  # unrolled ((plain)* (escape (plain)*)*): as fast as one character class
    rb"[A-Za-z0-9\-._~/]*"
    rb"(?:%(?:[01][0-9A-F]|2[0-9A-C]|3[A-F]|40|5[B-E]|60|7[BCDF]|[89A-F][0-9A-F])[A-Za-z0-9\-._~/]*)*"
)
"""A path already in canonical form: unreserved characters, ``/``, and upper-case escapes of exactly the
bytes ``uri_encode`` escapes (not of an unreserved character, nor of ``/``). Such a path is its own
and only canonical URI, found without decoding and re-encoding it (4 µs of a 60 µs HeadObject on the
lookup lane): LMCache's keys, whose ``@`` separators its S3 clients send as ``%40``, and vLLM's, which
have nothing to escape."""


def canonical_uris(raw_path: bytes) -> list[bytes]:
    """Candidate canonical URIs for a raw (as sent, percent-encoded) path; the raw one first."""
    if not raw_path:
        return [b"/"]
    if _CANONICAL_PATH.fullmatch(raw_path):
        return [raw_path]
    encoded = uri_encode(unquote_to_bytes(raw_path), keep_slash=True)
    return [raw_path] if encoded == raw_path else [raw_path, encoded]


def canonical_query(raw_query: bytes, *, exclude: frozenset[bytes] = frozenset()) -> bytes:
    """Canonical query string; parameter names in ``exclude`` (decoded) are left out."""
    pairs: list[tuple[bytes, bytes]] = []
    for part in raw_query.split(b"&"):
        if not part:
            continue
        name, _, value = part.partition(b"=")
        decoded_name = unquote_to_bytes(name.replace(b"+", b" "))
        if decoded_name in exclude:
            continue
        pairs.append(
            (
                uri_encode(decoded_name, keep_slash=False),
                uri_encode(unquote_to_bytes(value.replace(b"+", b" ")), keep_slash=False),
            )
        )
    pairs.sort()
    return b"&".join(name + b"=" + value for name, value in pairs)


def _trim_all(value: bytes) -> bytes:
    return b" ".join(value.split())


def _transcode_latin1(value: bytes) -> bytes:
    return value.decode("latin-1").encode("utf-8")


@functools.lru_cache(maxsize=256)
def _signed_names(signed: tuple[str, ...]) -> tuple[tuple[bytes, ...], bytes]:
    """The signed header names as bytes, and joined as the canonical request lists them; memoised, as
    ``auth`` memoises the parsed list: a client signs the same headers on every request."""
    names = tuple(name.encode("latin-1") for name in signed)
    return names, b";".join(names)


def canonical_header_blocks(headers: HeaderMap, signed: Sequence[str]) -> list[bytes]:
    """Candidate ``name:value\\n`` blocks for the signed headers (a missing header signs as empty)."""
    raw_lines: list[bytes] = []
    non_ascii = False
    for raw_name in _signed_names(tuple(signed))[0]:
        values = headers.get(raw_name)
        if values is None:
            value = b""
        elif len(values) == 1:  # the usual case, without a generator
            value = _trim_all(values[0])
        else:
            value = b",".join(_trim_all(v) for v in values)
        non_ascii = non_ascii or not value.isascii()
        raw_lines.append(raw_name + b":" + value + b"\n")
    blocks = [b"".join(raw_lines)]
    if non_ascii:
        blocks.append(_transcode_latin1(blocks[0]))
    return blocks


def canonical_requests(
    method: str,
    raw_path: bytes,
    raw_query: bytes,
    headers: HeaderMap,
    signed_headers: Sequence[str],
    payload_hash: str,
    *,
    exclude_query: frozenset[bytes] = frozenset(),
) -> list[bytes]:
    """Every canonical request a correct client may have signed for this request, likeliest first."""
    query = canonical_query(raw_query, exclude=exclude_query)
    tail = _signed_names(tuple(signed_headers))[1] + b"\n" + payload_hash.encode("latin-1")
    head = method.encode("latin-1")
    return [
        b"\n".join((head, uri, query, block)) + b"\n" + tail
        for uri, block in itertools.product(canonical_uris(raw_path), canonical_header_blocks(headers, signed_headers))
    ]


def string_to_sign(timestamp: str, scope: str, canonical_request: bytes) -> bytes:
    digest = hashlib.sha256(canonical_request).hexdigest()
    return f"{ALGORITHM}\n{timestamp}\n{scope}\n{digest}".encode("ascii")


def chunk_string_to_sign(timestamp: str, scope: str, previous_signature: str, chunk_sha256_hex: str) -> bytes:
    """String to sign for one aws-chunked chunk (the empty-headers hash is constant)."""
    return (
        f"{CHUNK_ALGORITHM}\n{timestamp}\n{scope}\n{previous_signature}\n{EMPTY_SHA256}\n{chunk_sha256_hex}"
    ).encode("ascii")


def trailer_string_to_sign(timestamp: str, scope: str, previous_signature: str, trailer: bytes) -> bytes:
    """String to sign for the trailing headers (``name:value\\n`` each) of a signed-trailer upload."""
    digest = hashlib.sha256(trailer).hexdigest()
    return f"{TRAILER_ALGORITHM}\n{timestamp}\n{scope}\n{previous_signature}\n{digest}".encode("ascii")


@functools.lru_cache(maxsize=1024)
def signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    """HMAC key chain ``AWS4<secret>`` -> date -> region -> service -> aws4_request.

    Cached, as SDKs cache it: one key serves a credential for a whole day. Deriving it was four HMAC
    calls on every request (about 7 of the 11 µs ``auth.verify`` took, and under 8 concurrent GETs
    py-spy put ~5% of the server's samples in them)."""
    key = hmac.digest(("AWS4" + secret).encode("utf-8"), date.encode("ascii"), "sha256")
    for part in (region, service, TERMINATOR):
        key = hmac.digest(key, part.encode("utf-8"), "sha256")
    return key


def sign(key: bytes, message: bytes) -> str:
    """Lower-case hex HMAC-SHA256, the form signatures travel in (``hmac.digest``: one call into
    OpenSSL, without building an ``hmac.HMAC``; a third of what ``hmac.new`` cost per request)."""
    return hmac.digest(key, message, "sha256").hex()


def signatures_equal(expected: str, provided: str) -> bool:
    """Constant-time comparison (``provided`` comes from the client)."""
    return hmac.compare_digest(expected.encode("ascii"), provided.encode("ascii", "replace"))
