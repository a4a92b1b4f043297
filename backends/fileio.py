"""Small POSIX write helpers shared by the filesystem tier, the multipart staging area and the raw
write baseline of ``kvgw bench io`` (which must do exactly what the tier does to be a fair baseline)."""

from __future__ import annotations

import os


def write_all(fd: int, pieces: list[bytes | memoryview]) -> None:
    """Write every piece, in order, with as few ``writev`` calls as the kernel allows."""
    views = [memoryview(p) for p in pieces if len(p)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a new name, a removed one) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
