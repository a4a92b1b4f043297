"""A full filesystem tier (a real 8 MiB tmpfs): every failed write leaves no staging file and no open
descriptor in the server, for native PUTs, S3 PutObject and CreateMultipartUpload alike."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess
from tests.integration.s3api.conftest import boto3_client

MiB = 1 << 20

DISK_ONLY = {"KVGW_DEFAULT_CAPACITY_FRACTION": "0"}
"""No default capacity: these tests are about the disk itself filling up, not eviction."""


def open_files_under(server: ServerProcess, root: Path) -> list[str]:
    """Paths under ``root`` that the server's processes hold open (from /proc/PID/fd)."""
    held = []
    for pid in server.pids():
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith(str(root)):
                held.append(target)
    return held


def leftovers(root: Path) -> list[str]:
    """Anything in the tier's staging areas: chunk staging and multipart uploads."""
    found = [str(p) for p in (root / "staging").rglob("*") if p.is_file()]
    multipart = root / "multipart"
    if multipart.exists():
        found += [str(p) for p in multipart.rglob("*")]
    return found


@pytest.fixture
def full_server(server_factory: type[ServerProcess], tmp_path: Path, small_fs: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "d", env=DISK_ONLY | {"KVGW_FS_ROOT": str(small_fs)}).start()


@pytest.mark.parametrize("size", [1 * MiB, 2 * MiB, 2 * MiB + 12345])
def test_native_puts_until_full_leak_nothing(full_server: ServerProcess, small_fs: Path, size: int) -> None:
    statuses = []
    with httpx.Client(headers=full_server.auth, timeout=30) as client:
        for i in range(16):  # 8 MiB of tmpfs: some fit, then 507s
            statuses.append(client.put(full_server.chunk_url(f"fill-{size}-{i}"), content=os.urandom(size)).status_code)
    assert 201 in statuses and 507 in statuses, statuses
    assert leftovers(small_fs) == []
    assert open_files_under(full_server, small_fs) == []


def test_s3_put_object_until_full_leaks_nothing(full_server: ServerProcess, small_fs: Path) -> None:
    s3 = boto3_client(full_server.url)
    codes = []
    for i in range(8):
        try:
            s3.put_object(Bucket="kvcache", Key=f"s3-fill-{i}", Body=os.urandom(2 * MiB))
            codes.append("ok")
        except ClientError as exc:
            codes.append(exc.response["Error"]["Code"])
    assert "ok" in codes and any(code != "ok" for code in codes), codes
    assert leftovers(small_fs) == []
    assert open_files_under(full_server, small_fs) == []


def test_create_multipart_upload_on_a_full_disk_leaves_nothing(full_server: ServerProcess, small_fs: Path) -> None:
    ballast = small_fs / "ballast"
    with open(ballast, "wb") as out:  # fill the filesystem to the last byte
        try:
            while True:
                out.write(b"\0" * (64 << 10))
                out.flush()
        except OSError:
            pass
    s3 = boto3_client(full_server.url)
    try:
        with pytest.raises(ClientError) as info:
            s3.create_multipart_upload(Bucket="kvcache", Key="mpu-on-full")
        # the S3 API answers a full disk as S3 servers do, 503 ServiceUnavailable (clients retry it)
        assert info.value.response["Error"]["Code"] == "ServiceUnavailable"
        assert leftovers(small_fs) == []
        assert open_files_under(full_server, small_fs) == []
    finally:
        ballast.unlink()
