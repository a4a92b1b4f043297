"""DirectReader on real files: verification, and that it never leaves a read writing into a caller's
buffer after it returns."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import xxhash

from gateway.client.direct import DirectReader, Location, ReadResult


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
    corrupt whatever they hold next. A FIFO holds the read open until another thread releases it."""
    os.mkfifo(tmp_path / "slow")
    reader = DirectReader(str(tmp_path), 1)
    task = asyncio.ensure_future(reader.read_all([(Location(4, 0, "slow"), memoryview(bytearray(4)))]))
    await asyncio.sleep(0.05)  # the read is now blocked in open() of the FIFO
    released_at: list[float] = []

    def release() -> None:
        time.sleep(0.2)
        released_at.append(time.monotonic())
        with open(tmp_path / "slow", "wb") as fifo:
            fifo.write(b"abcd")

    threading.Thread(target=release).start()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released_at and time.monotonic() >= released_at[0]  # returned only after the read ended
    reader.close()
