"""What the page cache holds of a file, for tests of writes that go around it (direct writes)."""

from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path: str) -> tuple[int, int]:
    """(pages of the file the page cache holds, pages of the file), by mincore(2) on a private mapping
    (which reads nothing in by itself)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = (size + PAGE - 1) // PAGE
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0, ctypes.get_errno()
        resident = sum(v & 1 for v in vector)
        del address  # the buffer export ends before the mapping closes
    return resident, pages


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
