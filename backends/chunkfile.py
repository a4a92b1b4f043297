"""Self-describing chunk encoding: the chunk's bytes followed by a footer that records its ChunkMeta.

Layout of a chunk file (and of a chunk object in the S3 tier)::

    data[size] | meta_json[n] | n:u32 | "KVGWCF01"

meta_json: {"v": 1, "bucket", "key", "size", "checksum" (xxh3-64, 16 hex), "created", "expires",
optionally "parent", "attrs" and "md5" (the S3 ETag of a chunk written to an MD5-mode bucket,
``backends.base.MD5_ETAG``; also in multipart part files, where it is the part's MD5).

A footer rather than a header: the checksum is only known after the body has streamed through, data
starts at offset 0 so range reads need no arithmetic, and the footer is written last, so a file that
has its magic has all of its bytes. JSON keeps the format inspectable and extensible.
"""

from __future__ import annotations

import json
import os
import struct

from backends.base import MD5_ETAG, ChunkMeta
from backends.errors import ChunkCorrupt

MAGIC = b"KVGWCF01"
TAIL = struct.Struct("<I8s")
MAX_META_BYTES = 64 * 1024


def encode_footer(meta: ChunkMeta) -> bytes:
    doc = {
        "v": 1,
        "bucket": meta.bucket,
        "key": meta.key,
        "size": meta.size,
        "checksum": f"{meta.checksum:016x}",
        "created": meta.created,
        "expires": meta.expires,
    }
    if meta.parent is not None:
        doc["parent"] = meta.parent
    if meta.attrs:
        doc["attrs"] = dict(meta.attrs)
    if meta.md5_etag is not None:
        doc["md5"] = meta.md5_etag
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return body + TAIL.pack(len(body), MAGIC)


def footer_length(tail: bytes) -> int:
    """Length of the meta JSON given the last ``TAIL.size`` bytes of the object."""
    if len(tail) != TAIL.size:
        raise ChunkCorrupt("chunk is shorter than its footer")
    n, magic = TAIL.unpack(tail)
    if magic != MAGIC or n > MAX_META_BYTES:
        raise ChunkCorrupt("chunk footer is missing or damaged")
    return int(n)


def decode_meta(body: bytes, total_size: int) -> ChunkMeta:
    """Parse the meta JSON and check it against the object's total size (data + footer)."""
    try:
        doc = json.loads(body)
        meta = ChunkMeta(
            bucket=str(doc["bucket"]),
            key=str(doc["key"]),
            size=int(doc["size"]),
            checksum=int(doc["checksum"], 16),
            created=float(doc["created"]),
            expires=float(doc.get("expires", 0.0)),
            parent=doc.get("parent"),
            attrs=tuple(sorted((str(k), str(v)) for k, v in doc.get("attrs", {}).items())),
            md5_etag=None if doc.get("md5") is None else str(doc["md5"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkCorrupt("chunk footer is not valid metadata") from exc
    if meta.md5_etag is not None and not MD5_ETAG.fullmatch(meta.md5_etag):
        raise ChunkCorrupt("chunk footer has an unreadable MD5 ETag")
    if meta.size + len(body) + TAIL.size != total_size:
        raise ChunkCorrupt("chunk size does not match its footer")
    return meta


def read_meta(path: str) -> ChunkMeta:
    """The ChunkMeta recorded in a chunk file's footer (two small preads, no data read).
    OSError if the file cannot be read; ChunkCorrupt if its footer is missing or damaged."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        total = os.fstat(fd).st_size
        tail_at = max(total - TAIL.size, 0)
        n = footer_length(os.pread(fd, TAIL.size, tail_at))
        body = os.pread(fd, n, tail_at - n) if tail_at >= n else b""
        return decode_meta(body, total)
    finally:
        os.close(fd)
