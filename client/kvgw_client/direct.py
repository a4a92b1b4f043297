"""Direct reads of the filesystem tier: the client reads chunk files itself, the gateway only says where.

When the inference host mounts the gateway's filesystem tier (the same machine, or the NFS export
that several gateways share), moving chunk bytes through HTTP costs two copies and a socket for data
that a ``preadv`` into the caller's buffer delivers at page-cache speed. So a batch read first asks
the gateway to ``locate`` the keys (one small JSON call: the index answers, counts the reads for
eviction and learns the prefix chain, exactly as for batch-get), then reads each located file from
``root`` on a small thread pool, verifying size and xxh3-64 before the item is reported OK.

Chunk files are immutable once published, so a file either holds the located bytes or is gone (evicted
or quarantined meanwhile, or ``root`` points elsewhere): anything short, missing or mismatching is
handed back to the caller to fetch through batch-get, and wrong bytes are never reported OK.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import enum
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xxhash

from kvgw_client.errors import ProtocolError
from kvgw_client.framing import Destination, destination_views

_SLICE = 1 << 20  # read and hash in 1 MiB steps, so the hash reads bytes still in the CPU cache


@dataclass(frozen=True, slots=True)
class Location:
    size: int
    checksum: int
    path: str | None  # relative to the tier root; None: only S3 holds it (fetch through batch-get)


class ReadResult(enum.Enum):
    OK = "ok"
    UNREADABLE = "unreadable"  # missing, short or unopenable: fetch it through the gateway
    MISMATCH = "mismatch"  # the bytes read do not hash to the located checksum


def parse_locations(doc: object, count: int, max_size: int) -> list[Location | None]:
    """The ``locate`` answer, checked: one entry per key, sizes in range, paths inside the root."""
    chunks = doc.get("chunks") if isinstance(doc, dict) else None
    if not isinstance(chunks, list) or len(chunks) != count:
        raise ProtocolError("locate: expected {\"chunks\": [...]} with one entry per key")
    out: list[Location | None] = []
    for entry in chunks:
        if entry is None:
            out.append(None)
            continue
        try:
            size, checksum, path = entry["size"], int(entry["checksum"], 16), entry.get("path")
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ProtocolError("locate: malformed entry") from None
        if not isinstance(size, int) or not 0 <= size <= max_size:
            raise ProtocolError(f"locate: bad size {size!r}")
        if path is not None and not _is_inside(path):
            raise ProtocolError(f"locate: path {path!r} is not a relative path inside the tier")
        out.append(Location(size, checksum, path))
    return out


def _is_inside(path: object) -> bool:
    return (isinstance(path, str) and bool(path) and not path.startswith("/")
            and "\0" not in path and ".." not in path.split("/"))


class DirectReader:
    """Reads located chunk files under ``root`` into caller buffers on its own threads."""

    def __init__(self, root: str, threads: int) -> None:
        self.root = root.rstrip("/") or "/"
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgw-direct")

    async def read_all(self, jobs: Iterable[tuple[Location, Destination]]) -> list[ReadResult]:
        """Read every job (at most ``threads`` at a time); results in job order.

        Each read is submitted as soon as its job is drawn from ``jobs``, so a generator that takes each
        destination as it yields (an allocation: tens of microseconds in LMCache's pool) overlaps that
        work with the reads already running. The loop is woken once, when the last read has ended, not
        once per read: each wake-up costs the loop thread a turn at the GIL while the readers need it.

        The threads write into the caller's buffers, which the caller frees or reuses as soon as this
        returns or raises. So it never leaves a read running behind it: when cancelled, or when drawing
        a job raises, reads not yet started are dropped and running ones are waited for (one chunk
        read: milliseconds) before the exception propagates.
        """
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        futures: list[cf.Future[ReadResult]] = []
        unfinished = _Countdown(lambda: loop.call_soon_threadsafe(_resolve, finished))
        try:
            for loc, dest in jobs:
                unfinished.add()
                try:
                    future = self._pool.submit(self.read_into, loc, dest)
                except RuntimeError:  # the pool is shut down: the client is closing
                    unfinished.done()
                    cf.wait(futures)
                    return [ReadResult.UNREADABLE] * (len(futures) + 1 + sum(1 for _ in jobs))
                futures.append(future)
                future.add_done_callback(unfinished.done)
            if not futures:
                return []
            unfinished.done()  # the count the drawing held: from here on, the last read wakes the loop
            await finished
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise
        return [f.result() for f in futures]

    def read_into(self, loc: Location, dest: Destination) -> ReadResult:
        assert loc.path is not None
        try:
            fd = os.open(f"{self.root}/{loc.path}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return ReadResult.UNREADABLE
        try:
            if os.fstat(fd).st_size < loc.size:
                return ReadResult.UNREADABLE
            hasher = xxhash.xxh3_64()
            pos = 0
            for view in destination_views(dest):
                for start in range(0, len(view), _SLICE):
                    piece = view[start : start + _SLICE]
                    if not _pread_exact(fd, piece, pos):
                        return ReadResult.UNREADABLE
                    hasher.update(piece)
                    pos += len(piece)
        except OSError:
            return ReadResult.UNREADABLE
        finally:
            os.close(fd)
        if pos != loc.size:
            return ReadResult.UNREADABLE
        return ReadResult.OK if hasher.intdigest() == loc.checksum else ReadResult.MISMATCH

    def close(self) -> None:
        self._pool.shutdown(wait=False)  # reads already queued finish: their buffers are still lent out


class _Countdown:
    """Calls ``at_zero`` once, in whichever thread takes the count from one to zero. Starts at one (held
    by whoever adds), so it cannot reach zero before every ``add`` has been made."""

    def __init__(self, at_zero: Callable[[], object]) -> None:
        self._count = 1
        self._lock = threading.Lock()
        self._at_zero = at_zero

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def done(self, _future: object = None) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._at_zero()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled meanwhile: the waiter is gone
        future.set_result(None)


def _pread_exact(fd: int, view: memoryview, pos: int) -> bool:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n == 0:
            return False
        done += n
    return True
