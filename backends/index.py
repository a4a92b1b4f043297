"""The hot index: an LMDB file on local disk mapping a chunk digest to what is known about the chunk.

It answers exists / prefix / HEAD without touching a tier. It is a cache of the tiers, never the
truth: a chunk missing here is looked up in the tiers (another gateway may have written it), and
``kvgw index rebuild`` recreates the whole index from them. That is why commits are not fsynced by
default (``sync=False``; the environment is flushed every ``sync_interval`` seconds): a process crash
loses nothing (the OS has the pages) and an OS crash loses only entries the tiers still hold.

Threads: every write transaction runs on one writer thread, which groups all queued operations into
one transaction (group commit) and also applies batched last-access updates. Reads run on the
caller's thread in short read-only transactions that never span an ``await``; they are microseconds,
cheaper than a hop to a thread. When the map is full the writer doubles it while holding the
``_remap`` lock, which every reader also takes, so no reader holds a pointer into the old mapping.

Databases inside the environment::

    chunks   digest(16)                 -> RECORD + bucket + key
    names    bucket NUL key (long keys: key[:424] NUL digest) -> digest   (ordered listing)
    parents  digest                     -> parent digest (prefix chains clients told us about)
    pending  digest                     -> queued at, attempts (write-through to S3 not yet done)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lmdb

from backends.errors import IndexError_

TIER_FS = 1
TIER_S3 = 2

# size, checksum, created, expires, last_access, hits, tiers, flags, bucket_len, key_len
RECORD = struct.Struct("<QQdddIBBHH")
_EXPIRES = struct.Struct("<d")
_PENDING = struct.Struct("<dI")  # queued at, attempts
_EXPIRES_AT = 24
_NAME_KEY_LIMIT = 424
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs"}
)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    bucket: str
    key: str
    size: int
    checksum: int
    created: float
    expires: float = 0.0  # 0: never
    last_access: float = 0.0
    hits: int = 0
    tiers: int = TIER_FS

    def alive(self, now: float) -> bool:
        return self.expires == 0.0 or self.expires > now

    def pack(self) -> bytes:
        b = self.bucket.encode()
        k = self.key.encode()
        head = RECORD.pack(
            self.size, self.checksum, self.created, self.expires, self.last_access,
            min(self.hits, 0xFFFFFFFF), self.tiers, 0, len(b), len(k),
        )
        return head + b + k

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> IndexEntry:
        size, checksum, created, expires, last, hits, tiers, _, blen, klen = RECORD.unpack_from(raw)
        at = RECORD.size
        bucket = bytes(raw[at : at + blen]).decode()
        key = bytes(raw[at + blen : at + blen + klen]).decode()
        return cls(bucket, key, size, checksum, created, expires, last, hits, tiers)


def name_key(bucket: str, key: str, digest: bytes) -> bytes:
    """Sort key of the ``names`` database: UTF-8 byte order, which is S3's listing order.

    LMDB keys are at most 511 bytes, so a key longer than ``_NAME_KEY_LIMIT`` bytes is stored as its
    first ``_NAME_KEY_LIMIT`` bytes, a NUL (no key contains one) and the digest. Keys sharing such a
    prefix are then contiguous and sorted just after the prefix itself; a lister re-sorts each of
    these groups by full key.
    """
    raw = key.encode()
    if len(raw) > _NAME_KEY_LIMIT:
        raw = raw[:_NAME_KEY_LIMIT] + b"\x00" + digest
    return bucket.encode() + b"\x00" + raw


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path``, from /proc/mounts (longest mount-point match)."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount_point = parts[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, fstype = mount_point, parts[2]
    except OSError:
        pass
    return fstype


class _Writer:
    """The one thread that runs LMDB write transactions, grouping queued operations per commit."""

    def __init__(self, index: ChunkIndex, sync_interval: float, touch_interval: float) -> None:
        self._index = index
        self._ops: list[tuple[Callable[[lmdb.Transaction], Any], concurrent.futures.Future[Any]]] = []
        self._cv = threading.Condition()
        self._closing = False
        self._sync_interval = sync_interval
        self._touch_interval = touch_interval
        self._thread = threading.Thread(target=self._run, name="kvgw-index-writer", daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[lmdb.Transaction], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._closing:
                raise IndexError_("index is closed")
            self._ops.append((op, future))
            self._cv.notify()
        return future

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        last_sync = last_touch = time.monotonic()
        while True:
            with self._cv:
                if not self._ops and not self._closing:
                    self._cv.wait(timeout=min(self._sync_interval, self._touch_interval))
                batch, self._ops = self._ops, []
                closing = self._closing
            now = time.monotonic()
            if closing or now - last_touch >= self._touch_interval:
                touch_op = self._index.take_touches()
                if touch_op is not None:
                    batch.append((touch_op, concurrent.futures.Future()))
                last_touch = now
            if batch:
                self._commit(batch)
            if closing or now - last_sync >= self._sync_interval:
                self._index.env.sync(True)
                last_sync = now
            if closing:
                return

    def _commit(self, batch: list[tuple[Callable[[lmdb.Transaction], Any], concurrent.futures.Future[Any]]]) -> None:
        while True:
            results: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
            try:
                with self._index.env.begin(write=True, db=self._index.chunks_db) as txn:
                    for op, future in batch:
                        try:
                            results.append((future, op(txn), None))
                        except lmdb.MapFullError:
                            raise
                        except Exception as exc:  # one bad op must not fail its neighbours
                            results.append((future, None, exc))
            except lmdb.MapFullError:
                self._index.grow()
                continue
            except lmdb.Error as exc:
                for _, future in batch:
                    future.set_exception(IndexError_(f"index write failed: {exc}"))
                return
            for future, value, error in results:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
            return


class ChunkIndex:
    """Digest → IndexEntry, in LMDB. Reads are synchronous and fast; writes are awaited futures."""

    def __init__(
        self,
        path: Path,
        *,
        map_size: int = 1 << 30,
        sync: bool = False,
        sync_interval: float = 1.0,
        touch_interval: float = 1.0,
        allow_network_fs: bool = False,
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        fstype = filesystem_type(path)
        if fstype in NETWORK_FILESYSTEMS and not allow_network_fs:
            raise IndexError_(
                f"the index directory {path} is on a network filesystem ({fstype}); LMDB needs local "
                "disk (its locks and mmap are not coherent over NFS). Put the index on local disk."
            )
        self.path = path
        self.env = lmdb.open(
            str(path), map_size=map_size, max_dbs=8, sync=sync, metasync=sync,
            readahead=False, max_readers=1024, lock=True,
        )
        self.env.reader_check()  # clear reader slots left by killed processes
        self.chunks_db = self.env.open_db(b"chunks")
        self.names_db = self.env.open_db(b"names")
        self.parents_db = self.env.open_db(b"parents")
        self.pending_db = self.env.open_db(b"pending")
        self._remap = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._writer = _Writer(self, sync_interval, touch_interval)

    # -- reads (caller's thread) ---------------------------------------------------------------

    def get(self, digest: bytes) -> IndexEntry | None:
        with self._remap, self.env.begin(db=self.chunks_db, buffers=True) as txn:
            raw = txn.get(digest)
            return None if raw is None else IndexEntry.unpack(raw)

    def get_many(self, digests: Sequence[bytes]) -> list[IndexEntry | None]:
        with self._remap, self.env.begin(db=self.chunks_db, buffers=True) as txn:
            out: list[IndexEntry | None] = []
            for digest in digests:
                raw = txn.get(digest)
                out.append(None if raw is None else IndexEntry.unpack(raw))
            return out

    def alive_many(self, digests: Sequence[bytes], now: float) -> list[bool]:
        """Which digests are indexed and not expired: the exists path, so no IndexEntry is built.

        One read transaction; the gets run from C (``map``) and of each record only the expiry
        (0.0: never) is decoded.
        """
        unpack = _EXPIRES.unpack_from
        with self._remap, self.env.begin(db=self.chunks_db) as txn:
            raws = list(map(txn.get, digests))
        return [raw is not None and ((expires := unpack(raw, _EXPIRES_AT)[0]) == 0.0 or expires > now)
                for raw in raws]

    def alive_prefix(self, digests: Sequence[bytes], now: float) -> int:
        """How many leading digests are indexed and not expired (the prefix path): stops at the
        first one that is not, so a long list with an early miss costs one read."""
        unpack = _EXPIRES.unpack_from
        count = 0
        with self._remap, self.env.begin(db=self.chunks_db) as txn:
            get = txn.get
            for digest in digests:
                raw = get(digest)
                if raw is None:
                    break
                expires = unpack(raw, _EXPIRES_AT)[0]
                if expires != 0.0 and expires <= now:
                    break
                count += 1
        return count

    def parent_of(self, digest: bytes) -> bytes | None:
        with self._remap, self.env.begin(db=self.parents_db) as txn:
            value = txn.get(digest)
            return None if value is None else bytes(value)

    def scan(self, after: bytes | None = None, limit: int = 1024) -> list[tuple[bytes, IndexEntry]]:
        """Up to ``limit`` entries in digest order, strictly after ``after``: iterate without long txns."""
        out: list[tuple[bytes, IndexEntry]] = []
        with self._remap, self.env.begin(db=self.chunks_db) as txn:
            cursor = txn.cursor()
            positioned = cursor.set_range(after) if after is not None else cursor.first()
            if not positioned:
                return out
            for digest, raw in cursor:
                if after is not None and digest == after:
                    continue
                out.append((bytes(digest), IndexEntry.unpack(raw)))
                if len(out) >= limit:
                    break
        return out

    def list_names(self, bucket: str, start: str = "", limit: int = 1000) -> list[IndexEntry]:
        """Up to ``limit`` entries of ``bucket`` with key >= ``start``, in UTF-8 byte order (S3's order).

        Long keys share a sort key per truncated prefix (see ``name_key``); such a group is read
        whole and re-sorted by full key, so the result is exactly ordered.
        """
        prefix = bucket.encode() + b"\x00"
        start_raw = start.encode()
        first = prefix + start_raw[:_NAME_KEY_LIMIT]
        out: list[IndexEntry] = []
        open_group: bytes | None = None
        with self._remap, self.env.begin(db=self.names_db) as txn:
            cursor = txn.cursor()
            records = txn.cursor(db=self.chunks_db)
            if not cursor.set_range(first):
                return out
            for name, digest in cursor:
                if not name.startswith(prefix):
                    break
                group = name[: len(prefix) + _NAME_KEY_LIMIT + 1] if len(name) > len(prefix) + _NAME_KEY_LIMIT else None
                if len(out) >= limit and (group is None or group != open_group):
                    break
                open_group = group
                if not records.set_key(digest):
                    continue
                entry = IndexEntry.unpack(records.value())
                if entry.key.encode() >= start_raw:
                    out.append(entry)
        out.sort(key=lambda e: e.key.encode())
        return out[:limit]

    def scan_parents(self) -> list[tuple[bytes, bytes]]:
        """Every recorded (child, parent) link, for rebuilding prefix-aware eviction state."""
        with self._remap, self.env.begin(db=self.parents_db) as txn:
            return [(bytes(child), bytes(parent)) for child, parent in txn.cursor()]

    def count(self) -> int:
        with self._remap, self.env.begin(db=self.chunks_db) as txn:
            return int(txn.stat(self.chunks_db)["entries"])

    # -- writes (the writer thread) ------------------------------------------------------------

    async def put(
        self, digest: bytes, entry: IndexEntry, parent: bytes | None = None, *, replicate: bool = False
    ) -> None:
        """Index a chunk; with ``replicate`` also queue it for write-through, in the same transaction."""

        def op(txn: lmdb.Transaction) -> None:
            if replicate:
                txn.put(digest, _PENDING.pack(time.time(), 0), db=self.pending_db)
            old = txn.get(digest, db=self.chunks_db)
            if old is not None:
                previous = IndexEntry.unpack(old)
                # keep access history across re-indexing (fall-through, rebuild, tier changes)
                merged = replace(entry, last_access=max(previous.last_access, entry.last_access),
                                 hits=max(previous.hits, entry.hits))
                txn.put(digest, merged.pack(), db=self.chunks_db)
            else:
                txn.put(digest, entry.pack(), db=self.chunks_db)
            txn.put(name_key(entry.bucket, entry.key, digest), digest, db=self.names_db)
            if parent is not None:
                txn.put(digest, parent, db=self.parents_db)

        await self._submit(op)

    async def put_many(self, items: Iterable[tuple[bytes, IndexEntry]]) -> None:
        batch = list(items)

        def op(txn: lmdb.Transaction) -> None:
            for digest, entry in batch:
                txn.put(digest, entry.pack(), db=self.chunks_db)
                txn.put(name_key(entry.bucket, entry.key, digest), digest, db=self.names_db)

        await self._submit(op)

    async def update_tiers(self, digest: bytes, *, add: int = 0, remove: int = 0,
                           done_pending: bool = False) -> IndexEntry | None:
        """Set / clear tier bits of an entry (a copy appeared or left a tier); None if not indexed.

        An entry whose last tier bit is cleared is deleted. ``done_pending`` also drops the chunk
        from the write-through queue, in the same transaction as the bit that records the copy.
        """

        def op(txn: lmdb.Transaction) -> IndexEntry | None:
            if done_pending:
                txn.delete(digest, db=self.pending_db)
            raw = txn.get(digest, db=self.chunks_db)
            if raw is None:
                return None
            entry = IndexEntry.unpack(raw)
            updated = replace(entry, tiers=(entry.tiers | add) & ~remove)
            if updated.tiers == 0:
                self._delete_in(txn, digest, entry)
            else:
                txn.put(digest, updated.pack(), db=self.chunks_db)
            return updated

        result: IndexEntry | None = await self._submit(op)
        return result

    def pending(self, limit: int = 256, after: bytes | None = None) -> list[tuple[bytes, float, int]]:
        """Chunks waiting for write-through: (digest, queued at, attempts), in digest order."""
        out: list[tuple[bytes, float, int]] = []
        with self._remap, self.env.begin(db=self.pending_db) as txn:
            cursor = txn.cursor()
            if not (cursor.set_range(after) if after is not None else cursor.first()):
                return out
            for digest, raw in cursor:
                if after is not None and digest == after:
                    continue
                queued, attempts = _PENDING.unpack(raw)
                out.append((bytes(digest), queued, attempts))
                if len(out) >= limit:
                    break
        return out

    def pending_count(self) -> int:
        with self._remap, self.env.begin(db=self.pending_db) as txn:
            return int(txn.stat(self.pending_db)["entries"])

    async def retry_pending(self, digest: bytes) -> None:
        def op(txn: lmdb.Transaction) -> None:
            raw = txn.get(digest, db=self.pending_db)
            if raw is not None:
                queued, attempts = _PENDING.unpack(raw)
                txn.put(digest, _PENDING.pack(queued, attempts + 1), db=self.pending_db)

        await self._submit(op)

    async def drop_pending(self, digest: bytes) -> None:
        await self._submit(lambda txn: txn.delete(digest, db=self.pending_db))

    def _delete_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> None:
        txn.delete(digest, db=self.chunks_db)
        txn.delete(name_key(entry.bucket, entry.key, digest), db=self.names_db)
        txn.delete(digest, db=self.parents_db)
        txn.delete(digest, db=self.pending_db)

    async def delete(self, digest: bytes) -> IndexEntry | None:
        def op(txn: lmdb.Transaction) -> IndexEntry | None:
            raw = txn.get(digest, db=self.chunks_db)
            if raw is None:
                return None
            entry = IndexEntry.unpack(raw)
            self._delete_in(txn, digest, entry)
            return entry

        result: IndexEntry | None = await self._submit(op)
        return result

    async def clear(self) -> None:
        def op(txn: lmdb.Transaction) -> None:
            for db in (self.chunks_db, self.names_db, self.parents_db, self.pending_db):
                txn.drop(db, delete=False)

        await self._submit(op)

    def touch(self, digest: bytes, now: float) -> None:
        """Record a read; applied in the writer's next batch, not one transaction per read."""
        with self._touch_lock:
            _, hits = self._touches.get(digest, (0.0, 0))
            self._touches[digest] = (now, hits + 1)

    def take_touches(self) -> Callable[[lmdb.Transaction], None] | None:
        with self._touch_lock:
            touches, self._touches = self._touches, {}
        if not touches:
            return None

        def op(txn: lmdb.Transaction) -> None:
            for digest, (when, hits) in touches.items():
                raw = txn.get(digest, db=self.chunks_db)
                if raw is None:
                    continue
                entry = IndexEntry.unpack(raw)
                updated = replace(entry, last_access=max(entry.last_access, when), hits=entry.hits + hits)
                txn.put(digest, updated.pack(), db=self.chunks_db)

        return op

    async def flush(self) -> None:
        """Apply pending last-access updates now (tests, shutdown)."""
        op = self.take_touches()
        if op is not None:
            await self._submit(op)

    async def _submit(self, op: Callable[[lmdb.Transaction], Any]) -> Any:
        return await asyncio.wrap_future(self._writer.submit(op))

    def submit_sync(self, op: Callable[[lmdb.Transaction], Any]) -> Any:
        """Run a write operation from a non-async caller (CLI tools) and wait for it."""
        return self._writer.submit(op).result()

    def grow(self) -> None:
        """Double the map (writer thread only), excluding readers while LMDB remaps."""
        with self._remap:
            size = self.env.info()["map_size"]
            self.env.set_mapsize(size * 2)

    def close(self) -> None:
        self._writer.close()
        self.env.close()
