"""S3 listing parameters: continuation tokens and max-keys.

The listing itself (prefix, delimiter roll-up, markers, expired chunks skipped, UTF-8 byte order,
which is S3's) is ``ChunkService.list_page``; the handlers in ``gateway.api.s3.buckets`` map S3's
query parameters onto it.

Continuation tokens are opaque to clients: the last key or common prefix returned, base64url
encoded with its kind, so a listing resumes exactly after it (a common prefix resumes after
everything under it).
"""

from __future__ import annotations

import base64
import binascii

from gateway.api.s3.errors import S3Error


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
