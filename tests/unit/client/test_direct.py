"""DirectReader on real files: verification, and that it never leaves a read writing into a caller's
buffer after it returns."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvgw_client.direct import DirectReader, Location, ReadResult
from kvgw_client.framing import Destination


def test_reads_verify_size_and_checksum(tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + b"footer bytes are not part of the chunk"
    (tmp_path / "c").write_bytes(data)
    size = 3 << 20
    reader = DirectReader(str(tmp_path), 2)
    try:
        buf = bytearray(size)
        ok = Location(size, xxhash.xxh3_64_intdigest(data[:size]), "c")
        assert reader.read_into(ok, memoryview(buf)) is ReadResult.OK and buf == data[:size]
        split = [memoryview(bytearray(100)), memoryview(bytearray(size - 100))]  # header + tensor
        assert reader.read_into(ok, split) is ReadResult.OK and bytes(split[0]) + bytes(split[1]) == data[:size]
        assert reader.read_into(Location(size, ok.checksum ^ 1, "c"), memoryview(buf)) is ReadResult.MISMATCH
        too_long = Location(len(data) + 1, 0, "c")
        assert reader.read_into(too_long, memoryview(bytearray(len(data) + 1))) is ReadResult.UNREADABLE
        assert reader.read_into(Location(1, 0, "absent"), memoryview(bytearray(1))) is ReadResult.UNREADABLE
    finally:
        reader.close()


class HeldReader(DirectReader):
    """Holds every read in flight until ``release`` is set; ``ended`` lists the reads that finished."""

    def __init__(self, root: str, threads: int) -> None:
        super().__init__(root, threads)
        self.started, self.release = threading.Event(), threading.Event()
        self.ended: list[ReadResult] = []

    def read_into(self, loc: Location, dest: Destination) -> ReadResult:
        self.started.set()
        assert self.release.wait(60), "never released"
        self.ended.append(super().read_into(loc, dest))
        return self.ended[-1]


async def test_cancelled_batch_waits_for_the_read_in_flight(tmp_path: Path) -> None:
    """The caller frees its buffers once read_all is cancelled: a thread still writing into them would
    corrupt whatever they hold next. The read is held in flight (on an event, not a timer) until the
    cancellation has been delivered; read_all must not return before it ended."""
    data = os.urandom(4)
    (tmp_path / "c").write_bytes(data)
    reader = HeldReader(str(tmp_path), 1)
    try:
        task = asyncio.ensure_future(reader.read_all([(Location(4, xxhash.xxh3_64_intdigest(data), "c"),
                                                       memoryview(bytearray(4)))]))
        assert await asyncio.to_thread(reader.started.wait, 60), "the read never started"
        # cancelled while the read runs; released from another thread, since the cancelled read_all
        # blocks the loop until its read is done
        threading.Timer(0.1, reader.release.set).start()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reader.ended == [ReadResult.OK]  # returned only after the read ended
    finally:
        reader.release.set()
        reader.close()


def _chunks(tmp_path: Path, count: int, size: int = 4096) -> list[tuple[Location, bytes]]:
    out = []
    for i in range(count):
        data = os.urandom(size)
        (tmp_path / f"c{i}").write_bytes(data)
        out.append((Location(size, xxhash.xxh3_64_intdigest(data), f"c{i}"), data))
    return out


async def test_reads_start_while_later_jobs_are_still_being_drawn(tmp_path: Path) -> None:
    """A job is read as soon as it is drawn: the generator here draws the second job only after the first
    read has ended, which would never happen if read_all drew every job before reading any. Results come
    back in job order, one per job, each with its own verdict."""
    chunks = _chunks(tmp_path, 3)
    first_read = threading.Event()
    buffers = [bytearray(4096) for _ in chunks]

    class Watched(DirectReader):
        def read_into(self, loc: Location, dest: Destination) -> ReadResult:
            result = super().read_into(loc, dest)
            first_read.set()
            return result

    watched = Watched(str(tmp_path), 2)

    def draw() -> Iterator[tuple[Location, Destination]]:
        yield chunks[0][0], memoryview(buffers[0])
        assert first_read.wait(60), "the first job was not read before the second was drawn"
        yield Location(4096, chunks[1][0].checksum ^ 1, "c1"), memoryview(buffers[1])
        yield Location(4096, 0, "absent"), memoryview(buffers[2])

    try:
        results = await watched.read_all(draw())
        assert results == [ReadResult.OK, ReadResult.MISMATCH, ReadResult.UNREADABLE]
        assert buffers[0] == chunks[0][1]
        assert await watched.read_all(iter([])) == []
    finally:
        watched.close()


async def test_a_failure_while_drawing_waits_for_the_reads_already_running(tmp_path: Path) -> None:
    """Taking a destination can fail (the caller's allocator): the reads already running write into
    buffers the caller frees when the error reaches it, so read_all lets it through only after they ended."""
    chunks = _chunks(tmp_path, 1)
    reader = HeldReader(str(tmp_path), 1)

    def draw() -> Iterator[tuple[Location, Destination]]:
        yield chunks[0][0], memoryview(bytearray(4096))
        assert reader.started.wait(60), "the read never started"
        threading.Timer(0.1, reader.release.set).start()
        raise MemoryError("the pool is exhausted")

    try:
        with pytest.raises(MemoryError):
            await reader.read_all(draw())
        assert reader.ended == [ReadResult.OK]
    finally:
        reader.release.set()
        reader.close()


async def test_a_closed_reader_answers_every_job_unreadable(tmp_path: Path) -> None:
    chunks = _chunks(tmp_path, 2)
    reader = DirectReader(str(tmp_path), 1)
    reader.close()
    jobs = iter([(loc, memoryview(bytearray(4096))) for loc, _ in chunks])
    assert await reader.read_all(jobs) == [ReadResult.UNREADABLE] * 2
