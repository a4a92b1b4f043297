"""The LMDB hot index on a real LMDB file."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from backends.errors import IndexError_
from backends.index import ChunkIndex, IndexEntry, filesystem_type
from backends.tiers import TierId
from kvgw_client.keys import chunk_digest


def entry(key: str, size: int = 10, expires: float = 0.0) -> IndexEntry:
    return IndexEntry("kvcache", key, size, 0xABCDEF, 1000.0, expires, 1000.0, 0, TierId.FS)


async def test_put_get_delete_and_expiry(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    try:
        d1, d2 = chunk_digest("kvcache", "a"), chunk_digest("kvcache", "b")
        await index.put(d1, entry("a"))
        await index.put(d2, entry("b", expires=50.0))
        assert index.get(d1) == entry("a")
        assert index.alive_many([d1, d2], now=10.0) == [True, True]
        assert index.alive_many([d1, d2], now=60.0) == [True, False]
        assert index.alive_prefix([d1, d2, d1], now=60.0) == 1
        assert await index.delete(d1) == entry("a")
        assert index.get(d1) is None and await index.delete(d1) is None
    finally:
        index.close()


async def test_alive_reads_answer_like_full_entries(tmp_path: Path) -> None:
    """alive_many / alive_prefix decode only the expiry; they must agree with get() + alive()."""
    index = ChunkIndex(tmp_path / "idx")
    try:
        keys = {"never": 0.0, "later": 2000.0, "now": 1500.0, "past": 1000.5}
        digests = {k: chunk_digest("kvcache", k) for k in [*keys, "absent"]}
        await index.put_many((digests[k], entry(k, expires=e)) for k, e in keys.items())
        order = ["never", "later", "absent", "now", "past", "never"]
        batch = [digests[k] for k in order]
        expected = []
        for d in batch:
            full = index.get(d)
            expected.append(full is not None and full.alive(1500.0))
        assert expected == [True, True, False, False, False, True]
        assert index.alive_many(batch, now=1500.0) == expected
        assert index.alive_many([], now=1500.0) == []
        assert index.alive_prefix(batch, now=1500.0) == 2  # stops at the absent key
        assert index.alive_prefix(batch[3:], now=1500.0) == 0  # expiring exactly now is expired
        assert index.alive_prefix(batch[3:], now=999.0) == 3
        assert index.alive_prefix([digests["never"]] * 3, now=1e12) == 3
        assert index.alive_prefix([], now=0.0) == 0
    finally:
        index.close()


async def test_alive_reads_follow_expiry_changes(tmp_path: Path) -> None:
    """While the soonest expiry lies ahead the records' expiries are not decoded: the expiry order
    must follow every change, or an expired chunk would answer as alive."""
    index = ChunkIndex(tmp_path / "idx")
    try:
        a, b = chunk_digest("kvcache", "a"), chunk_digest("kvcache", "b")
        await index.put_many([(a, entry("a", expires=100.0)), (b, entry("b", expires=300.0))])
        assert index.alive_many([a, b], now=50.0) == [True, True]  # soonest (100) ahead
        assert index.alive_many([a, b], now=200.0) == [False, True]
        assert (index.alive_prefix([b, a], now=50.0), index.alive_prefix([b, a], now=200.0)) == (2, 1)
        await index.put(a, entry("a", expires=400.0))  # a rewritten with a later expiry
        assert index.alive_many([a, b], now=200.0) == [True, True]
        assert index.alive_many([a, b], now=350.0) == [True, False]
        await index.put(b, entry("b"))  # b now never expires
        assert index.alive_many([a, b], now=350.0) == [True, True]
        assert index.alive_many([a, b], now=500.0) == [False, True]
        await index.delete(a)
        assert index.alive_many([a, b], now=500.0) == [False, True]  # no expiring chunk left
        assert index.alive_prefix([b, a], now=500.0) == 1
        await index.put(a, entry("a", expires=450.0))  # a new expiring chunk, already due
        assert index.alive_many([a, b], now=500.0) == [False, True]
    finally:
        index.close()


async def test_map_grows_instead_of_failing(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx", map_size=64 * 1024)
    try:
        start = index.env.info()["map_size"]
        digests = [chunk_digest("kvcache", f"k{i}") for i in range(5000)]
        await asyncio.gather(*(index.put(d, entry(f"k{i}" + "x" * 200)) for i, d in enumerate(digests)))
        assert index.env.info()["map_size"] > start
        assert index.count() == 5000
        assert all(index.alive_many(digests, now=0.0))
    finally:
        index.close()


async def test_touches_are_batched_into_one_transaction(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx", touch_interval=3600)
    try:
        d = chunk_digest("kvcache", "a")
        await index.put(d, entry("a"))
        txn_before = index.env.info()["last_txnid"]
        for t in range(100):
            index.touch(d, 2000.0 + t)
        assert index.get(d).hits == 0  # nothing written per read
        await index.flush()
        assert index.env.info()["last_txnid"] == txn_before + 1
        got = index.get(d)
        assert got is not None and got.hits == 100 and got.last_access == 2099.0
    finally:
        index.close()


async def test_state_survives_reopen_and_stale_readers_are_cleared(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "idx")
    d = chunk_digest("kvcache", "a")
    await index.put(d, entry("a"))
    index.close()
    path = str(tmp_path / "idx")
    # Stale slots only survive while another process keeps the environment open (the first opener
    # resets the lock table), so: a holder process, and a reader that dies inside a transaction.
    holder = await asyncio.create_subprocess_exec(sys.executable, "-c", HOLD.format(path=path),
                                                  stdout=asyncio.subprocess.PIPE)
    assert holder.stdout is not None and (await holder.stdout.readline()).strip() == b"ready"
    dead = await asyncio.create_subprocess_exec(sys.executable, "-c", DIE_READING.format(path=path),
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await dead.communicate()
    assert dead.returncode == 0
    dead_pid = out.decode().strip()
    try:
        reopened = ChunkIndex(tmp_path / "idx")
        try:
            assert reopened.get(d) == entry("a")
            assert dead_pid not in reopened.env.readers()  # cleared at start
        finally:
            reopened.close()
    finally:
        holder.kill()
        await holder.wait()


HOLD = """
import lmdb, time
env = lmdb.open({path!r}, max_dbs=8)
print("ready", flush=True)
time.sleep(60)
"""

DIE_READING = """
import lmdb, os
env = lmdb.open({path!r}, max_dbs=8)
txn = env.begin()
txn.get(b"x")
assert str(os.getpid()) in env.readers()
print(os.getpid(), flush=True)
os._exit(0)
"""


def test_refuses_a_network_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("backends.index.filesystem_type", lambda path: "nfs4")
    with pytest.raises(IndexError_, match="network filesystem"):
        ChunkIndex(tmp_path / "idx")


def test_filesystem_type_reads_the_real_mount_table(tmp_path: Path) -> None:
    assert filesystem_type(tmp_path) not in ("", "unknown")
    assert filesystem_type(Path("/proc/self")) == "proc"
