"""Fixtures for the S3 API tests: a real ``kvgw serve`` process and real S3 clients pointed at it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess, require_or_skip

MiB = 1 << 20
MIN_PART = 5 * MiB


def boto3_client(url: str, *, style: str = "path", access_key: str = ROOT_AK, secret_key: str = ROOT_SK,
                 **config: Any) -> Any:
    return boto3.client(
        "s3", endpoint_url=url, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": style}, retries={"max_attempts": 1, "mode": "standard"}, **config),
    )


@pytest.fixture
def s3_server(server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "data", env={"KVGW_S3_API_BASE_DOMAIN": "localhost"}).start()


@pytest.fixture
def s3(s3_server: ServerProcess) -> Any:
    return boto3_client(s3_server.url)


@pytest.fixture
def native(s3_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=s3_server.url, headers=s3_server.auth, timeout=30.0) as c:
        yield c


def find_aws_cli() -> str | None:
    """The aws CLI: ``KVGW_AWS_CLI``, the venv ``.ci/run`` creates, or one on PATH."""
    venv = REPO / ".ci" / ".venv-awscli" / "bin" / "aws"
    candidates = [os.environ.get("KVGW_AWS_CLI"), str(venv), shutil.which("aws")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture
def aws(s3_server: ServerProcess, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    exe = find_aws_cli()
    if exe is None:
        require_or_skip("the aws CLI is not installed (.ci/run puts it in .ci/.venv-awscli)")
    assert exe is not None
    config = tmp_path / "aws-config"
    # s3v4 for presigned URLs too: the CLI presigns with SigV2 unless told, which kvgw refuses (InvalidRequest)
    config.write_text("[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n"
                      "    signature_version = s3v4\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ROOT_AK, AWS_SECRET_ACCESS_KEY=ROOT_SK, AWS_CONFIG_FILE=str(config),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"), AWS_EC2_METADATA_DISABLED="true")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([exe, "--endpoint-url", s3_server.url, *args], capture_output=True, text=True,
                                env=env, timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"aws {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    return run
