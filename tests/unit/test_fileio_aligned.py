"""Direct writes take pieces received into aligned memory as they are (``backends.fileio``): no copy
into the thread's bounce buffer; anything else still goes through it. On a real file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from backends import fileio
from backends.fileio import DIRECT_ALIGN, aligned_buffer, is_aligned, open_direct, write_direct
from tests.requirements import require_or_skip


def test_only_whole_aligned_writable_memory_counts_as_aligned() -> None:
    page = aligned_buffer(4 * DIRECT_ALIGN)
    assert is_aligned(page) and is_aligned(page[DIRECT_ALIGN:])
    assert not is_aligned(page[1 : DIRECT_ALIGN + 1])  # starts off a boundary
    assert not is_aligned(page[: DIRECT_ALIGN + 1])  # not whole blocks
    assert not is_aligned(bytes(DIRECT_ALIGN)) and not is_aligned(memoryview(bytes(DIRECT_ALIGN)))


def _write_in_fresh_thread(fd: int, pieces: list[bytes | memoryview]) -> bool:
    """``write_direct`` in a thread of its own; whether that thread made a bounce buffer."""
    made: list[bool] = []

    def run() -> None:
        write_direct(fd, pieces, 0)
        made.append(getattr(fileio._direct_buffers, "buffer", None) is not None)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return made[0]


def test_an_aligned_piece_is_written_without_the_bounce_buffer(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"")
    fd = open_direct(str(path))
    if fd is None:
        require_or_skip("the test directory's filesystem refuses O_DIRECT (the tier then writes buffered)")
    try:
        piece = aligned_buffer(8 * DIRECT_ALIGN)
        data = os.urandom(len(piece))
        piece[:] = data
        assert _write_in_fresh_thread(fd, [piece]) is False
        assert path.read_bytes() == data
        unaligned = [bytes(data[: 4 * DIRECT_ALIGN]), bytes(data[4 * DIRECT_ALIGN :])]  # Python's own buffers
        assert _write_in_fresh_thread(fd, unaligned) is True
        assert path.read_bytes() == data
    finally:
        os.close(fd)
