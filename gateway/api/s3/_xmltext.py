"""Escaping of text for S3 XML bodies, shared by the error and the response renderers.

Besides ``& < >``, control characters (and ``\\r``, which parsers would turn into ``\\n``) become
character references, as S3 writes them, so keys survive a round trip. XML 1.0 parsers still reject
some of those references: a client listing such keys should ask for ``EncodingType=url``.
"""

from __future__ import annotations

_TABLE = {ord("&"): "&amp;", ord("<"): "&lt;", ord(">"): "&gt;"}
_TABLE.update({c: f"&#x{c:X};" for c in range(0x20) if c not in (0x09, 0x0A)})


def escape_text(value: str) -> str:
    """``value`` as XML character data."""
    return value.translate(_TABLE)
