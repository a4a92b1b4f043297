"""Index snapshots in the shared directory: a gateway that joins, or lost its index, starts from one
instead of reading every chunk's footer.

The lifecycle leader writes ``<fs root>/.kvgw/index-snapshot`` every ``cluster_snapshot_seconds``:
its index's entries (each with its prefix parent) and the feed position the index had reached when the
snapshot began. A new index seeds itself from the snapshot (``seed_index``) and then replays the feed
from that position, exactly as after a restart, so it is current once it has caught up.

Why a fuzzy snapshot is enough: the position is read before the entries, and the entries are read in
short transactions while the index keeps changing, so the snapshot holds at least every change up to
the position and some after it. Replaying the feed from the position re-applies those: applying a
stored, removed or moved event is idempotent (an upsert or a removal of a tier bit), so replay converges
on the state at the feed head, as a redo log does over a fuzzy checkpoint. A snapshot older than the
feed's retention is refused by the feed itself (events trimmed: the subscriber resyncs from the tiers).

The snapshot lives in the shared filesystem tier, so a gateway that can read it shares that directory
with its writer and its entries describe the same files. A gateway with a directory of its own never
sees another's snapshot. What a snapshot does not carry: the write-through queue and evicted-chunk
ghosts (the leader's own work), and usage counts (recomputed from the entries as they are indexed).

File format (all integers little-endian), written to a temporary name, fsynced, then renamed::

    magic "KVGWSNAP" | version:u16 (=1) | header length:u32 | header JSON {feed_id, seq, written_at, member}
    record* := digest:16 | parent flag:u8 | parent:16 (zeros if none) | entry length:u32 | packed entry
    trailer := "KVGWEND!" | records:u64 | xxh3-64 of every byte before the trailer:u64
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

from backends.fileio import fsync_dir
from backends.index import ChunkIndex, IndexEntry

log = logging.getLogger("kvgw.cluster")

SNAPSHOT_NAME = ".kvgw/index-snapshot"
_MAGIC = b"KVGWSNAP"
_END = b"KVGWEND!"
_VERSION = 1
_HEAD = struct.Struct("<8sHI")
_RECORD = struct.Struct("<16sB16sI")
_TRAILER = struct.Struct("<8sQQ")
_BATCH = 4096
_NO_PARENT = bytes(16)


class SnapshotError(Exception):
    """The snapshot is unreadable, truncated, corrupt or of another version (seed from the tiers)."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    feed_id: str
    seq: int  # the feed position the snapshot holds every change up to
    written_at: float
    member: str
    records: int = 0


def snapshot_path(fs_root: Path) -> Path:
    return fs_root / SNAPSHOT_NAME


def write_snapshot(index: ChunkIndex, fs_root: Path, *, member: str, clock: float | None = None) -> SnapshotInfo | None:
    """Write this index as the shared snapshot (blocking: a worker thread). None if the index follows no
    feed yet (nothing to seed from). Atomic: readers see the previous snapshot or this one, whole."""
    position = index.feed_position()  # first: the entries read below hold at least this much
    if position is None:
        return None
    info = SnapshotInfo(position[0], position[1], time.time() if clock is None else clock, member)
    final = snapshot_path(fs_root)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f"{final.name}.tmp.{os.getpid()}")
    hasher = xxhash.xxh3_64()
    records = 0
    try:
        with open(temporary, "wb") as out:
            def put(data: bytes) -> None:
                hasher.update(data)
                out.write(data)

            header = json.dumps({"feed_id": info.feed_id, "seq": info.seq, "written_at": info.written_at,
                                 "member": info.member}).encode()
            put(_HEAD.pack(_MAGIC, _VERSION, len(header)) + header)
            after: bytes | None = None
            while batch := index.scan(after, _BATCH):
                parents = index.parents_of([digest for digest, _ in batch])
                for (digest, entry), parent in zip(batch, parents, strict=True):
                    packed = entry.pack()
                    put(_RECORD.pack(digest, parent is not None, parent or _NO_PARENT, len(packed)) + packed)
                records += len(batch)
                after = batch[-1][0]
            out.write(_TRAILER.pack(_END, records, hasher.intdigest()))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
        fsync_dir(str(final.parent))
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return SnapshotInfo(info.feed_id, info.seq, info.written_at, info.member, records)


def read_info(fs_root: Path) -> SnapshotInfo | None:
    """The snapshot's header, or None when there is none (it is not checked here: ``seed_index`` does)."""
    try:
        with open(snapshot_path(fs_root), "rb") as f:
            return _read_header(f)
    except FileNotFoundError:
        return None


def seed_index(index: ChunkIndex, fs_root: Path, feed_id: str) -> SnapshotInfo | None:
    """Fill a new index from the snapshot of ``feed_id`` and set its feed position (blocking). None when
    there is no snapshot of that feed. Raises SnapshotError for a damaged one (checked whole first, so
    nothing of it is indexed)."""
    try:
        with open(snapshot_path(fs_root), "rb") as f:
            info = _read_header(f)
            if info.feed_id != feed_id:
                log.info("cluster: the shared index snapshot belongs to another feed (%s); not used", info.feed_id)
                return None
            records = _verify(f)
            f.seek(0)
            _read_header(f)
            batch: list[tuple[bytes, IndexEntry]] = []
            parents: list[bytes | None] = []
            for digest, entry, parent in _records(f, records):
                batch.append((digest, entry))
                parents.append(parent)
                if len(batch) >= _BATCH:
                    index.submit_sync(index.put_many_op(batch, parents))
                    batch, parents = [], []
            if batch:
                index.submit_sync(index.put_many_op(batch, parents))
    except FileNotFoundError:
        return None
    index.submit_sync(index.feed_position_op(info.feed_id, info.seq))
    return SnapshotInfo(info.feed_id, info.seq, info.written_at, info.member, records)


def _read_header(f: BinaryIO) -> SnapshotInfo:
    raw = f.read(_HEAD.size)
    if len(raw) < _HEAD.size:
        raise SnapshotError("truncated header")
    magic, version, length = _HEAD.unpack(raw)
    if magic != _MAGIC or version != _VERSION:
        raise SnapshotError(f"not a version-{_VERSION} index snapshot")
    try:
        doc = json.loads(f.read(length))
        return SnapshotInfo(str(doc["feed_id"]), int(doc["seq"]), float(doc["written_at"]), str(doc["member"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"bad header: {exc}") from None


def _verify(f: BinaryIO) -> int:
    """Check the trailer's checksum over the whole file; returns the record count."""
    size = os.fstat(f.fileno()).st_size
    if size < _TRAILER.size:
        raise SnapshotError("truncated")
    f.seek(0)
    hasher = xxhash.xxh3_64()
    remaining = size - _TRAILER.size
    while remaining:
        block = f.read(min(remaining, 1 << 20))
        if not block:
            raise SnapshotError("truncated")
        hasher.update(block)
        remaining -= len(block)
    end, records, checksum = _TRAILER.unpack(f.read(_TRAILER.size))
    if end != _END or checksum != hasher.intdigest():
        raise SnapshotError("checksum mismatch (damaged or cut short)")
    return int(records)


def _records(f: BinaryIO, count: int) -> Iterator[tuple[bytes, IndexEntry, bytes | None]]:
    for _ in range(count):
        digest, has_parent, parent, length = _RECORD.unpack(f.read(_RECORD.size))
        yield digest, IndexEntry.unpack(f.read(length)), parent if has_parent else None

