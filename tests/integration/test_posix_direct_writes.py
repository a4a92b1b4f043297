"""The filesystem tier's direct writes (``PosixTier(direct_writes=True)``, ``KVGW_FS_DIRECT_WRITES``): a
chunk's whole blocks go to the disk around the page cache and only its last partial block and footer
through it; the bytes that land are exactly the ones sent, whichever way they arrived; a filesystem
that refuses ``O_DIRECT`` gets buffered writes instead. Real directories on the test disk, real
syscalls, a real ``kvgw serve``; which pages the page cache holds is read with mincore(2)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
from pathlib import Path

import httpx
import pytest
import xxhash

from backends.base import ChunkMeta
from backends.fileio import DIRECT_ALIGN
from backends.posix import FOLIO_BYTES, PosixTier
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess
from tests.pagecache import cached_pages, file_bytes


async def store(tier: PosixTier, key: str, data: bytes, piece: int, *, threaded: bool) -> bytes:
    """``data`` staged in pieces of ``piece`` bytes (through ``write_now`` from one refilled buffer, as a
    threaded receive writes, or through ``write``) and published; its digest."""
    digest = chunk_digest("kvcache", key)
    staged = await tier.stage(digest)
    buffer = bytearray(piece)
    for at in range(0, len(data), piece):
        part = data[at:at + piece]
        if threaded:
            buffer[:len(part)] = part
            staged.write_now(memoryview(buffer)[:len(part)])
        else:
            await staged.write(part)
    meta = ChunkMeta(bucket="kvcache", key=key, size=len(data), checksum=xxhash.xxh3_64_intdigest(data), created=1.0)
    assert await staged.publish(meta)
    return digest


@pytest.mark.parametrize(("size", "piece", "threaded"), [
    (4 * FOLIO_BYTES + 12_345, FOLIO_BYTES, True),  # a threaded receive's pieces, a tail
    (4 * FOLIO_BYTES + 12_345, 1_000_003, False),  # the event loop's pieces, unaligned
    (2 * FOLIO_BYTES, FOLIO_BYTES, True),  # whole blocks only: the footer alone goes through the cache
    (3 * DIRECT_ALIGN + 1, 5_000, False),  # smaller than a folio: written at publish, still direct
])
async def test_direct_writes_leave_the_page_cache_out_and_the_bytes_exact(
        tmp_path: Path, size: int, piece: int, threaded: bool) -> None:
    data = random.Random(size + piece).randbytes(size)
    direct = PosixTier(tmp_path / "direct", fsync=True, direct_writes=True)
    buffered = PosixTier(tmp_path / "buffered", fsync=True)
    key = f"direct-{size}-{piece}"
    direct_digest = await store(direct, key, data, piece, threaded=threaded)
    buffered_digest = await store(buffered, key, data, piece, threaded=threaded)
    resident, pages = cached_pages(direct.path_for(direct_digest))
    assert resident <= 3, (resident, pages)  # the last partial block and the footer: at most 3 pages
    assert cached_pages(buffered.path_for(buffered_digest)) == (pages, pages)  # the control: all of it cached
    assert direct.direct_writes
    assert bytes(await direct.read(direct_digest, 0, size)) == data
    assert file_bytes(direct.path_for(direct_digest)) == file_bytes(buffered.path_for(buffered_digest))  # footer too
    await direct.close()
    await buffered.close()


async def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As some FUSE and NFS setups answer ``O_DIRECT`` (EINVAL, injected here into ``os.open``): the tier
    says so once and writes through the page cache from then on."""
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    tier = PosixTier(tmp_path / "tier", fsync=True, direct_writes=True)
    data = random.Random(3).randbytes(FOLIO_BYTES + 777)
    digest = await store(tier, "refused", data, FOLIO_BYTES, threaded=True)
    assert not tier.direct_writes
    resident, pages = cached_pages(tier.path_for(digest))
    assert resident == pages  # written through the page cache
    assert bytes(await tier.read(digest, 0, len(data))) == data
    digest = await store(tier, "refused-2", data, 65_536, threaded=False)
    assert bytes(await tier.read(digest, 0, len(data))) == data
    await tier.close()


async def test_a_filesystem_that_refuses_direct_writes_after_the_open_gets_them_buffered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``O_DIRECT`` descriptor whose writes fail with EINVAL (injected into ``os.pwrite`` for such
    descriptors, after a first block landed): the chunk is written through the page cache instead, whole
    and exact, and the tier stops writing directly."""
    real_pwrite = os.pwrite
    refused: list[int] = []

    def refusing_pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset > 0:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    tier = PosixTier(tmp_path / "tier", fsync=True, direct_writes=True)
    data = random.Random(5).randbytes(3 * FOLIO_BYTES + 99)
    digest = await store(tier, "refused-late", data, FOLIO_BYTES, threaded=True)
    assert refused and not tier.direct_writes
    assert file_bytes(tier.path_for(digest))[:len(data)] == data
    assert bytes(await tier.read(digest, 0, len(data))) == data
    await tier.close()


def test_a_gateway_with_direct_writes_serves_what_it_stored(server_factory: type[ServerProcess],
                                                             tmp_path: Path) -> None:
    """``KVGW_FS_DIRECT_WRITES=true`` end to end: PUTs above and below the size a thread receives, read
    back byte for byte, and by a restarted gateway."""
    server = server_factory(data_dir=tmp_path / "data", env={"KVGW_FS_DIRECT_WRITES": "true"}).start()
    sizes = {"big": 8 * FOLIO_BYTES // 2 + 5, "folio": FOLIO_BYTES, "small": 1000}
    bodies = {name: random.Random(size).randbytes(size) for name, size in sizes.items()}
    with httpx.Client(headers=server.auth, timeout=60) as client:
        for name, body in bodies.items():
            assert client.put(server.chunk_url(name), content=body).status_code in (200, 201)
        for name, body in bodies.items():
            assert client.get(server.chunk_url(name)).content == body
    server.stop()
    server.start()
    with httpx.Client(headers=server.auth, timeout=60) as client:
        for name, body in bodies.items():
            assert client.get(server.chunk_url(name)).content == body
