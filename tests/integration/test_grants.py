"""Bucket-scoped credentials on a live gateway: the delete grant, and credentials usable the moment the
CLI creates them (no waiting for the catalog refresh; these gateways refresh every 60 s)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("grants") / "data",
                           env={"KVGW_CATALOG_REFRESH_SECONDS": "60"}).start()
    yield server
    server.stop()


def cli(server: ServerProcess, *args: str) -> dict[str, Any]:
    """``kvgw ... --data-dir <the running gateway's>`` in a subprocess, as an operator runs it."""
    env = dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK, KVGW_LOG_LEVEL="warning")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--data-dir", str(server.data_dir)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return doc


def credential(server: ServerProcess, *flags: str) -> tuple[str, str]:
    doc = cli(server, "cred", "create", "--bucket", "kvcache", *flags)
    return doc["access_key"], doc["secret_key"]


def s3(server: ServerProcess, ak: str, sk: str) -> Any:
    return boto3.client("s3", endpoint_url=server.url, aws_access_key_id=ak, aws_secret_access_key=sk,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def native(server: ServerProcess, ak: str, sk: str) -> httpx.Client:
    return httpx.Client(base_url=f"{server.url}/v1/buckets/kvcache", timeout=30.0,
                        headers={"Authorization": f"Bearer {ak}:{sk}"})


def test_a_new_credential_works_at_once_on_both_apis(gateway: ServerProcess) -> None:
    for _ in range(3):
        ak, sk = credential(gateway, "--write")
        key = f"fresh/{uuid.uuid4().hex}"
        with native(gateway, ak, sk) as client:
            assert client.put(f"/chunks/{key}", content=b"x" * 100).status_code == 201
        ak, sk = credential(gateway, "--write")
        s3(gateway, ak, sk).put_object(Bucket="kvcache", Key=key + "-s3", Body=b"y" * 100)
        assert s3(gateway, ak, sk).get_object(Bucket="kvcache", Key=key)["Body"].read() == b"x" * 100


def test_unknown_keys_are_still_refused_quickly(gateway: ServerProcess) -> None:
    """Many requests with bogus keys at once: each waits for at most one shared catalog re-read."""
    started = time.monotonic()

    def attempt(i: int) -> int:
        with native(gateway, f"KVBOGUS{i:013d}", "nope") as client:
            return client.post("/exists", json={"keys": ["k"]}).status_code

    with cf.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(attempt, range(64)))
    assert set(statuses) == {401}
    assert time.monotonic() - started < 10
    with pytest.raises(ClientError) as refused:
        s3(gateway, "KVBOGUSS3KEY0000000", "nope").head_bucket(Bucket="kvcache")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


@pytest.fixture
def stored(gateway: ServerProcess) -> list[str]:
    keys = [f"del/{uuid.uuid4().hex}/{i}" for i in range(4)]
    with native(gateway, ROOT_AK, ROOT_SK) as client:
        for key in keys:
            assert client.put(f"/chunks/{key}", content=key.encode()).status_code == 201
    return keys


def test_write_does_not_imply_delete(gateway: ServerProcess, stored: list[str]) -> None:
    ak, sk = credential(gateway, "--write")
    client = s3(gateway, ak, sk)
    for call in (lambda: client.delete_object(Bucket="kvcache", Key=stored[0]),
                 lambda: client.delete_objects(Bucket="kvcache", Delete={"Objects": [{"Key": k} for k in stored]})):
        with pytest.raises(ClientError) as denied:
            call()
        assert denied.value.response["Error"]["Code"] == "AccessDenied"
        assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with native(gateway, ak, sk) as http:
        assert http.delete(f"/chunks/{stored[0]}").status_code == 403
    with native(gateway, ROOT_AK, ROOT_SK) as root:
        assert root.post("/exists", json={"keys": stored}).json() == {"exists": [True] * 4}


def test_hints_need_a_write_grant(gateway: ServerProcess, stored: list[str]) -> None:
    ak, sk = credential(gateway)  # read only
    with native(gateway, ak, sk) as http:
        refused = http.post("/hints", json={"hint": "pin", "keys": stored})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "AccessDenied"
        assert http.post("/exists", json={"keys": stored}).status_code == 200
    ak, sk = credential(gateway, "--write")
    with native(gateway, ak, sk) as http:
        assert http.post("/hints", json={"hint": "pin", "keys": stored}).json() == {"applied": 4}
        assert http.post("/hints", json={"hint": "unpin", "keys": stored}).json() == {"applied": 4}


def test_a_delete_grant_deletes(gateway: ServerProcess, stored: list[str]) -> None:
    ak, sk = credential(gateway, "--write", "--delete")
    client = s3(gateway, ak, sk)
    client.delete_object(Bucket="kvcache", Key=stored[0])
    result = client.delete_objects(Bucket="kvcache", Delete={"Objects": [{"Key": k} for k in stored[1:3]]})
    assert sorted(d["Key"] for d in result["Deleted"]) == sorted(stored[1:3])
    with native(gateway, ak, sk) as http:
        assert http.delete(f"/chunks/{stored[3]}").status_code == 204
        assert http.post("/exists", json={"keys": stored}).json() == {"exists": [False] * 4}
        keys = http.post("/list", json={"prefix": stored[0].rsplit("/", 1)[0] + "/"}).json()
        assert keys == {"keys": [], "truncated": False}


def test_a_delete_grant_is_per_bucket(gateway: ServerProcess) -> None:
    cli(gateway, "bucket", "create", "other-bucket")
    doc = cli(gateway, "cred", "create", "--bucket", "other-bucket", "--write", "--delete")
    with httpx.Client(base_url=gateway.url, timeout=30.0,
                      headers={"Authorization": f"Bearer {doc['access_key']}:{doc['secret_key']}"}) as http:
        assert http.put("/v1/buckets/other-bucket/chunks/a", content=b"a").status_code == 201
        assert http.delete("/v1/buckets/other-bucket/chunks/a").status_code == 204
    with native(gateway, ROOT_AK, ROOT_SK) as root:
        assert root.put("/chunks/not-yours", content=b"b").status_code in (200, 201)
    with native(gateway, doc["access_key"], doc["secret_key"]) as http:
        assert http.delete("/chunks/not-yours").status_code == 403
    listed = [json.loads(line) for line in subprocess.run(
        [sys.executable, "-m", "gateway.cli", "cred", "list", "--data-dir", str(gateway.data_dir), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env=dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK)).stdout.splitlines()]
    mine = next(c for c in listed if c["access_key"] == doc["access_key"])
    assert mine["grants"] == {"other-bucket": {"read": True, "write": True, "delete": True}}


def test_the_native_listing(gateway: ServerProcess) -> None:
    prefix = f"list/{uuid.uuid4().hex}/"
    keys = sorted(f"{prefix}{i:04d}" for i in range(25))
    ak, sk = credential(gateway)  # read only
    with native(gateway, ROOT_AK, ROOT_SK) as root:
        for key in keys:
            root.put(f"/chunks/{key}", content=b"z")
    with native(gateway, ak, sk) as http:
        first = http.post("/list", json={"prefix": prefix, "limit": 10}).json()
        assert first == {"keys": keys[:10], "truncated": True}
        rest = http.post("/list", json={"prefix": prefix, "after": keys[9], "limit": 1000}).json()
        assert rest == {"keys": keys[10:], "truncated": False}
        assert http.post("/list", json={"prefix": prefix, "limit": 0}).status_code == 400
        assert http.post("/list", json={"prefix": 3}).status_code == 400


def test_a_new_credential_works_at_once_on_every_gateway(
    pg_url: str, server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    """Two gateways sharing a PostgreSQL catalog (refreshing every 60 s): a credential the CLI creates
    through one gateway's settings is accepted by both at their very next request."""
    from cryptography.fernet import Fernet

    env = {"KVGW_CATALOG_URL": pg_url, "KVGW_CATALOG_KEY": Fernet.generate_key().decode(),
           "KVGW_CATALOG_REFRESH_SECONDS": "60"}
    first = server_factory(data_dir=tmp_path / "a", env=env).start()
    second = server_factory(data_dir=tmp_path / "b", env=env).start()
    cli_env = dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK, **env)
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "cred", "create", "--bucket", "kvcache", "--write",
                             "--data-dir", str(tmp_path / "cli")], capture_output=True, text=True, env=cli_env,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    for server in (first, second):
        with native(server, doc["access_key"], doc["secret_key"]) as client:
            assert client.put(f"/chunks/{uuid.uuid4().hex}", content=b"x").status_code == 201
        s3(server, doc["access_key"], doc["secret_key"]).head_bucket(Bucket="kvcache")
