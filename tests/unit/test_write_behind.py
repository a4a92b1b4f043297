"""The write-behind sink's arena and writer (``gateway.bench.baselines.WriteBehind``): what it
acknowledged reaches its file whole, and the arena bounds what waits unwritten."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from gateway.bench.baselines import WriteBehind

MiB = 1 << 20


def test_bodies_reach_their_files_and_slots_come_back(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "f").mkdir()
    behind = WriteBehind(str(tmp_path / "s"), str(tmp_path / "f"), 4 * MiB)
    bodies = [os.urandom(2 * MiB + 4096 * i + 17) for i in range(3)]  # unaligned tails go buffered
    paths = []
    for i, body in enumerate(bodies):
        slot = behind.slot(len(body))
        slot[: len(body)] = body
        paths.append(behind.write(f"c{i}", slot, len(body)))
    for path, body in zip(paths, bodies, strict=True):
        behind.written(path)
        assert Path(path).read_bytes() == body
    assert not list((tmp_path / "s").iterdir())  # no temp file left behind


def test_a_full_arena_waits_for_the_writer(tmp_path: Path) -> None:
    """Two 2 MiB slots fill a 4 MiB arena: a third waits until the writer frees one."""
    (tmp_path / "s").mkdir()
    (tmp_path / "f").mkdir()
    behind = WriteBehind(str(tmp_path / "s"), str(tmp_path / "f"), 4 * MiB)
    held = [behind.slot(2 * MiB), behind.slot(2 * MiB)]
    got: list[memoryview] = []
    waiter = threading.Thread(target=lambda: got.append(behind.slot(2 * MiB)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # no room: still waiting
    held[0][:] = b"x" * (2 * MiB)
    path = behind.write("a", held[0], 2 * MiB)
    waiter.join(10)
    assert got and not waiter.is_alive()
    behind.written(path)
    assert Path(path).read_bytes() == b"x" * (2 * MiB)
