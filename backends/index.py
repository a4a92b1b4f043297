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

    chunks   digest(16)                 -> RECORD + bucket + key [+ MD5 ETag: flag 0x02, 18 bytes]
    names    bucket NUL key (long keys: key[:424] NUL digest) -> digest   (ordered listing)
    parents  digest                     -> parent digest (prefix chains clients told us about)
    pending  digest                     -> queued at, attempts (write-through to S3 not yet done)
    meta     name                       -> value (b"feed": the cluster feed's id and the last event
                                           applied, written in the transaction that applies events;
                                           b"identity": a random token naming this index;
                                           b"layout": the version of the derived databases below)

Derived databases, kept by every write transaction that changes an entry, so the lifecycle needs no
per-chunk memory (``gateway.lifecycle``: eviction samples the index, TTL walks ``expiry``)::

    kids     parent digest -> child digest (duplicates sorted): ``parents`` reversed; a chunk is a
                              leaf of its chain in a tier when no child holds a copy there
    expiry   expires (big-endian double) digest -> ""   (chunks with a TTL, soonest first)
    usage    bucket NUL tier byte -> bytes, chunks      (what this index holds per bucket and tier)
    ghosts   digest -> last access, size, hits, tier, bucket   (chunks the lifecycle evicted lately;
                              a chunk stored again while remembered is marked ``returned``)

An index written before these existed is brought up to date once when opened (``_upgrade_layout``).
Reads and evictions also leave ``Observation`` records in ``observations`` (a bounded deque the
lifecycle engine drains): what a chunk looked like just before it was read, came back, or was
forgotten, which the ``default`` policy learns its hit densities from.

Changes other gateways made arrive through the cluster feed (``gateway.cluster.feed``) as
``IndexChange`` records, applied by ``apply_changes`` in one transaction together with the new feed
position, so a crash never applies an event twice or skips one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from backends.base import MD5_ETAG_BYTES, pack_md5_etag, unpack_md5_etag
from backends.errors import IndexError_
from backends.fileio import NETWORK_FILESYSTEMS as NETWORK_FILESYSTEMS
from backends.fileio import filesystem_type as filesystem_type  # re-exported: looked up here (tests patch it)
from backends.tiers import TierId

# size, checksum, created, expires, last_access, hits, tiers, flags, bucket_len, key_len
RECORD = struct.Struct("<QQdddIBBHH")
_EXPIRES = struct.Struct("<d")
_SIZE = struct.Struct("<Q")  # RECORD's first field
_SIZE_EXPIRES = struct.Struct("<Q16xd")  # RECORD's size and expires (at _EXPIRES_AT)
_PENDING = struct.Struct("<dI")  # queued at, attempts
_EXPIRES_AT = 24
_FEED_POSITION = struct.Struct("<Q")
_FEED_KEY = b"feed"
_IDENTITY_KEY = b"identity"
_LAYOUT_KEY = b"layout"
_LAYOUT = b"3"  # kids, expiry, usage and ghosts exist and agree with chunks and parents; ghosts keep marks
_EXPIRY = struct.Struct(">d")  # big-endian: byte order is numeric order for the positive expiry times
_USAGE = struct.Struct("<qq")  # bytes, chunks
_GHOST = struct.Struct("<dQIBB")  # last access, size, hits, tier, marks; then the bucket
_TIERS_AT = 44  # offset of the tiers byte in RECORD
_RETURNED = 0x01  # RECORD flags: stored again while the index remembered its eviction (a ghost)
_MD5 = 0x02  # RECORD flags: an MD5 ETag (``backends.base.pack_md5_etag``) follows the key
# RECORD flags set by engine hints (``gateway.hints``); ``IndexEntry.marks`` holds them
MARK_PINNED = 0x04  # never evicted or demoted while set
MARK_ENDED = 0x08  # the request that read or wrote it ended (cleared by the next read)
MARK_SESSION_ENDED = 0x10  # its session ended: no further turn will read it (cleared by the next read)
MARK_SHARED = 0x20  # retention class "shared" (a system prompt many requests share)
MARK_ONE_OFF = 0x40  # retention class "one-off" (a document read once)
MARKS = MARK_PINNED | MARK_ENDED | MARK_SESSION_ENDED | MARK_SHARED | MARK_ONE_OFF
MARKS_CLEARED_BY_READ = MARK_ENDED | MARK_SESSION_ENDED
_KIDS_CHECKED = 16  # children looked at to decide whether a chunk is a leaf (more: assumed not)
_NAME_KEY_LIMIT = 424
OBSERVATIONS_KEPT = 8192


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
    tiers: int = TierId.FS  # bit mask of TierId values: the tiers holding a copy
    returned: bool = False  # stored again after the lifecycle evicted it (while the index remembered that)
    md5_etag: str | None = None  # the S3 ETag of a chunk written to an MD5-mode bucket (ChunkMeta.md5_etag)
    marks: int = 0  # MARK_* bits engine hints set (``gateway.hints``)

    def alive(self, now: float) -> bool:
        return self.expires == 0.0 or self.expires > now

    def pack(self) -> bytes:
        b = self.bucket.encode()
        k = self.key.encode()
        flags = (_RETURNED if self.returned else 0) | (_MD5 if self.md5_etag is not None else 0)
        head = RECORD.pack(
            self.size, self.checksum, self.created, self.expires, self.last_access,
            min(self.hits, 0xFFFFFFFF), self.tiers, flags | (self.marks & MARKS), len(b), len(k),
        )
        if self.md5_etag is None:
            return head + b + k
        return head + b + k + pack_md5_etag(self.md5_etag)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> IndexEntry:
        size, checksum, created, expires, last, hits, tiers, flags, blen, klen = RECORD.unpack_from(raw)
        at = RECORD.size
        bucket = bytes(raw[at : at + blen]).decode()
        key = bytes(raw[at + blen : at + blen + klen]).decode()
        md5 = None
        if flags & _MD5 and len(raw) >= at + blen + klen + MD5_ETAG_BYTES:
            md5 = unpack_md5_etag(raw, at + blen + klen)
        return cls(bucket, key, size, checksum, created, expires, last, hits, tiers, bool(flags & _RETURNED), md5,
                   flags & MARKS)


class Observation(NamedTuple):
    """A chunk just before something the eviction policy learns from happened to it.

    ``READ``: it was read ``reads`` times, the last at ``at`` (``tiers``: the tiers holding it).
    ``RETURNED``: it was stored again at ``at`` while the index remembered evicting it from ``tiers``.
    ``FORGOTTEN``: the index stopped remembering its eviction from ``tiers`` (no return seen).
    ``last_access`` and ``hits`` are the chunk's before the event (for ghosts: when it was evicted);
    ``hits`` counts one more for a chunk that returned (its class for the eviction policy: read before).
    ``marks``: the chunk's hint marks (``MARK_*``) before the event (for ghosts: when it was evicted).
    """

    kind: int
    bucket: str
    tiers: int
    size: int
    last_access: float
    hits: int
    at: float
    reads: int = 1
    marks: int = 0


OBS_READ = 1
OBS_RETURNED = 2
OBS_FORGOTTEN = 3


class Ghost(NamedTuple):
    """A chunk the lifecycle evicted from ``tier`` (what the ``ghosts`` database remembers), with the hint
    marks it had (so its return or its being forgotten teaches the policy class it was evicted from)."""

    bucket: str
    tier: int
    size: int
    last_access: float
    hits: int
    marks: int = 0

    def pack(self) -> bytes:
        return _GHOST.pack(self.last_access, self.size, min(self.hits, 0xFFFFFFFF), self.tier,
                           self.marks & MARKS) + self.bucket.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Ghost:
        last, size, hits, tier, marks = _GHOST.unpack_from(raw)
        return cls(bytes(raw[_GHOST.size :]).decode(), tier, size, last, hits, marks)


def _usage_key(bucket: str, tier: int) -> bytes:
    return bucket.encode() + b"\x00" + bytes((tier,))


def _expiry_key(expires: float, digest: bytes) -> bytes:
    return _EXPIRY.pack(expires) + digest


log = logging.getLogger("kvgw.index")


class ChangeOp:
    """What an ``IndexChange`` does (plain ints: they travel in the cluster feed)."""

    ADD = 1  # a copy of the chunk is now in ``tier``
    REMOVE = 2  # the copy in ``tier`` is gone
    READ = 3  # the chunk was read ``count`` times, last at ``at``
    LINK = 4  # ``parent`` precedes the chunk in its prefix chain (a client looked them up in that order)
    MARK = 5  # engine hints: marks ``count & 0xFF`` set and ``count >> 8`` cleared (``MARK_*``)


@dataclass(frozen=True, slots=True)
class IndexChange:
    """One change another gateway made to a tier, as ``apply_changes`` applies it.

    ``entry`` (ADD) is the chunk as its writer described it (``tiers`` is ignored: the change is about
    ``tier``). For REMOVE, ``entry`` names the incarnation that went when the remover knew it: a
    local entry of another incarnation (the key was written again since) is then left alone.
    """

    op: int
    digest: bytes
    tier: int
    entry: IndexEntry | None = None
    parent: bytes | None = None
    count: int = 1
    at: float = 0.0


def _same_incarnation(a: IndexEntry, b: IndexEntry) -> bool:
    return (a.size, a.checksum, a.created) == (b.size, b.checksum, b.created)


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


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("index: background write failed: %s", future.exception())


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
        # An operation whose caller was cancelled before it ran is skipped; the others can no longer be
        # cancelled (so setting their result below never raises in this thread, which would kill it).
        batch = [(op, future) for op, future in batch if future.set_running_or_notify_cancel()]
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
            except lmdb.MapResizedError:
                self._index.adopt_map_size()  # another process (worker) grew the map
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


def nothing_expired(txn: lmdb.Transaction, expiry_db: Any, now: float) -> bool:
    """Whether no chunk in ``txn``'s view has expired at ``now``: the soonest expiry (the first key of
    ``expiry_db``, kept in step with the records in the same transactions) lies ahead, or none expires."""
    soonest = txn.cursor(db=expiry_db)
    return not soonest.first() or _EXPIRY.unpack_from(soonest.key())[0] > now


def alive_in(txn: lmdb.Transaction, digests: Sequence[bytes], now: float, expiry_db: Any) -> list[bool]:
    """Which digests ``txn``'s chunks database holds and not expired, with no IndexEntry built: the
    gets run from C (``map``). ``expiry_db`` (the index's expiry order, written in the same
    transactions as the records) gives the soonest expiry: while it lies ahead, no record can have
    expired and none is decoded; otherwise each record's expiry (0.0: never) is. Also what
    ``kvgw bench floor``'s indexed responder runs, the floor of an LMDB-indexed lookup."""
    raws = list(map(txn.get, digests))
    if nothing_expired(txn, expiry_db, now):
        return [raw is not None for raw in raws]
    unpack = _EXPIRES.unpack_from
    return [raw is not None and ((expires := unpack(raw, _EXPIRES_AT)[0]) == 0.0 or expires > now)
            for raw in raws]


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
            str(path), map_size=map_size, max_dbs=16, sync=sync, metasync=sync,
            readahead=False, max_readers=1024, lock=True,
        )
        self.env.reader_check()  # clear reader slots left by killed processes
        self.chunks_db = self.env.open_db(b"chunks")
        self.names_db = self.env.open_db(b"names")
        self.parents_db = self.env.open_db(b"parents")
        self.pending_db = self.env.open_db(b"pending")
        self.meta_db = self.env.open_db(b"meta")
        self.kids_db = self.env.open_db(b"kids", dupsort=True)
        self.expiry_db = self.env.open_db(b"expiry")
        self.usage_db = self.env.open_db(b"usage")
        self.ghosts_db = self.env.open_db(b"ghosts")
        self._remap = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touches: dict[bytes, tuple[float, int]] = {}
        self.observations: deque[Observation] = deque(maxlen=OBSERVATIONS_KEPT)
        self._upgrade_layout()
        self._writer = _Writer(self, sync_interval, touch_interval)

    def _upgrade_layout(self) -> None:
        """Build the derived databases of an index written before them (once; blocking, at open)."""
        with self.env.begin(write=True) as txn:
            layout = txn.get(_LAYOUT_KEY, db=self.meta_db)
            if layout == _LAYOUT:
                return
            if layout == b"2":  # ghosts without marks: forget them (they are hints), keep everything else
                txn.drop(self.ghosts_db, delete=False)
                txn.put(_LAYOUT_KEY, _LAYOUT, db=self.meta_db)
                return
            started = time.monotonic()
            for db in (self.kids_db, self.expiry_db, self.usage_db, self.ghosts_db):
                txn.drop(db, delete=False)
            totals: dict[tuple[str, int], list[int]] = {}
            count = 0
            for digest, raw in txn.cursor(db=self.chunks_db):
                entry = IndexEntry.unpack(raw)
                count += 1
                if entry.expires:
                    txn.put(_expiry_key(entry.expires, digest), b"", db=self.expiry_db)
                for bit in TierId:
                    if entry.tiers & bit:
                        slot = totals.setdefault((entry.bucket, int(bit)), [0, 0])
                        slot[0] += entry.size
                        slot[1] += 1
            for (bucket, tier), (size, chunks) in totals.items():
                txn.put(_usage_key(bucket, tier), _USAGE.pack(size, chunks), db=self.usage_db)
            for child, parent in txn.cursor(db=self.parents_db):
                txn.put(parent, child, db=self.kids_db)
            txn.put(_LAYOUT_KEY, _LAYOUT, db=self.meta_db)
        if count:
            log.info("index %s: derived databases built for %d chunks in %.1f s", self.path, count,
                     time.monotonic() - started)

    # -- reads (caller's thread) ---------------------------------------------------------------

    def get(self, digest: bytes) -> IndexEntry | None:
        with self._remap, self._begin(db=self.chunks_db, buffers=True) as txn:
            raw = txn.get(digest)
            return None if raw is None else IndexEntry.unpack(raw)

    def get_many(self, digests: Sequence[bytes]) -> list[IndexEntry | None]:
        with self._remap, self._begin(db=self.chunks_db, buffers=True) as txn:
            out: list[IndexEntry | None] = []
            for digest in digests:
                raw = txn.get(digest)
                out.append(None if raw is None else IndexEntry.unpack(raw))
            return out

    def alive_many(self, digests: Sequence[bytes], now: float) -> list[bool]:
        """Which digests are indexed and not expired: the exists path (``alive_in``), in one read
        transaction."""
        with self._remap, self._begin(db=self.chunks_db) as txn:
            return alive_in(txn, digests, now, self.expiry_db)

    def sizes_many(self, digests: Sequence[bytes]) -> list[int]:
        """Each chunk's size (0 if not indexed), with no IndexEntry built: what a read lease records."""
        unpack = _SIZE.unpack_from
        with self._remap, self._begin(db=self.chunks_db) as txn:
            return [0 if raw is None else unpack(raw)[0] for raw in map(txn.get, digests)]

    def live_sizes(self, digests: Sequence[bytes], now: float) -> list[int]:
        """Each chunk's size if indexed and not expired, else -1: a leased lookup's one pass (what
        ``alive_many`` answers, and the bytes its lease records), in one read transaction."""
        unpack = _SIZE_EXPIRES.unpack_from
        with self._remap, self._begin(db=self.chunks_db) as txn:
            out = []
            for raw in map(txn.get, digests):
                if raw is None:
                    out.append(-1)
                    continue
                size, expires = unpack(raw)
                out.append(size if expires == 0.0 or expires > now else -1)
            return out

    def alive_prefix(self, digests: Sequence[bytes], now: float) -> int:
        """How many leading digests are indexed and not expired (the prefix path): stops at the
        first one that is not, so a long list with an early miss costs one read."""
        unpack = _EXPIRES.unpack_from
        count = 0
        with self._remap, self._begin(db=self.chunks_db) as txn:
            get = txn.get
            if nothing_expired(txn, self.expiry_db, now):
                for raw in map(get, digests):
                    if raw is None:
                        break
                    count += 1
                return count
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
        with self._remap, self._begin(db=self.parents_db) as txn:
            value = txn.get(digest)
            return None if value is None else bytes(value)

    def scan(self, after: bytes | None = None, limit: int = 1024) -> list[tuple[bytes, IndexEntry]]:
        """Up to ``limit`` entries in digest order, strictly after ``after``: iterate without long txns."""
        out: list[tuple[bytes, IndexEntry]] = []
        with self._remap, self._begin(db=self.chunks_db) as txn:
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
        with self._remap, self._begin(db=self.names_db) as txn:
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

    def parents_of(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """The recorded parent of each digest (None: none), in one read transaction."""
        with self._remap, self._begin(db=self.parents_db) as txn:
            return [None if (raw := txn.get(d)) is None else bytes(raw) for d in digests]

    def scan_parents(self) -> list[tuple[bytes, bytes]]:
        """Every recorded (child, parent) link, for rebuilding prefix-aware eviction state."""
        with self._remap, self._begin(db=self.parents_db) as txn:
            return [(bytes(child), bytes(parent)) for child, parent in txn.cursor()]

    def count(self) -> int:
        with self._remap, self._begin(db=self.chunks_db) as txn:
            return int(txn.stat(self.chunks_db)["entries"])

    # -- writes (the writer thread) ------------------------------------------------------------

    async def put(
        self, digest: bytes, entry: IndexEntry, parent: bytes | None = None, *, replicate: bool = False
    ) -> None:
        """Index a chunk; with ``replicate`` also queue it for write-through, in the same transaction."""

        def op(txn: lmdb.Transaction) -> None:
            if replicate:
                txn.put(digest, _PENDING.pack(time.time(), 0), db=self.pending_db)
            raw = txn.get(digest, db=self.chunks_db)
            if raw is not None:
                previous = IndexEntry.unpack(raw)
                # keep access history across re-indexing (fall-through, rebuild, tier changes)
                merged = replace(entry, last_access=max(previous.last_access, entry.last_access),
                                 hits=max(previous.hits, entry.hits), returned=previous.returned or entry.returned,
                                 marks=previous.marks | entry.marks)
                self._write_in(txn, digest, merged, previous, parent)
            else:
                self._write_in(txn, digest, entry, None, parent)

        await self._submit(op)

    async def put_many(self, items: Iterable[tuple[bytes, IndexEntry]],
                       parents: Sequence[bytes | None] | None = None) -> None:
        """Index many chunks in one transaction (``parents``: the parent of each, in the same order)."""
        await self._submit(self.put_many_op(items, parents))

    def put_many_op(self, items: Iterable[tuple[bytes, IndexEntry]],
                    parents: Sequence[bytes | None] | None = None) -> Callable[[lmdb.Transaction], None]:
        """``put_many`` as a writer operation, for ``submit_sync`` from a worker thread."""
        batch = list(items)
        links = list(parents) if parents is not None else [None] * len(batch)

        def op(txn: lmdb.Transaction) -> None:
            for (digest, entry), parent in zip(batch, links, strict=True):
                raw = txn.get(digest, db=self.chunks_db)
                self._write_in(txn, digest, entry, None if raw is None else IndexEntry.unpack(raw), parent)

        return op

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
            tiers = (entry.tiers | add) & ~remove
            self._set_tiers_in(txn, digest, entry, tiers)
            return replace(entry, tiers=tiers)

        result: IndexEntry | None = await self._submit(op)
        return result

    def pending(self, limit: int = 256, after: bytes | None = None) -> list[tuple[bytes, float, int]]:
        """Chunks waiting for write-through: (digest, queued at, attempts), in digest order."""
        out: list[tuple[bytes, float, int]] = []
        with self._remap, self._begin(db=self.pending_db) as txn:
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
        with self._remap, self._begin(db=self.pending_db) as txn:
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

    # -- the one place each kind of entry change is made (derived databases kept in step) ------

    def _write_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry, old: IndexEntry | None,
                  parent: bytes | None) -> IndexEntry:
        """Write ``entry`` over ``old`` (None: not indexed). A new entry for a chunk the lifecycle
        evicted lately (a ghost) is marked ``returned``. Returns what was written."""
        if old is None:
            raw = txn.get(digest, db=self.ghosts_db)
            if raw is not None:
                txn.delete(digest, db=self.ghosts_db)
                ghost = Ghost.unpack(raw)
                entry = replace(entry, returned=True)
                self.observations.append(Observation(OBS_RETURNED, ghost.bucket, ghost.tier, ghost.size,
                                                     ghost.last_access, ghost.hits, entry.created, 1, ghost.marks))
        else:
            self._count_usage(txn, old, -1)
            if old.expires and old.expires != entry.expires:
                txn.delete(_expiry_key(old.expires, digest), db=self.expiry_db)
            if (old.bucket, old.key) != (entry.bucket, entry.key):
                txn.delete(name_key(old.bucket, old.key, digest), db=self.names_db)
        txn.put(digest, entry.pack(), db=self.chunks_db)
        self._count_usage(txn, entry, 1)
        if entry.expires:
            txn.put(_expiry_key(entry.expires, digest), b"", db=self.expiry_db)
        txn.put(name_key(entry.bucket, entry.key, digest), digest, db=self.names_db)
        if parent is not None:
            self._link_in(txn, digest, parent)
        return entry

    def _set_tiers_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry, tiers: int) -> None:
        """Record that the chunk's copies are now in ``tiers``; with none left the entry goes."""
        if tiers == entry.tiers:
            return
        if tiers == 0:
            self._delete_in(txn, digest, entry)
            return
        self._count_usage(txn, entry, -1)
        updated = replace(entry, tiers=tiers)
        txn.put(digest, updated.pack(), db=self.chunks_db)
        self._count_usage(txn, updated, 1)

    def _delete_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry) -> None:
        txn.delete(digest, db=self.chunks_db)
        txn.delete(name_key(entry.bucket, entry.key, digest), db=self.names_db)
        parent = txn.get(digest, db=self.parents_db)
        if parent is not None:
            txn.delete(parent, digest, db=self.kids_db)
            txn.delete(digest, db=self.parents_db)
        txn.delete(digest, db=self.pending_db)
        if entry.expires:
            txn.delete(_expiry_key(entry.expires, digest), db=self.expiry_db)
        self._count_usage(txn, entry, -1)

    def _link_in(self, txn: lmdb.Transaction, child: bytes, parent: bytes) -> None:
        """``parent`` precedes ``child`` in its prefix chain (a later link replaces an earlier one)."""
        old = txn.get(child, db=self.parents_db)
        if old == parent or child == parent:
            return
        if old is not None:
            txn.delete(old, child, db=self.kids_db)
        txn.put(child, parent, db=self.parents_db)
        txn.put(parent, child, db=self.kids_db)

    def _count_usage(self, txn: lmdb.Transaction, entry: IndexEntry, sign: int) -> None:
        for bit in TierId:
            if entry.tiers & bit:
                key = _usage_key(entry.bucket, int(bit))
                raw = txn.get(key, db=self.usage_db)
                size, chunks = (0, 0) if raw is None else _USAGE.unpack(raw)
                size, chunks = size + sign * entry.size, chunks + sign
                if chunks > 0:
                    txn.put(key, _USAGE.pack(max(size, 0), chunks), db=self.usage_db)
                else:
                    txn.delete(key, db=self.usage_db)

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
            for db in (self.chunks_db, self.names_db, self.parents_db, self.pending_db, self.meta_db,
                       self.kids_db, self.expiry_db, self.usage_db, self.ghosts_db):
                txn.drop(db, delete=False)
            txn.put(_LAYOUT_KEY, _LAYOUT, db=self.meta_db)

        await self._submit(op)

    # -- the lifecycle: usage, TTL order, sampling, chains, ghosts -------------------------------

    def usage(self, bucket: str, tier: int) -> tuple[int, int]:
        """(bytes, chunks) this index holds for ``bucket`` in ``tier``."""
        with self._remap, self._begin(db=self.usage_db) as txn:
            raw = txn.get(_usage_key(bucket, tier))
        return (0, 0) if raw is None else _USAGE.unpack(raw)

    def usage_all(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(bytes, chunks) per (bucket, tier) for everything this index holds."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        with self._remap, self._begin(db=self.usage_db) as txn:
            for key, raw in txn.cursor():
                bucket, tier = bytes(key[:-2]).decode(), key[-1]
                out[(bucket, tier)] = _USAGE.unpack(raw)
        return out

    def due(self, now: float, limit: int) -> list[tuple[float, bytes]]:
        """Up to ``limit`` (expires, digest) of chunks expired at ``now``, soonest first."""
        out: list[tuple[float, bytes]] = []
        with self._remap, self._begin(db=self.expiry_db) as txn:
            cursor = txn.cursor()
            if not cursor.first():
                return out
            for key in cursor.iternext(values=False):
                expires = _EXPIRY.unpack_from(key)[0]
                if expires > now or len(out) >= limit:
                    break
                out.append((expires, bytes(key[_EXPIRY.size :])))
        return out

    def sample(self, bucket: str, tier: int, count: int, now: float, start: bytes, *, scan_limit: int = 4096
               ) -> list[tuple[bytes, IndexEntry, bool]]:
        """Up to ``count`` live chunks of ``bucket`` with a copy in ``tier``: the ones following the
        random digest ``start`` (wrapping around), which, digests being uniform hashes, are a random
        sample. Each with whether it is a leaf in ``tier`` (no child of its chain holds a copy there).
        At most ``scan_limit`` entries are looked at (a small bucket among large ones yields fewer)."""
        want = bucket.encode()
        width = len(want)
        head = RECORD.size
        out: list[tuple[bytes, IndexEntry, bool]] = []
        seen = 0
        with self._remap, self._begin() as txn:
            cursor = txn.cursor(db=self.chunks_db)
            kids = txn.cursor(db=self.kids_db)
            for wrapped in (False, True):
                if not (cursor.first() if wrapped else cursor.set_range(start)):
                    continue
                for digest, raw in cursor:
                    if wrapped and digest >= start:
                        return out
                    seen += 1
                    if seen > scan_limit:
                        return out
                    if not raw[_TIERS_AT] & tier or raw[head : head + width] != want or \
                            RECORD.unpack_from(raw)[8] != width:
                        continue
                    entry = IndexEntry.unpack(raw)
                    if not entry.alive(now):
                        continue
                    out.append((bytes(digest), entry, self._leaf_in(txn, kids, digest, tier)))
                    if len(out) >= count:
                        return out
        return out

    def candidate(self, digest: bytes, tier: int) -> tuple[IndexEntry, bool] | None:
        """The chunk's entry and whether it is a leaf in ``tier``; None unless it has a copy there."""
        with self._remap, self._begin() as txn:
            raw = txn.get(digest, db=self.chunks_db)
            if raw is None or not raw[_TIERS_AT] & tier:
                return None
            return IndexEntry.unpack(raw), self._leaf_in(txn, txn.cursor(db=self.kids_db), digest, tier)

    def children_in(self, digest: bytes, tier: int) -> list[bytes] | None:
        """The children of the chunk (its chain's next chunks) with a copy in ``tier``; None if it has
        more children than are looked at to decide whether it is a leaf."""
        out: list[bytes] = []
        with self._remap, self._begin() as txn:
            kids = txn.cursor(db=self.kids_db)
            if not kids.set_key(digest):
                return out
            for n, child in enumerate(kids.iternext_dup()):
                if n >= _KIDS_CHECKED:
                    return None
                raw = txn.get(child, db=self.chunks_db)
                if raw is not None and raw[_TIERS_AT] & tier:
                    out.append(bytes(child))
        return out

    def _leaf_in(self, txn: lmdb.Transaction, kids: lmdb.Cursor, digest: bytes, tier: int) -> bool:
        if not kids.set_key(digest):
            return True
        for n, child in enumerate(kids.iternext_dup()):
            if n >= _KIDS_CHECKED:
                return False
            raw = txn.get(child, db=self.chunks_db)
            if raw is not None and raw[_TIERS_AT] & tier:
                return False
        return True

    def link_chain(self, digests: Sequence[bytes]) -> concurrent.futures.Future[Any] | None:
        """Learn a prefix chain from the order of ``digests`` (a client looked them up in that order):
        each present chunk's parent becomes the one before it, as ``put`` with a parent records. The
        check runs here (one read transaction: a known chain costs no write); new links are written
        by the writer thread in the background (the returned future, None if there was nothing to do).
        """
        # a repeated child ends linked as linking each pair in order would: the last pair wins
        wanted = dict(zip(digests[1:], digests, strict=False))
        if not wanted:
            return None
        with self._remap, self._begin(db=self.parents_db) as txn:
            known = dict(txn.cursor().getmulti(list(wanted)))  # one call for the whole chain
        new = [(child, parent) for child, parent in wanted.items() if known.get(child) != parent and child != parent]
        if not new:
            return None

        def op(txn: lmdb.Transaction) -> None:
            for child, parent in new:
                if txn.get(child, db=self.chunks_db) is not None:
                    self._link_in(txn, child, parent)

        future = self._writer.submit(op)
        future.add_done_callback(_log_failure)
        return future

    async def remember(self, ghosts: Sequence[tuple[bytes, Ghost]], keep: float) -> None:
        """Remember chunks the lifecycle just evicted, so one stored again is known to have come back;
        then forget random ones until at most ``keep`` times the indexed chunks are remembered (each
        forgotten one leaves a ``FORGOTTEN`` observation)."""

        def op(txn: lmdb.Transaction) -> None:
            for digest, ghost in ghosts:
                if txn.get(digest, db=self.chunks_db) is None:
                    txn.put(digest, ghost.pack(), db=self.ghosts_db)
            limit = int(keep * txn.stat(self.chunks_db)["entries"])
            extra = txn.stat(self.ghosts_db)["entries"] - limit
            if extra <= 0:
                return
            cursor = txn.cursor(db=self.ghosts_db)
            now = time.time()
            for _ in range(extra):
                if not (cursor.set_range(os.urandom(16)) or cursor.first()):
                    break
                ghost = Ghost.unpack(cursor.value())
                cursor.delete()
                self.observations.append(Observation(OBS_FORGOTTEN, ghost.bucket, ghost.tier, ghost.size,
                                                     ghost.last_access, ghost.hits, now, 1, ghost.marks))

        await self._submit(op)

    def sample_ghosts(self, count: int, start: bytes) -> list[tuple[bytes, Ghost]]:
        """Up to ``count`` remembered evictions following the random digest ``start`` (wrapping)."""
        out: list[tuple[bytes, Ghost]] = []
        with self._remap, self._begin(db=self.ghosts_db) as txn:
            cursor = txn.cursor()
            for wrapped in (False, True):
                if not (cursor.first() if wrapped else cursor.set_range(start)):
                    continue
                for digest, raw in cursor:
                    if (wrapped and digest >= start) or len(out) >= count:
                        return out
                    out.append((bytes(digest), Ghost.unpack(raw)))
        return out

    def ghost_count(self) -> int:
        with self._remap, self._begin(db=self.ghosts_db) as txn:
            return int(txn.stat(self.ghosts_db)["entries"])

    # -- the cluster feed ------------------------------------------------------------------------

    def identity(self) -> str:
        """A random token naming this index, created on first use (blocking) and kept for its life: the
        worker processes sharing the index agree on it; a cleared or new index gets a new one."""
        with self._remap, self._begin(db=self.meta_db) as txn:
            raw = txn.get(_IDENTITY_KEY)
        if raw is not None:
            return bytes(raw).decode()
        token = os.urandom(4).hex().encode()

        def op(txn: lmdb.Transaction) -> bytes:
            found = txn.get(_IDENTITY_KEY, db=self.meta_db)
            if found is not None:
                return bytes(found)  # another process created it first
            txn.put(_IDENTITY_KEY, token, db=self.meta_db)
            return token

        created: bytes = self.submit_sync(op)
        return created.decode()

    def feed_position(self) -> tuple[str, int] | None:
        """(feed id, last applied sequence number) of the cluster feed this index follows; None if it
        never followed one (a new or rebuilt-by-hand index)."""
        with self._remap, self._begin(db=self.meta_db) as txn:
            raw = txn.get(_FEED_KEY)
            if raw is None:
                return None
            raw = bytes(raw)
            return raw[_FEED_POSITION.size :].decode(), _FEED_POSITION.unpack_from(raw)[0]

    @staticmethod
    def _position_value(feed: str, seq: int) -> bytes:
        return _FEED_POSITION.pack(seq) + feed.encode()

    async def set_feed_position(self, feed: str, seq: int) -> None:
        await self._submit(self.feed_position_op(feed, seq))

    def feed_position_op(self, feed: str, seq: int) -> Callable[[lmdb.Transaction], None]:
        """``set_feed_position`` as a writer operation, for ``submit_sync`` from a worker thread."""
        value = self._position_value(feed, seq)

        def op(txn: lmdb.Transaction) -> None:
            txn.put(_FEED_KEY, value, db=self.meta_db)

        return op

    async def apply_changes(self, changes: Sequence[IndexChange], feed: str, seq: int) -> list[IndexChange]:
        """Apply other gateways' changes in order, and record ``seq`` as the feed position, in one
        transaction. Returns the changes that altered an entry (the rest were known already or are
        about an incarnation this index does not hold).

        ADD of an unknown chunk indexes it; of a known incarnation adds the tier bit; of another
        incarnation replaces the entry only if it is newer (by creation time). REMOVE clears the tier
        bit (the entry goes with its last bit). READ raises last access and hits of a known entry.
        """
        position = self._position_value(feed, seq)

        def op(txn: lmdb.Transaction) -> list[IndexChange]:
            applied: list[IndexChange] = []
            for change in changes:
                if self._apply_in(txn, change):
                    applied.append(change)
            txn.put(_FEED_KEY, position, db=self.meta_db)
            return applied

        result: list[IndexChange] = await self._submit(op)
        return result

    def _apply_in(self, txn: lmdb.Transaction, change: IndexChange) -> bool:
        digest = change.digest
        raw = txn.get(digest, db=self.chunks_db)
        old = None if raw is None else IndexEntry.unpack(raw)
        if change.op == ChangeOp.READ:
            if old is None:
                return False
            self._read_in(txn, digest, old, change.at, change.count)
            return True
        if change.op == ChangeOp.MARK:
            if old is None:
                return False
            return self._mark_in(txn, digest, old, change.count & 0xFF, change.count >> 8)
        if change.op == ChangeOp.LINK:
            if old is None or change.parent is None or txn.get(digest, db=self.parents_db) == change.parent:
                return False
            self._link_in(txn, digest, change.parent)
            return True
        entry = change.entry
        if change.op == ChangeOp.ADD:
            assert entry is not None
            if old is not None and _same_incarnation(old, entry):
                if old.tiers & change.tier:
                    return False
                if change.tier & TierId.FS and change.at > old.last_access:
                    # a known chunk gains a filesystem copy only by promotion, i.e. because it is read:
                    # the eviction order must see it as used now (its read event follows later)
                    old = replace(old, last_access=change.at)
                    txn.put(digest, old.pack(), db=self.chunks_db)
                self._set_tiers_in(txn, digest, old, old.tiers | change.tier)
                return True
            if old is not None and old.created > entry.created:
                return False  # this index holds a newer incarnation (written here after that event)
            self._write_in(txn, digest, replace(entry, tiers=change.tier), old, change.parent)
            return True
        if change.op == ChangeOp.REMOVE:
            if old is None or not old.tiers & change.tier:
                return False
            if entry is not None and not _same_incarnation(old, entry):
                return False
            self._set_tiers_in(txn, digest, old, old.tiers & ~change.tier)
            return True
        return False

    def _mark_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry, set_marks: int, clear_marks: int
                 ) -> bool:
        marks = (entry.marks & ~clear_marks | set_marks) & MARKS
        if marks == entry.marks:
            return False
        txn.put(digest, replace(entry, marks=marks).pack(), db=self.chunks_db)
        return True

    async def mark(self, digests: Sequence[bytes], set_marks: int, clear_marks: int = 0) -> list[bool]:
        """Set and clear hint marks (``MARK_*``) of indexed chunks, in one transaction; which of
        ``digests`` are indexed. Reads of them not applied yet are applied first, in the same
        transaction, so a read made before the hint never clears a mark it sets."""
        wanted = set(digests)
        with self._touch_lock:
            early = {d: self._touches.pop(d) for d in wanted if d in self._touches}

        def op(txn: lmdb.Transaction) -> list[bool]:
            found: list[bool] = []
            for digest in digests:
                raw = txn.get(digest, db=self.chunks_db)
                if raw is None:
                    found.append(False)
                    continue
                entry = IndexEntry.unpack(raw)
                if digest in early:
                    when, count = early.pop(digest)
                    entry = self._read_in(txn, digest, entry, when, count)
                self._mark_in(txn, digest, entry, set_marks, clear_marks)
                found.append(True)
            return found

        result: list[bool] = await self._submit(op)
        return result

    def _read_in(self, txn: lmdb.Transaction, digest: bytes, entry: IndexEntry, when: float, count: int
                 ) -> IndexEntry:
        self.observations.append(Observation(OBS_READ, entry.bucket, entry.tiers, entry.size,
                                             max(entry.last_access, entry.created),
                                             entry.hits + (1 if entry.returned else 0), when, count, entry.marks))
        marks = entry.marks if when <= entry.last_access else entry.marks & ~MARKS_CLEARED_BY_READ
        updated = replace(entry, last_access=max(entry.last_access, when), hits=entry.hits + count, marks=marks)
        txn.put(digest, updated.pack(), db=self.chunks_db)
        return updated

    async def reconcile_tier(self, tier: int, found: Sequence[tuple[bytes, IndexEntry, bytes | None]],
                             absent: Sequence[bytes], newer_than: float
                             ) -> tuple[list[tuple[bytes, IndexEntry]], int]:
        """One step of a resync with a tier (``gateway.cluster.resync``): index the chunks ``found``
        in tier ``tier`` (an entry of the same incarnation gets the tier bit; another incarnation
        is replaced) and clear the bit of the digests ``absent`` from it, except entries created at or
        after ``newer_than`` (written while the scan ran). Returns the entries added and how many
        bits were cleared."""

        def op(txn: lmdb.Transaction) -> tuple[list[tuple[bytes, IndexEntry]], int]:
            added: list[tuple[bytes, IndexEntry]] = []
            removed = 0
            for digest, entry, parent in found:
                if self._apply_in(txn, IndexChange(ChangeOp.ADD, digest, tier, entry, parent)):
                    added.append((digest, entry))
            for digest in absent:
                raw = txn.get(digest, db=self.chunks_db)
                if raw is None:
                    continue
                old = IndexEntry.unpack(raw)
                if old.created >= newer_than:
                    continue
                if self._apply_in(txn, IndexChange(ChangeOp.REMOVE, digest, tier)):
                    removed += 1
            return added, removed

        result: tuple[list[tuple[bytes, IndexEntry]], int] = await self._submit(op)
        return result

    def touch(self, digest: bytes, now: float, count: int = 1) -> None:
        """Record ``count`` reads (the last at ``now``); applied in the writer's next batch, not one
        transaction per read."""
        with self._touch_lock:
            last, hits = self._touches.get(digest, (0.0, 0))
            self._touches[digest] = (max(last, now), hits + count)

    def take_touches(self) -> Callable[[lmdb.Transaction], None] | None:
        with self._touch_lock:
            touches, self._touches = self._touches, {}
        if not touches:
            return None

        def op(txn: lmdb.Transaction) -> None:
            for digest, (when, hits) in touches.items():
                raw = txn.get(digest, db=self.chunks_db)
                if raw is not None:
                    self._read_in(txn, digest, IndexEntry.unpack(raw), when, hits)

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

    def _begin(self, **kwargs: Any) -> Any:
        """A read transaction (caller holds ``_remap``); adopts a map another process grew meanwhile."""
        try:
            return self.env.begin(**kwargs)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)  # no transaction of ours is open: the caller holds _remap
            return self.env.begin(**kwargs)

    def adopt_map_size(self) -> None:
        """Take the map size another process (a ``--workers`` sibling) set, excluding readers (writer thread)."""
        with self._remap:
            self.env.set_mapsize(0)

    def grow(self) -> None:
        """Double the map (writer thread only), excluding readers while LMDB remaps."""
        with self._remap:
            size = self.env.info()["map_size"]
            self.env.set_mapsize(size * 2)

    def close(self) -> None:
        self._writer.close()
        self.env.close()
