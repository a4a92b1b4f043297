"""DirectReader on real files: verification, and that it never leaves a read writing into a caller's
buffer after it returns."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import xxhash

from kvgw_client.direct import Destination, DirectReader, Location, ReadResult


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


async def test_cancelled_batch_waits_for_the_read_in_flight(tmp_path: Path) -> None:
    """The caller frees its buffers once read_all is cancelled: a thread still writing into them would
    corrupt whatever they hold next. The read is held in flight (on an event, not a timer) until the
    cancellation has been delivered; read_all must not return before it ended."""
    data = os.urandom(4)
    (tmp_path / "c").write_bytes(data)
    started, release = threading.Event(), threading.Event()
    ended: list[ReadResult] = []

    class HeldReader(DirectReader):
        def read_into(self, loc: Location, dest: Destination) -> ReadResult:
            started.set()
            assert release.wait(60), "never released"
            ended.append(super().read_into(loc, dest))
            return ended[-1]

    reader = HeldReader(str(tmp_path), 1)
    try:
        task = asyncio.ensure_future(reader.read_all([(Location(4, xxhash.xxh3_64_intdigest(data), "c"),
                                                       memoryview(bytearray(4)))]))
        assert await asyncio.to_thread(started.wait, 60), "the read never started"
        # cancelled while the read runs; released from another thread, since the cancelled read_all
        # blocks the loop until its read is done
        threading.Timer(0.1, release.set).start()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended == [ReadResult.OK]  # returned only after the read ended
    finally:
        release.set()
        reader.close()
