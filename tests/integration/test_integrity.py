"""Checksums on read, quarantine, scrub and index rebuild, on real files and a real server."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import httpx
import lmdb
import pytest

from gateway.cli import main as kvgw
from kvgw_client import wire
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess


def chunk_path(server: ServerProcess, key: str, fs_root: Path | None = None) -> Path:
    name = chunk_digest("kvcache", key).hex()
    return (fs_root or server.data_dir / "fs") / "chunks" / name[:2] / name[2:4] / name


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kvgw(list(args))
    return code, out.getvalue()


@pytest.mark.parametrize("size", [100_000, 40 << 20])  # whole read / streamed with a verify pass
def test_corrupt_chunk_is_quarantined_never_served(client: httpx.Client, server: ServerProcess, size: int) -> None:
    data = os.urandom(size)
    assert client.put(server.chunk_url("k"), content=data).status_code == 201
    flip_byte(chunk_path(server, "k"), size // 2)
    for headers in ({"Range": "bytes=0-9"}, {}):
        r = client.get(server.chunk_url("k"), headers=headers)
        assert r.status_code == 404, headers
        assert r.json()["error"]["code"] == "NoSuchChunk"
    assert not chunk_path(server, "k").exists()
    assert len(list((server.data_dir / "fs" / "quarantine").iterdir())) == 1
    assert client.post(f"{server.url}/v1/buckets/kvcache/exists", json={"keys": ["k"]}).json() == {"exists": [False]}
    assert client.put(server.chunk_url("k"), content=data).status_code == 201  # writable again
    assert client.get(server.chunk_url("k")).content == data


def test_batch_get_marks_a_corrupt_chunk_missing(client: httpx.Client, server: ServerProcess) -> None:
    blobs = {k: os.urandom(50_000) for k in "abc"}
    for k, v in blobs.items():
        client.put(server.chunk_url(k), content=v)
    flip_byte(chunk_path(server, "b"), 10)
    r = client.post(f"{server.url}/v1/buckets/kvcache/batch-get", json={"keys": list("abc")})
    frames = list(wire.BatchParser().feed(r.content))
    assert [f.status for f in frames] == [wire.FRAME_OK, wire.FRAME_MISSING, wire.FRAME_OK]
    assert frames[0].payload == blobs["a"] and frames[2].payload == blobs["c"]


def test_unverified_reads_are_a_setting(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_VERIFY_READS": "false"}).start()
    with httpx.Client(headers=server.auth) as c:
        c.put(server.chunk_url("k"), content=b"0123456789")
        flip_byte(chunk_path(server, "k"), 0)
        r = c.get(server.chunk_url("k"))
    assert r.status_code == 200 and r.content != b"0123456789"  # the documented trade-off


def test_stale_index_entry_is_corrected_not_quarantined(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    """B indexed v1; A deleted it and wrote v2. B's checksum mismatch is its index's fault."""
    shared = tmp_path / "shared"
    a = server_factory(data_dir=tmp_path / "a", env={"KVGW_FS_ROOT": str(shared)}).start()
    b = server_factory(data_dir=tmp_path / "b", env={"KVGW_FS_ROOT": str(shared)}).start()
    v1, v2 = os.urandom(1000), os.urandom(1000)
    with httpx.Client(headers=a.auth) as ca, httpx.Client(headers=b.auth) as cb:
        ca.put(a.chunk_url("k"), content=v1)
        assert cb.get(b.chunk_url("k")).content == v1
        assert ca.delete(a.chunk_url("k")).status_code == 204
        assert ca.put(a.chunk_url("k"), content=v2).status_code == 201
        assert cb.get(b.chunk_url("k")).content == v2
    assert list((shared / "quarantine").iterdir()) == []


def test_scrub_reconciles_index_and_tier(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    a = server_factory(data_dir=tmp_path / "a", env={"KVGW_FS_ROOT": str(shared)}).start()
    b = server_factory(data_dir=tmp_path / "b", env={"KVGW_FS_ROOT": str(shared)}).start()
    with httpx.Client(headers=a.auth) as ca, httpx.Client(headers=b.auth) as cb:
        for k in ("good", "corrupt", "gone"):
            ca.put(a.chunk_url(k), content=os.urandom(10_000))
        cb.put(b.chunk_url("orphan"), content=b"written by b, never seen by a")
    a.stop()
    flip_byte(chunk_path(a, "corrupt", shared), 5)
    chunk_path(a, "gone", shared).unlink()
    (shared / "chunks" / "ff" / "ff").mkdir(parents=True, exist_ok=True)
    (shared / "chunks" / "ff" / "ff" / ("ff" * 16)).write_bytes(b"no footer at all")

    env = {"KVGW_FS_ROOT": str(shared), "KVGW_ROOT_ACCESS_KEY": "x", "KVGW_ROOT_SECRET_KEY": "y"}
    with _env(env):
        code, out = run_cli("scrub", "--dry-run", "--data-dir", str(a.data_dir))
        assert code == 1
        report = json.loads(out.strip().splitlines()[-1])
        assert report == {"chunks": 4, "verified_bytes": 10_000 + 29, "reindexed": 1, "dangling": 1,
                          "corrupt": 2, "misplaced": 0}
        assert chunk_path(a, "corrupt", shared).exists()  # dry run changed nothing
        code, out = run_cli("scrub", "--data-dir", str(a.data_dir))
        assert code == 0
        code, out = run_cli("scrub", "--dry-run", "--data-dir", str(a.data_dir))
        report = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and report["corrupt"] == report["dangling"] == report["reindexed"] == 0
        assert report["chunks"] == 2
    assert len(list((shared / "quarantine").iterdir())) == 2


def test_index_rebuild_from_the_tier(client: httpx.Client, server: ServerProcess) -> None:
    keys = [f"model@1@0@{i:x}@bf16" for i in range(20)]
    for k in keys:
        client.put(server.chunk_url(k), content=k.encode(), headers={"X-Kvgw-TTL": "3600"})
    server.stop()
    shutil.rmtree(server.data_dir / "index")
    with _env({"KVGW_ROOT_ACCESS_KEY": "x", "KVGW_ROOT_SECRET_KEY": "y"}):
        code, out = run_cli("index", "rebuild", "--data-dir", str(server.data_dir))
    assert code == 0 and "20 chunks" in out
    env = lmdb.open(str(server.data_dir / "index"), max_dbs=8)
    with env.begin() as txn:
        chunks = env.open_db(b"chunks", txn=txn)
        assert txn.stat(chunks)["entries"] == 20
    env.close()
    server.start()
    with httpx.Client(headers=server.auth) as c:
        assert c.post(f"{server.url}/v1/buckets/kvcache/prefix", json={"keys": keys}).json() == {"length": 20}
        assert c.get(server.chunk_url(keys[7])).content == keys[7].encode()


@contextlib.contextmanager
def _env(values: dict[str, str]):  # type: ignore[no-untyped-def]
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
