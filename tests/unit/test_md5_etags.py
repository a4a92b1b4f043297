"""Where an MD5-mode chunk's ETag is recorded (``backends.base.MD5_ETAG``) and that it survives every
hop: the chunk file footer, the LMDB index record (older records without it still read), the cluster
feed's add event (with and without a prefix parent) and S3's multipart form."""

from __future__ import annotations

import hashlib

import pytest

from backends import chunkfile
from backends.base import ChunkMeta, pack_md5_etag, unpack_md5_etag
from backends.errors import ChunkCorrupt
from backends.index import RECORD, IndexEntry
from gateway.chunks import ChunkInfo
from gateway.cluster.feed import Kind, add_detail, to_change
from gateway.multipart import PartInfo, multipart_md5_etag

SINGLE = hashlib.md5(b"bar").hexdigest()
MULTI = hashlib.md5(b"x").hexdigest() + "-10000"


@pytest.mark.parametrize("etag", [SINGLE, MULTI, SINGLE + "-1"])
def test_packed_etags_round_trip(etag: str) -> None:
    assert unpack_md5_etag(pack_md5_etag(etag)) == etag


@pytest.mark.parametrize("etag", [None, SINGLE, MULTI])
def test_the_footer_records_it(etag: str | None) -> None:
    meta = ChunkMeta("b", "k", 3, 7, 1.5, md5_etag=etag, attrs=(("content-type", "x"),))
    footer = chunkfile.encode_footer(meta)
    n = chunkfile.footer_length(footer[-chunkfile.TAIL.size:])
    assert chunkfile.decode_meta(footer[:n], 3 + len(footer)) == meta


def test_a_damaged_footer_etag_is_refused() -> None:
    footer = chunkfile.encode_footer(ChunkMeta("b", "k", 3, 7, 1.5, md5_etag=SINGLE)).replace(
        SINGLE.encode(), b"not-an-md5".ljust(32, b"!"))
    n = chunkfile.footer_length(footer[-chunkfile.TAIL.size:])
    with pytest.raises(ChunkCorrupt):
        chunkfile.decode_meta(footer[:n], 3 + len(footer))


@pytest.mark.parametrize("etag", [None, SINGLE, MULTI])
def test_index_records_carry_it(etag: str | None) -> None:
    entry = IndexEntry("bucket", "key/é", 10, 99, 1.0, 2.0, 3.0, 4, 3, True, etag)
    assert IndexEntry.unpack(entry.pack()) == entry
    assert ChunkInfo.from_entry(entry).s3_etag == (f'"{etag}"' if etag else ChunkInfo.from_entry(entry).etag)


def test_records_written_before_etag_modes_still_read() -> None:
    old = RECORD.pack(10, 99, 1.0, 2.0, 3.0, 4, 1, 0x01, 1, 1) + b"bk"  # the layout without the flag
    assert IndexEntry.unpack(old) == IndexEntry("b", "k", 10, 99, 1.0, 2.0, 3.0, 4, 1, True, None)


@pytest.mark.parametrize("parent", [None, b"p" * 16])
@pytest.mark.parametrize("etag", [None, SINGLE, MULTI])
def test_feed_add_events_carry_it(parent: bytes | None, etag: str | None) -> None:
    info = ChunkInfo("b", "k" * 20, 10, 99, 1.0, 0.0, md5_etag=etag)
    change = to_change(Kind.STORED, "b", b"d" * 16, 1, 10, 0.0, 1.0, 1, add_detail(info, parent))
    assert change is not None and change.entry is not None
    assert (change.entry.key, change.entry.md5_etag, change.parent) == (info.key, etag, parent)


def test_multipart_etag_is_the_md5_of_the_part_md5s() -> None:
    bodies = [b"a" * 100, b"b" * 7]
    parts = [PartInfo(n, len(b), 0, 0.0, {}, hashlib.md5(b).hexdigest()) for n, b in enumerate(bodies, 1)]
    combined = hashlib.md5(b"".join(hashlib.md5(b).digest() for b in bodies)).hexdigest()
    assert multipart_md5_etag(parts) == f"{combined}-2"
    assert multipart_md5_etag([*parts, PartInfo(3, 1, 0, 0.0, {})]) is None  # a part without an MD5
