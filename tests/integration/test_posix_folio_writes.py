"""The filesystem tier writes a chunk's bytes in whole, aligned ``FOLIO_BYTES`` pieces (so the page cache
builds 2 MiB folios, which reads map and copy far more cheaply), whatever sizes its caller's pieces
have, and the bytes that land are exactly the ones written. A real directory, real syscalls; the
writes are observed at ``write_all``, where the tier hands them to ``os.writev``."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import xxhash

from backends import fileio, posix
from backends.base import ChunkMeta
from backends.errors import StorageFull
from backends.posix import FOLIO_BYTES, PosixTier, split_at
from kvgw_client.keys import chunk_digest


def test_split_at_cuts_without_copying() -> None:
    data = bytes(range(10))
    pieces: list[bytes | memoryview] = [data[:3], data[3:7], data[7:]]
    for size in range(11):
        head, rest = split_at(pieces, size)
        assert b"".join(head) == data[:size]
        assert b"".join(rest) == data[size:]
    head, rest = split_at(pieces, 5)
    assert isinstance(head[-1], memoryview) and head[-1].obj is pieces[1]  # a view of the piece, not a copy


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(file offset, bytes) of every ``write_all`` the tier makes, as it makes them."""
    made: list[tuple[int, int]] = []
    real_write_all = fileio.write_all

    def recording_write_all(fd: int, pieces: list[bytes | memoryview]) -> None:
        made.append((os.lseek(fd, 0, os.SEEK_CUR), sum(len(p) for p in pieces)))
        real_write_all(fd, pieces)

    monkeypatch.setattr(posix, "write_all", recording_write_all)
    return made


@pytest.mark.parametrize("piece", [65_536, 1_000_003, 3 * FOLIO_BYTES + 7])
async def test_staged_bytes_reach_the_file_in_aligned_folio_pieces(tmp_path: Path, piece: int,
                                                                  writes: list[tuple[int, int]]) -> None:
    tier = PosixTier(tmp_path / "tier", fsync=False)
    data = random.Random(piece).randbytes(4 * FOLIO_BYTES + 12_345)
    digest = chunk_digest("kvcache", f"aligned-{piece}")
    staged = await tier.stage(digest)
    for at in range(0, len(data), piece):
        await staged.write(data[at:at + piece])
    meta = ChunkMeta(bucket="kvcache", key=f"aligned-{piece}", size=len(data),
                     checksum=xxhash.xxh3_64_intdigest(data), created=1.0)
    assert await staged.publish(meta)
    *body_writes, (last_offset, _) = writes  # the last write carries the tail and the footer
    assert body_writes, "a chunk larger than a folio is written while it is received"
    assert all(offset % FOLIO_BYTES == 0 and length % FOLIO_BYTES == 0 for offset, length in body_writes)
    assert last_offset == len(data) // FOLIO_BYTES * FOLIO_BYTES
    assert bytes(await tier.read(digest, 0, len(data))) == data
    await tier.close()


async def test_write_now_puts_a_threaded_receive_s_pieces_in_the_file_before_it_returns(
        tmp_path: Path, writes: list[tuple[int, int]]) -> None:
    """``write_now`` (a threaded receive's worker thread): each piece is in the file when it returns,
    so the caller may refill its buffer; whole folios land aligned, the tail and footer come with
    publish."""
    tier = PosixTier(tmp_path / "tier", fsync=False)
    data = random.Random(7).randbytes(3 * FOLIO_BYTES + 999)
    digest = chunk_digest("kvcache", "threaded")
    staged = await tier.stage(digest)
    buffer = bytearray(FOLIO_BYTES)  # one buffer, refilled for every piece as a threaded receive does
    for at in range(0, len(data), FOLIO_BYTES):
        piece = data[at:at + FOLIO_BYTES]
        buffer[:len(piece)] = piece
        staged.write_now(memoryview(buffer)[:len(piece)])
    buffer[:] = bytes(FOLIO_BYTES)  # nothing of what was written may still depend on the buffer
    meta = ChunkMeta(bucket="kvcache", key="threaded", size=len(data), checksum=xxhash.xxh3_64_intdigest(data),
                     created=1.0)
    assert await staged.publish(meta)
    assert writes[:3] == [(0, FOLIO_BYTES), (FOLIO_BYTES, FOLIO_BYTES), (2 * FOLIO_BYTES, FOLIO_BYTES)]
    assert bytes(await tier.read(digest, 0, len(data))) == data
    await tier.close()


async def test_write_now_turns_a_full_disk_into_storage_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, pieces: list[bytes | memoryview]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(posix, "write_all", full)
    tier = PosixTier(tmp_path / "tier", fsync=False)
    staged = await tier.stage(chunk_digest("kvcache", "full"))
    with pytest.raises(StorageFull):
        staged.write_now(b"x" * 10)
    await staged.discard()
    assert not list((tmp_path / "tier").rglob("*.part"))  # the staging file went with the discard
    await tier.close()
