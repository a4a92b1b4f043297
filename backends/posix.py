"""The filesystem tier: a POSIX directory on local disk or an NFS mount shared by several gateways.

Layout under the root::

    chunks/ab/cd/<32 hex digest>     published chunks (data + footer, see chunkfile)
    staging/<host>.<pid>.<token><n>.part   in-progress writes of one gateway process
    quarantine/<digest>.<unix time>  chunks that failed verification

Publishing is ``link(staged, final)``: link never overwrites, so it is an atomic create-if-absent
across processes and hosts (also on NFS, unlike ``rename``). A lost NFS reply can make a link that
succeeded report EEXIST on retransmission; the staged file's link count tells the truth. With the
fsync policy on, the data is fsynced before the link and the directory after it.

Shared directories and lookup caches. A client of a shared directory may cache that a name did not
exist (the Linux NFS client's negative lookup cache, a FUSE mount's ``negative_timeout``): a chunk
this host looked up just before another host created it then stays "not found" here for a while,
although the cluster feed already told the index it exists. Every operation on a chunk the caller
believes present (``read``, ``stream``, ``stat``, ``delete``, ``quarantine``, ``scan``) therefore
answers "not found" only when the chunk's directory does not list the name either: reading the
directory opens it, which makes an NFS client revalidate the directory's attributes (close-to-open
consistency applies to directories too), and a changed directory invalidates the negative lookups
cached under it; the listing itself comes from the server. A listed name that a lookup still misses is
retried with backoff for up to ``visibility_seconds`` (a FUSE negative entry lives until its timeout),
then raises ``ChunkHidden`` (a ``TierUnavailable``: callers retry; nobody forgets the chunk or reports
it removed). ``stat_many`` and ``absent_now`` are the lookups of chunks nobody said exist (index
misses): they take "not found" as it comes, at no extra cost.

Blocking calls run in worker threads so the event loop only ever waits on futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import mmap
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar, cast

from backends import chunkfile
from backends.base import AheadRead, ChunkMeta, check_bytes
from backends.errors import BackendError, ChunkCorrupt, ChunkHidden, ChunkNotFound
from backends.fileio import (
    DIRECT_ALIGN,
    LOCAL_FILESYSTEMS,
    filesystem_type,
    fsync_dir,
    open_direct,
    pid_alive,
    run_io,
    start_writeback,
    translate_oserror,
    write_all,
    write_direct,
)
from backends.read_ahead import Form, OpenedAhead
from backends.tiers import TierId

log = logging.getLogger("kvgw.posix")

T = TypeVar("T")

_RETRY_FIRST = 0.005  # seconds before the first retry of a hidden chunk; doubled each time...
_RETRY_MAX = 0.25  # ...up to this

_STAGING_SUFFIX = ".part"

READ_AHEAD_BYTES = 256 << 20
"""At most this much of batch reads' chunks opened ahead and not yet sent (``read_ahead``): mappings of
page-cache pages cost page tables, not memory, but keep those pages from being reclaimed."""
READ_AHEAD_MAX_AGE = 30.0  # seconds: a chunk opened ahead that no read took by then is closed
FOLIO_BYTES = 2 << 20
"""Staged bytes are written in whole multiples of this, at offsets that are multiples of it: the page
cache then holds a chunk's data in 2 MiB folios (the largest the kernel builds; a write's length and
alignment decide a folio's size), which every later read maps and copies at a fraction of the cost of
small ones. Measured here (kernel 6.18, ext4): mapping (``MAP_POPULATE``) and hashing an 8 MiB file
written in 2 MiB pieces took 0.15 ms of CPU against 0.46 ms for 1 MiB pieces, for the same write+fsync
CPU; BENCHMARKS.md ("kvgw bench io") has what it does to GET and batch-get."""


def _mapped_form(offset: int, length: int, checksum: int | None) -> Form:
    """``read_ahead``'s key for ``read(digest, offset, length, checksum=checksum)``."""
    return ("map", offset, length, checksum)


def _file_form(size: int) -> Form:
    """``read_ahead``'s key for ``open_data(digest, size)``."""
    return ("fd", size)


def _nothing() -> None:
    """A mapping opened ahead needs no closing: it goes with its last reference."""


def split_at(pieces: list[bytes | memoryview], size: int) -> tuple[list[bytes | memoryview], list[bytes | memoryview]]:
    """``pieces`` as the pieces of their first ``size`` bytes and those of the rest, without copying
    (a piece across the boundary becomes two views)."""
    head: list[bytes | memoryview] = []
    for at, piece in enumerate(pieces):
        if size <= 0:
            return head, pieces[at:]
        if len(piece) > size:
            view = memoryview(piece)
            return [*head, view[:size]], [view[size:], *pieces[at + 1:]]
        head.append(piece)
        size -= len(piece)
    return head, []


class PosixStagedChunk:
    """A write in progress: buffered pieces go to a private staging file, published with ``link``.

    The staging file is created at the first flush, so a chunk that fits in one buffer is written,
    published and cleaned up in a single worker-thread call.
    """

    def __init__(self, tier: PosixTier, digest: bytes, staging_path: str) -> None:
        self._tier = tier
        self._digest = digest
        self._path = staging_path
        self._fd: int | None = None
        self._direct_fd: int | None = None  # the same file, written around the page cache (direct writes)
        self._file_bytes = 0  # written to the staging file so far
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._writing: asyncio.Future[None] | None = None  # the one buffer being written meanwhile

    async def write(self, data: bytes | memoryview) -> None:
        """Buffer ``data``; once ``FOLIO_BYTES`` or more are buffered, their whole multiples of it are
        written by a worker thread while the next ones fill (the rest stays buffered, so every write
        starts at a multiple of it), and receiving the body and writing it overlap. At most about two
        buffers per write are in memory."""
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= FOLIO_BYTES:
            pieces, self._pending = split_at(self._pending, self._pending_bytes // FOLIO_BYTES * FOLIO_BYTES)
            self._pending_bytes %= FOLIO_BYTES
            await self._wait_writing()
            self._writing = asyncio.ensure_future(run_io(self._write_sync, pieces, what="write staged chunk"))

    def write_now(self, data: bytes | memoryview) -> None:
        """``SyncStagedChunk.write_now``: ``data`` goes to the staging file before this returns. The
        caller's pieces are whole multiples of ``FOLIO_BYTES`` (its last may be shorter), so every
        write still starts at a multiple of it."""
        assert self._writing is None and not self._pending, "write_now after write"
        try:
            self._write_sync([data])
        except OSError as exc:
            raise translate_oserror(exc, "write staged chunk") from exc

    async def _wait_writing(self) -> None:
        writing = self._writing
        if writing is not None:
            await asyncio.shield(writing)  # a cancelled caller must not lose track of a running write
            self._writing = None

    def _write_sync(self, pieces: list[bytes | memoryview]) -> None:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            self._fd = os.open(self._path, flags, 0o644)
        if self._tier.direct_writes:
            pieces = self._write_direct(pieces)
        length = sum(len(p) for p in pieces)
        if not length:
            return
        write_all(self._fd, pieces)
        if self._tier.fsync:  # the fsync in ``publish`` then waits only for what comes after
            start_writeback(self._fd, self._file_bytes, length)
        self._file_bytes += length

    def _write_direct(self, pieces: list[bytes | memoryview]) -> list[bytes | memoryview]:
        """The tier's direct writes (``PosixTier.direct_writes``): the pieces' leading whole multiples of
        ``DIRECT_ALIGN`` written around the page cache; returns the rest (a chunk's last partial block
        and its footer), which the caller writes through the page cache, after them."""
        assert self._fd is not None
        length = sum(len(p) for p in pieces)
        aligned = length - length % DIRECT_ALIGN if self._file_bytes % DIRECT_ALIGN == 0 else 0
        if not aligned:
            return pieces
        if self._direct_fd is None:
            self._direct_fd = open_direct(self._path)
            if self._direct_fd is None:  # the filesystem refuses O_DIRECT: the tier stops asking
                self._tier.direct_unsupported()
                return pieces
        head, rest = split_at(pieces, aligned)
        try:
            write_direct(self._direct_fd, head, self._file_bytes)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # opened, then refused (alignment rules of its own): the same bytes through the page cache,
            # over whatever part of them landed, and no direct writes from now on
            os.close(self._direct_fd)
            self._direct_fd = None
            self._tier.direct_unsupported()
            return pieces
        self._file_bytes += aligned
        os.lseek(self._fd, self._file_bytes, os.SEEK_SET)  # the buffered descriptor writes on from there
        return rest

    async def publish(self, meta: ChunkMeta) -> bool:
        pieces: list[bytes | memoryview] = [*self._pending, chunkfile.encode_footer(meta)]
        self._pending = []
        try:
            await self._wait_writing()
        except BaseException:
            await self._release()  # the background write failed (disk full): its file and fd are ours
            raise
        try:
            return await run_io(self._publish_sync, pieces, what="publish chunk")
        finally:  # _publish_sync removed the staging file and closed the fd, whatever happened
            self._tier.forget_staging(self._path)
            self._path = ""

    def _publish_sync(self, pieces: list[bytes | memoryview]) -> bool:
        try:
            self._write_sync(pieces)
            assert self._fd is not None
            if self._tier.fsync:
                os.fsync(self._fd)  # the inode's: what either descriptor wrote
            self._close_fds()
            final = self._tier.path_for(self._digest)
            shard = os.path.dirname(final)
            self._tier.ensure_dir(shard)
            try:
                os.link(self._path, final)
                created = True
            except FileExistsError:
                # On NFS a retransmitted LINK whose first reply was lost answers EEXIST although our
                # link took effect: then the staged file has a second name.
                created = os.stat(self._path).st_nlink > 1
            if created and self._tier.fsync:
                fsync_dir(shard)
            return created
        finally:
            self._cleanup_sync(self._path)

    def _cleanup_sync(self, path: str) -> None:
        """Close the staging fds and unlink the staging file. Only when no worker thread writes to it."""
        self._close_fds()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _close_fds(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct_fd = None

    async def discard(self) -> None:
        self._pending = []
        await self._release()

    async def _release(self) -> None:
        """Drop the staged bytes: no staging file and no open descriptor remain (issue: a 507 used to
        leave both). A write still running in a worker thread owns the fd until it ends, so then the
        cleanup runs when it ends, not under it."""
        path, self._path = self._path, ""
        if not path:
            return
        self._tier.forget_staging(path)
        writing, self._writing = self._writing, None
        if writing is not None and not writing.done():
            writing.add_done_callback(lambda done: self._cleanup_later(done, path))
            return
        with contextlib.suppress(BackendError):
            await run_io(self._cleanup_sync, path, what="discard staged chunk")

    def _cleanup_later(self, done: asyncio.Future[None], path: str) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: the write's failure was already the caller's answer

        async def cleanup() -> None:
            with contextlib.suppress(BackendError):
                await run_io(self._cleanup_sync, path, what="discard staged chunk")

        task = asyncio.ensure_future(cleanup())
        _CLEANUPS.add(task)
        task.add_done_callback(_CLEANUPS.discard)


_CLEANUPS: set[asyncio.Future[None]] = set()
"""Cleanups scheduled after a write thread ends; held here so they are not garbage-collected."""


class PosixTier:
    """Chunks as files in a directory tree; safe to share between gateways (see module docstring)."""

    name = TierId.FS.label

    def __init__(self, root: Path, *, fsync: bool = True, direct_writes: bool = False,
                 visibility_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """``visibility_seconds``: how long an operation retries a chunk its directory lists but a lookup
        here does not find (module docstring); ``clock`` and ``sleep`` pace those retries (tests)."""
        self.root = root
        self.visibility_seconds = visibility_seconds
        self._clock = clock
        self._sleep = sleep
        self.hidden_seen = 0  # operations that met a chunk listed in its directory but not found by a lookup
        self.hidden_refused = 0  # ...and gave up on it after visibility_seconds (ChunkHidden)
        self._root = str(root)
        self.fsync = fsync
        self.direct_writes = direct_writes  # chunk data written around the page cache (Settings.fs_direct_writes)
        self._chunks = str(root / "chunks")
        self._staging = str(root / "staging")
        self._quarantine = str(root / "quarantine")
        self._host = socket.gethostname().replace(".", "_")
        self._seq = itertools.count()
        self._token = os.urandom(4).hex()  # several tiers in one process never share a staging name
        self._known_dirs: set[str] = set()
        self._live_staging: set[str] = set()  # this process's writes in progress: never cleaned
        # lookups probe for a file on the event loop, a thread only for files that exist (see stat_many)
        self._probe_inline = filesystem_type(root) in LOCAL_FILESYSTEMS
        self._ahead = OpenedAhead(limit_bytes=READ_AHEAD_BYTES, max_age=READ_AHEAD_MAX_AGE, clock=clock)
        for path in (self._chunks, self._staging, self._quarantine):
            os.makedirs(path, exist_ok=True)

    def direct_unsupported(self) -> None:
        """The filesystem refused ``O_DIRECT``: write through the page cache from now on (said once)."""
        if self.direct_writes:
            self.direct_writes = False
            log.warning("%s does not take O_DIRECT writes: chunks are written through the page cache", self._root)

    def path_for(self, digest: bytes) -> str:
        return f"{self._root}/{self.relative_path(digest)}"

    def relative_path(self, digest: bytes) -> str:
        name = digest.hex()
        return f"chunks/{name[:2]}/{name[2:4]}/{name}"

    def ensure_dir(self, path: str) -> None:
        if path in self._known_dirs:
            return
        if not os.path.isdir(path):
            parent = os.path.dirname(path)
            os.makedirs(path, exist_ok=True)
            if self.fsync:
                fsync_dir(parent)
                fsync_dir(os.path.dirname(parent))
        self._known_dirs.add(path)

    async def stage(self, digest: bytes) -> PosixStagedChunk:
        path = f"{self._staging}/{self._host}.{os.getpid()}.{self._token}{next(self._seq)}{_STAGING_SUFFIX}"
        self._live_staging.add(path)
        return PosixStagedChunk(self, digest, path)

    def forget_staging(self, path: str) -> None:
        self._live_staging.discard(path)

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        ahead = self._ahead.claim((digest, _mapped_form(offset, length, checksum)))
        if ahead is not None:
            return cast("bytes | memoryview", ahead)
        path = self.path_for(digest)
        return await self._revalidating(path, lambda: run_io(self._read_sync, path, offset, length, checksum,
                                                            what="read chunk"))

    # -- chunks that exist but are not visible here yet (module docstring) -------------------------

    async def _revalidating(self, path: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``; when it finds no file at ``path`` but the directory lists it, again after a
        fresh look at the directory, with backoff, until ``visibility_seconds`` have passed (then
        ChunkHidden). ChunkNotFound only when the directory does not list the name."""
        deadline: float | None = None
        delay = _RETRY_FIRST
        while True:
            try:
                return await attempt()
            except ChunkNotFound:
                if not await run_io(self._listed, path, what="list chunk directory"):
                    raise
            now = self._clock()
            if deadline is None:
                deadline = now + self.visibility_seconds
                self.hidden_seen += 1
                log.info("%s is in its directory but not visible to this host yet (a cached negative lookup); "
                         "retrying for up to %.1f s", path, self.visibility_seconds)
            if now >= deadline:
                self.hidden_refused += 1
                raise ChunkHidden(f"{os.path.basename(path)} is listed in its directory, but lookups on this "
                                  f"host have not found it for {self.visibility_seconds:g} s")
            await self._sleep(min(delay, deadline - now))
            delay = min(delay * 2, _RETRY_MAX)

    def _listed(self, path: str) -> bool:
        """Whether ``path``'s directory lists its name, read afresh (opening the directory revalidates an
        NFS client's view of it). A directory that is itself not found is looked for in its parent, up to
        the chunk root: listed there, it may hold the name (True: worth another try)."""
        directory, name = os.path.split(path)
        try:
            return name in os.listdir(directory)
        except FileNotFoundError:
            return directory.startswith(self._chunks + "/") and self._listed(directory)

    def _sync_revalidating(self, path: str, attempt: Callable[[], T]) -> T:
        """``_revalidating`` for a worker thread (``scan``): the same rule, blocking waits."""
        deadline: float | None = None
        delay = _RETRY_FIRST
        while True:
            try:
                return attempt()
            except FileNotFoundError:
                if not self._listed(path):
                    raise
            now = self._clock()
            if deadline is None:
                deadline = now + self.visibility_seconds
                self.hidden_seen += 1
            if now >= deadline:
                self.hidden_refused += 1
                raise ChunkHidden(f"{os.path.basename(path)} is listed in its directory, but lookups on this "
                                  f"host have not found it for {self.visibility_seconds:g} s")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _RETRY_MAX)

    @staticmethod
    def _read_sync(path: str, offset: int, length: int, checksum: int | None) -> bytes | memoryview:
        """Map the chunk rather than copy it: the socket write then copies straight from the page
        cache (measured: about half the CPU per GiB of pread + write, close to nginx's sendfile).

        The mapping is prefaulted here, in a worker thread, so the event loop never waits on disk.
        Chunk files are immutable (never truncated; deletion and quarantine only unlink or rename),
        which is what makes serving from a mapping safe. A ``checksum`` is checked here too, in the
        same worker-thread call (one hand-off per read instead of two: BENCHMARKS.md, "kvgw bench io").
        """
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            end = offset + length
            if length == 0 or os.fstat(fd).st_size < end:
                data: bytes | memoryview = os.pread(fd, length, offset)  # empty, or truncated: a short read
            else:
                mapped = mmap.mmap(fd, end, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
                data = memoryview(mapped)[offset:end]
        finally:
            os.close(fd)
        check_bytes(data, checksum)
        return data

    async def open_data(self, digest: bytes, size: int) -> int:
        ahead = self._ahead.claim((digest, _file_form(size)))
        if ahead is not None:
            return cast(int, ahead)
        return await run_io(self._open_data_sync, self.path_for(digest), size, what="open chunk")

    @staticmethod
    def _open_data_sync(path: str, size: int) -> int:
        """``open_data`` in a worker thread: open, then one read of the footer's tail (page-cache warm
        right after a write, one small read otherwise)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            total = os.fstat(fd).st_size
            if total < chunkfile.TAIL.size:
                raise ChunkCorrupt("chunk is shorter than its footer")
            meta_bytes = chunkfile.footer_length(os.pread(fd, chunkfile.TAIL.size, total - chunkfile.TAIL.size))
            if total - chunkfile.TAIL.size - meta_bytes != size:
                raise ChunkCorrupt(f"chunk file holds {total - chunkfile.TAIL.size - meta_bytes} bytes, not {size}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_ahead_report(self) -> dict[str, int]:
        """``OpenedAhead.report`` of this tier's read-ahead (the admin stats' ``fs_read_ahead``)."""
        return self._ahead.report()

    async def read_ahead(self, reads: list[AheadRead]) -> None:
        """A batch read is about to serve ``reads`` in this order: POSIX_FADV_WILLNEED on every file (the
        kernel reads them in parallel, up to the device's queue depth, while earlier ones are sent), then
        each opened in advance, in order, exactly as ``read`` / ``open_data`` would for it, and kept for
        that call (``backends.read_ahead``): one worker-thread hand-off for the batch, not one per chunk.
        Best effort: a chunk that fails here is opened by its own read, which reports why."""
        planned = [((r.digest, _file_form(r.size) if r.as_file else _mapped_form(0, r.size, r.checksum)), r.size)
                   for r in reads]
        self._ahead.plan(planned)

        def open_all() -> None:
            paths = [self.path_for(r.digest) for r in reads]
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                finally:
                    os.close(fd)
            for (key, _), path, r in zip(planned, paths, reads, strict=True):
                if not self._ahead.begin(key):
                    continue
                try:
                    if r.as_file:
                        fd = self._open_data_sync(path, r.size)
                        self._ahead.offer(key, fd, functools.partial(os.close, fd))
                    else:
                        self._ahead.offer(key, self._read_sync(path, 0, r.size, r.checksum), _nothing)
                except (OSError, BackendError):
                    self._ahead.abandon(key)

        await asyncio.to_thread(open_all)

    async def stream(self, digest: bytes, offset: int, length: int, window: int
                     ) -> AsyncIterator[bytes | memoryview]:
        """Windows of one mapping of the chunk. Once the consumer asks for the next window, the
        previous one's pages are dropped from this process (MADV_DONTNEED: they stay in the page
        cache, and a socket still sending them faults them back in), so a large chunk streamed to a
        slow client holds about one window of resident memory, not the whole chunk."""
        path = self.path_for(digest)
        mapped = await self._revalidating(path, lambda: run_io(self._map_sync, path, offset + length,
                                                                what="open chunk"))
        if mapped is None:  # empty, or shorter than asked: a short read says so
            yield await self.read(digest, offset, length)
            return
        view = memoryview(mapped)
        end = offset + length
        while offset < end:
            n = min(window, end - offset)
            yield view[offset : offset + n]
            start = offset - offset % mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, start, offset + n - start)
            offset += n

    @staticmethod
    def _map_sync(path: str, end: int) -> mmap.mmap | None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if end == 0 or os.fstat(fd).st_size < end:
                return None
            return mmap.mmap(fd, end, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    async def stat(self, digest: bytes) -> ChunkMeta:
        path = self.path_for(digest)
        return await self._revalidating(path, lambda: run_io(chunkfile.read_meta, path, what="stat chunk"))

    def _probably_present(self, paths: list[str]) -> list[int]:
        """Indices of ``paths`` that may exist: those that do on a local filesystem (probed here, on
        the caller's thread), all of them elsewhere."""
        if not self._probe_inline:
            return list(range(len(paths)))
        return [i for i, path in enumerate(paths) if os.path.exists(path)]

    def absent_now(self, digests: list[bytes]) -> bool:
        """On a local filesystem, from the dentry cache (as ``stat_many`` probes); never on NFS."""
        return self._probe_inline and not any(os.path.exists(self.path_for(digest)) for digest in digests)

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        """The footers of the chunks that exist, None for the others (absent or damaged).

        Lookups of absent chunks are what a lookup-heavy client sends most (vLLM's object tier HEADs
        every block): on a local filesystem, whether a file exists is answered on the event loop from
        the dentry cache in about a microsecond, against tens for a hop to a worker thread, so only the
        files that exist are read in a thread. On a network filesystem every path lookup may be a round
        trip to the server, so all of it runs in the thread."""
        paths = [self.path_for(digest) for digest in digests]
        wanted = self._probably_present(paths)
        out: list[ChunkMeta | None] = [None] * len(paths)
        if not wanted:
            return out

        def read_all() -> list[ChunkMeta | None]:
            metas: list[ChunkMeta | None] = []
            for i in wanted:
                try:
                    metas.append(chunkfile.read_meta(paths[i]))
                except FileNotFoundError:
                    metas.append(None)
                except BackendError:
                    metas.append(None)  # damaged: absent for lookups; scrub quarantines it
            return metas

        for i, meta in zip(wanted, await run_io(read_all, what="stat chunks"), strict=True):
            out[i] = meta
        return out

    async def delete(self, digest: bytes) -> bool:
        self._ahead.drop(digest)
        path = self.path_for(digest)
        try:
            await self._revalidating(path, lambda: run_io(os.unlink, path, what="delete chunk"))
        except ChunkNotFound:
            return False
        return True

    async def quarantine(self, digest: bytes) -> bool:
        self._ahead.drop(digest)
        path = self.path_for(digest)

        def move() -> None:
            os.rename(path, f"{self._quarantine}/{digest.hex()}.{time.time():.0f}")

        try:
            await self._revalidating(path, lambda: run_io(move, what="quarantine chunk"))
        except ChunkNotFound:
            return False
        return True

    async def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        shards = await run_io(self._list_shards, what="list chunk directories")
        for shard in shards:
            entries = await run_io(self._scan_shard, shard, what="scan chunk directory")
            for item in entries:
                yield item

    def _list_shards(self) -> list[str]:
        shards: list[str] = []
        for first in sorted(os.listdir(self._chunks)):
            top = f"{self._chunks}/{first}"
            if os.path.isdir(top):
                shards.extend(f"{top}/{second}" for second in sorted(os.listdir(top)))
        return shards

    def _scan_shard(self, shard: str) -> list[tuple[bytes, ChunkMeta | None]]:
        found: list[tuple[bytes, ChunkMeta | None]] = []
        try:
            names = sorted(os.listdir(shard))
        except FileNotFoundError:
            return found
        for name in names:
            try:
                digest = bytes.fromhex(name)
            except ValueError:
                continue
            path = f"{shard}/{name}"
            try:  # listed: a lookup that misses it is a cached negative one (or it went meanwhile)
                meta: ChunkMeta | None = self._sync_revalidating(path, functools.partial(chunkfile.read_meta, path))
            except FileNotFoundError:
                continue
            except ChunkHidden:
                raise
            except BackendError:
                meta = None
            found.append((digest, meta))
        return found

    async def cleanup_staging(self, older_than: float) -> int:
        return await run_io(self._cleanup_sync, older_than, what="clean staging area")

    def _cleanup_sync(self, older_than: float) -> int:
        """Remove staged files of dead local writers, and any staged file idle for ``older_than`` s.

        A file named with this host and this pid that is not one of our live writes belongs to an
        earlier process that had the same pid (containers restart as pid 1).
        """
        removed = 0
        now = time.time()
        me = os.getpid()
        for entry in os.scandir(self._staging):
            if not entry.name.endswith(_STAGING_SUFFIX) or entry.path in self._live_staging:
                continue
            host, _, rest = entry.name.partition(".")
            pid_text = rest.split(".", 1)[0]
            dead_local = host == self._host and pid_text.isdigit() and (
                int(pid_text) == me or not pid_alive(int(pid_text))
            )
            try:
                stale = now - entry.stat().st_mtime > older_than
                if dead_local or stale:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    async def usage(self) -> int:
        def walk() -> int:
            total = 0
            for dirpath, _, files in os.walk(self._chunks):
                for name in files:
                    try:
                        total += os.stat(f"{dirpath}/{name}").st_size
                    except FileNotFoundError:
                        continue
            return total

        return await run_io(walk, what="measure tier usage")

    async def close(self) -> None:
        self._ahead.clear()
