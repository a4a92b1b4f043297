"""Nothing fills the disk by default: a new bucket's fs capacity comes from the filesystem it lives on,
and the banner and ``kvgw bucket list`` say what the lifecycle will do."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import httpx
import pytest

from gateway.buckets import filesystem_size
from gateway.cli import main as kvgw
from tests.conftest import ServerProcess, wait_for


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvgw(list(args))
    return code, out.getvalue(), err.getvalue()


def test_default_bucket_capacity_is_ninety_percent_of_the_filesystem(
    server_factory: type[ServerProcess], tmp_path: Path, small_fs: Path
) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_FS_ROOT": str(small_fs)}).start()
    expected = int(filesystem_size(small_fs) * 0.9)
    assert "bucket kvcache: above 90% of" in server.log()
    code, out, _ = run("bucket", "list", "--data-dir", str(tmp_path / "d"), "--json")
    (doc,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and doc["capacity_bytes"] == expected
    assert "chunks are evicted in default order" in doc["lifecycle"]
    # and it is enforced: writing past it evicts older chunks (a burst faster than a lifecycle pass may
    # meet a full disk first; then the write is retried once the pass has made room)
    with httpx.Client(headers=server.auth, timeout=30) as client:
        for i in range(12):
            body = os.urandom(1 << 20)
            wait_for(lambda i=i, body=body: client.put(server.chunk_url(f"fill-{i}"), content=body).status_code
                     in (200, 201), f"chunk {i} stored")
        assert client.head(server.chunk_url("fill-11")).status_code == 200
        assert client.head(server.chunk_url("fill-0")).status_code == 404  # evicted, not left to fill the disk


def test_capacity_fraction_zero_means_unbounded_and_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGW_DEFAULT_CAPACITY_FRACTION", "0")
    code, out, _ = run("bucket", "create", "open-ended", "--data-dir", str(tmp_path))
    doc = json.loads(out)
    assert code == 0 and doc["capacity_bytes"] is None
    assert "grows until the disk is full" in doc["lifecycle"]


def test_bucket_delete(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()  # buckets made before the first start: only `kvgw serve` creates a data dir
    assert run("bucket", "create", "scratch", "--data-dir", str(data))[0] == 0
    assert run("bucket", "create", "busy", "--data-dir", str(data))[0] == 0
    server = server_factory(data_dir=data).start()
    assert httpx.put(server.chunk_url("k", bucket="busy"), content=b"x", headers=server.auth).status_code == 201
    server.stop()
    code, out, _ = run("bucket", "delete", "scratch", "--data-dir", str(data))
    assert code == 0 and json.loads(out) == {"deleted": "scratch"}
    code, _, err = run("bucket", "delete", "busy", "--data-dir", str(data))
    assert code == 1 and "BucketNotEmpty" in err
    code, _, err = run("bucket", "delete", "nope", "--data-dir", str(data))
    assert code == 1 and "NoSuchBucket" in err
    listed = run("bucket", "list", "--data-dir", str(data), "--json")[1]
    names = [json.loads(line)["name"] for line in listed.splitlines()]
    assert names == ["busy", "kvcache"]
