"""The aws CLI and aiobotocore, used as people use them, against a real ``kvgw serve``."""

from __future__ import annotations

import filecmp
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess

MiB = 1 << 20
Aws = Callable[..., subprocess.CompletedProcess[str]]


def test_aws_cli_round_trip(aws: Aws, tmp_path: Path) -> None:
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(300_000))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(21 * MiB))  # above the CLI's 8 MiB threshold: multipart, several parts
    aws("s3", "mb", "s3://cli-bucket")
    aws("s3", "cp", str(small), "s3://cli-bucket/dir/small.bin")
    up = aws("s3", "cp", str(big), "s3://cli-bucket/dir/big.bin")
    assert "upload:" in up.stdout
    listing = aws("s3", "ls", "s3://cli-bucket/dir/").stdout
    assert "small.bin" in listing and "big.bin" in listing and str(21 * MiB) in listing
    assert "PRE dir/" in aws("s3", "ls", "s3://cli-bucket").stdout
    down = aws("s3", "cp", "s3://cli-bucket/dir/big.bin", str(tmp_path / "big.out"))
    assert "warning" not in down.stderr.lower() and "error" not in down.stderr.lower()
    assert filecmp.cmp(big, tmp_path / "big.out", shallow=False)
    aws("s3", "cp", "s3://cli-bucket/dir/small.bin", str(tmp_path / "small.out"))
    assert filecmp.cmp(small, tmp_path / "small.out", shallow=False)
    sync_dir = tmp_path / "sync"
    aws("s3", "sync", "s3://cli-bucket/dir/", str(sync_dir))
    assert sorted(p.name for p in sync_dir.iterdir()) == ["big.bin", "small.bin"]
    url = aws("s3", "presign", "s3://cli-bucket/dir/small.bin", "--expires-in", "300").stdout.strip()
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == small.read_bytes()
    head = aws("s3api", "head-object", "--bucket", "cli-bucket", "--key", "dir/big.bin").stdout
    assert '"ContentLength": 22020096' in head
    failed = aws("s3", "rb", "s3://cli-bucket", check=False)
    assert failed.returncode != 0 and "BucketNotEmpty" in failed.stderr
    aws("s3", "rm", "s3://cli-bucket/dir/", "--recursive")
    assert aws("s3", "ls", "s3://cli-bucket/dir/", check=False).stdout == ""
    aws("s3", "rb", "s3://cli-bucket")
    missing = aws("s3api", "head-bucket", "--bucket", "cli-bucket", check=False)
    assert missing.returncode != 0 and "404" in missing.stderr


async def test_aiobotocore(s3_server: ServerProcess) -> None:
    from aiobotocore.session import get_session
    from botocore.config import Config

    session = get_session()
    async with session.create_client(
        "s3", endpoint_url=s3_server.url, region_name="us-east-1", aws_access_key_id=ROOT_AK,
        aws_secret_access_key=ROOT_SK, config=Config(s3={"addressing_style": "path"}),
    ) as s3:
        data = os.urandom(1_000_000)
        put = await s3.put_object(Bucket="kvcache", Key="aio/one", Body=data)
        got = await s3.get_object(Bucket="kvcache", Key="aio/one")
        async with got["Body"] as body:
            assert await body.read() == data
        assert got["ETag"] == put["ETag"]
        ranged = await s3.get_object(Bucket="kvcache", Key="aio/one", Range="bytes=10-19")
        async with ranged["Body"] as body:
            assert await body.read() == data[10:20]
        upload = await s3.create_multipart_upload(Bucket="kvcache", Key="aio/mp")
        parts: list[dict[str, Any]] = []
        chunks = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(100)]
        for number, chunk in enumerate(chunks, 1):
            part = await s3.upload_part(Bucket="kvcache", Key="aio/mp", UploadId=upload["UploadId"],
                                        PartNumber=number, Body=chunk)
            parts.append({"PartNumber": number, "ETag": part["ETag"]})
        await s3.complete_multipart_upload(Bucket="kvcache", Key="aio/mp", UploadId=upload["UploadId"],
                                           MultipartUpload={"Parts": parts})
        got = await s3.get_object(Bucket="kvcache", Key="aio/mp")
        async with got["Body"] as body:
            assert await body.read() == b"".join(chunks)
        listed = await s3.list_objects_v2(Bucket="kvcache", Prefix="aio/")
        assert [o["Key"] for o in listed["Contents"]] == ["aio/mp", "aio/one"]
        await s3.delete_object(Bucket="kvcache", Key="aio/one")
        listed = await s3.list_objects_v2(Bucket="kvcache", Prefix="aio/")
        assert [o["Key"] for o in listed["Contents"]] == ["aio/mp"]
