"""The filesystem tier's answer to a chunk its directory lists but a lookup does not find (what an NFS or
FUSE negative lookup cache does to a chunk another host just created), on a real directory: the name is
a dangling symlink, which ``listdir`` lists and ``open`` answers ENOENT to, as a stale negative lookup
does. Retries are paced by an injected clock and sleep; nothing here waits on the wall clock."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from backends import chunkfile
from backends.base import ChunkMeta
from backends.errors import ChunkHidden, ChunkNotFound, TierUnavailable
from backends.posix import PosixTier

DIGEST = bytes(range(16))


class FakeTime:
    """A clock that only sleeps move; ``on_sleep(n)`` runs at the n-th sleep (the file appearing...)."""

    def __init__(self, on_sleep: Callable[[int], None] = lambda n: None) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self._on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self._on_sleep(len(self.sleeps))


def _tier(tmp_path: Path, time: FakeTime) -> PosixTier:
    return PosixTier(tmp_path / "fs", fsync=False, visibility_seconds=2.0, clock=time.clock, sleep=time.sleep)


def _hide(tier: PosixTier) -> tuple[Path, Path]:
    """The chunk's name listed in its directory, pointing at a file that does not exist (yet)."""
    path = Path(tier.path_for(DIGEST))
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.parent / "elsewhere"
    path.symlink_to(target)
    return path, target


def _names(directory: Path) -> list[str]:
    return os.listdir(directory)


def _chunk_bytes(data: bytes) -> bytes:
    import xxhash

    return data + chunkfile.encode_footer(ChunkMeta("b", "k", len(data), xxhash.xxh3_64_intdigest(data), 1.0))


async def test_a_chunk_that_stays_hidden_is_chunk_hidden_after_the_visibility_window(tmp_path: Path) -> None:
    time = FakeTime()
    tier = _tier(tmp_path, time)
    _hide(tier)
    with pytest.raises(ChunkHidden) as exc:
        await tier.read(DIGEST, 0, 3)
    assert isinstance(exc.value, TierUnavailable)  # every caller retries it; none forgets the chunk
    assert sum(time.sleeps) == pytest.approx(2.0) and len(time.sleeps) > 3  # backoff, up to the window
    assert (tier.hidden_seen, tier.hidden_refused) == (1, 1)


async def test_a_chunk_that_becomes_visible_is_served(tmp_path: Path) -> None:
    data = b"chunk bytes"
    target: list[Path] = []
    time = FakeTime(lambda n: target[0].write_bytes(_chunk_bytes(data)) if n == 3 else None)
    tier = _tier(tmp_path, time)
    target.append(_hide(tier)[1])
    assert bytes(await tier.read(DIGEST, 0, len(data))) == data
    assert (await tier.stat(DIGEST)).size == len(data)
    assert len(time.sleeps) == 3 and (tier.hidden_seen, tier.hidden_refused) == (1, 0)


async def test_a_name_its_directory_does_not_list_is_not_found_at_once(tmp_path: Path) -> None:
    time = FakeTime()
    tier = _tier(tmp_path, time)
    with pytest.raises(ChunkNotFound):
        await tier.read(DIGEST, 0, 1)
    with pytest.raises(ChunkNotFound):
        await tier.stat(DIGEST)
    assert await tier.delete(DIGEST) is False
    assert time.sleeps == [] and tier.hidden_seen == 0


async def test_a_delete_waits_for_the_hidden_chunk_and_removes_it(tmp_path: Path) -> None:
    """A dangling symlink unlinks at once (its name is there); a hidden directory entry is what the
    retry is for: here the chunk's shard directory is the symlink, dangling until the third sleep."""
    tier_root = tmp_path / "fs"
    holder: list[Path] = []
    time = FakeTime(lambda n: holder[0].mkdir() if n == 3 else None)
    tier = PosixTier(tier_root, fsync=False, visibility_seconds=2.0, clock=time.clock, sleep=time.sleep)
    shard = Path(tier.path_for(DIGEST)).parent
    shard.parent.mkdir(parents=True)
    real = tmp_path / "real-shard"
    holder.append(real)
    shard.symlink_to(real)
    assert await tier.delete(DIGEST) is False  # the directory appeared, without the chunk: not found
    assert len(time.sleeps) == 3 and tier.hidden_seen == 1
    (real / DIGEST.hex()).write_bytes(_chunk_bytes(b"x"))
    assert await tier.delete(DIGEST) is True
    assert DIGEST.hex() not in _names(real)


async def test_a_scan_meeting_a_hidden_chunk_raises_instead_of_skipping_it(tmp_path: Path) -> None:
    """A resync or scrub must not take a listed chunk for absent (it would drop it from the index)."""
    tier = PosixTier(tmp_path / "fs", fsync=False, visibility_seconds=0.05)
    _hide(tier)
    with pytest.raises(ChunkHidden):
        async for _ in tier.scan():
            pass
