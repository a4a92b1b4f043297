"""``backends.fileio.start_writeback``: early writeback is wired to the kernel where it exists, and is
best effort everywhere (it can neither fail a write nor change a byte)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from backends import fileio


def test_on_linux_it_is_the_kernels_sync_file_range_and_elsewhere_nothing() -> None:
    assert (fileio._sync_file_range is not None) == sys.platform.startswith("linux")
    assert fileio._SYNC_FILE_RANGE_WRITE == 2  # <fcntl.h>: SYNC_FILE_RANGE_WRITE


def test_it_leaves_the_bytes_alone_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    data = os.urandom(3 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        fileio.write_all(fd, [data[: 2 << 20]])
        fileio.start_writeback(fd, 0, 2 << 20)
        fileio.write_all(fd, [data[2 << 20 :]])
        fileio.start_writeback(fd, 2 << 20, len(data) - (2 << 20))
        fileio.start_writeback(fd, 1 << 40, 4096)  # past the end: nothing to write back
        os.fsync(fd)
    finally:
        os.close(fd)
    fileio.start_writeback(fd, 0, 4096)  # a closed descriptor: the kernel says EBADF, nobody is told
    assert path.read_bytes() == data
