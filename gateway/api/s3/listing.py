"""Object listings in S3 order over the index's name table: prefix, delimiter, markers, max-keys.

``list_page`` is synchronous (it reads LMDB page by page in short transactions); callers run it in a
worker thread. Keys come in UTF-8 byte order, which is S3's. With a delimiter, keys that share a
common prefix roll up into one entry; the scan then jumps past that prefix instead of reading every
key under it. Expired chunks are skipped (they are absent to readers).

Continuation tokens are opaque to clients: the last key or common prefix returned, base64url
encoded with its kind, so a listing resumes exactly after it (a common prefix resumes after
everything under it).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from backends.index import ChunkIndex, IndexEntry
from gateway.api.s3.errors import S3Error

_PAGE = 1000
_PAST_PREFIX = "\U0010ffff"  # sorts after every character a key can continue a prefix with


@dataclass(slots=True)
class Page:
    contents: list[IndexEntry] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    truncated: bool = False
    last: tuple[str, str] | None = None  # ("k", key) or ("p", common prefix): where the next page resumes


def list_page(index: ChunkIndex, bucket: str, *, prefix: str, delimiter: str | None, after: str | None,
              skip_prefix: str | None, max_keys: int, now: float) -> Page:
    """Up to ``max_keys`` keys and common prefixes of ``bucket`` strictly after ``after`` (and not
    under ``skip_prefix``), with ``truncated`` telling whether more follow."""
    page = Page()
    if max_keys <= 0:
        return page
    after_raw = after.encode() if after is not None else None
    cursor = prefix if after is None or after < prefix else after
    if skip_prefix is not None and cursor < skip_prefix + _PAST_PREFIX:
        cursor = skip_prefix + _PAST_PREFIX
    count = 0
    while True:
        entries = index.list_names(bucket, cursor, _PAGE)
        jumped = False
        for entry in entries:
            key = entry.key
            if after_raw is not None and key.encode() <= after_raw:
                continue
            if skip_prefix is not None and key.startswith(skip_prefix):
                continue
            if not key.startswith(prefix):
                return page  # sorted: past the prefix
            if not entry.alive(now):
                continue
            if delimiter:
                at = key.find(delimiter, len(prefix))
                if at >= 0:
                    common = key[: at + len(delimiter)]
                    if count == max_keys:
                        page.truncated = True
                        return page
                    page.prefixes.append(common)
                    page.last = ("p", common)
                    count += 1
                    skip_prefix = common
                    cursor = common + _PAST_PREFIX
                    jumped = True
                    break
            if count == max_keys:
                page.truncated = True
                return page
            page.contents.append(entry)
            page.last = ("k", key)
            count += 1
        if jumped:
            continue
        if len(entries) < _PAGE:
            return page
        cursor = entries[-1].key + "\x00"


def encode_token(last: tuple[str, str]) -> str:
    kind, value = last
    return base64.urlsafe_b64encode(f"{kind}{value}".encode()).decode("ascii")


def decode_token(token: str) -> tuple[str, str]:
    try:
        text = base64.urlsafe_b64decode(token.encode("ascii")).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeError):
        text = ""
    if len(text) < 2 or text[0] not in "kp":
        raise S3Error("InvalidArgument", "The continuation token provided is incorrect",
                      ArgumentName="continuation-token")
    return text[0], text[1:]


def parse_max(raw: str | None, name: str, limit: int = 1000) -> int:
    if raw is None:
        return limit
    if not raw.strip().lstrip("-").isdigit():
        raise S3Error("InvalidArgument", f"Provided {name} not an integer or within integer range",
                      ArgumentName=name, ArgumentValue=raw[:64])
    value = int(raw)
    if value < 0:
        raise S3Error("InvalidArgument", f"Argument {name} must be an integer between 0 and 2147483647",
                      ArgumentName=name, ArgumentValue=raw[:64])
    return min(value, limit)
