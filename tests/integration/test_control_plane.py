"""The control plane (``/healthz``, ``/readyz``, ``/metrics``, ``/v1/admin/*``) answers like the data
plane: a credential works there the moment ``kvgw cred create`` returns, every response carries a
request id, and the probes answer ``HEAD``. Through real HTTP to a real ``kvgw serve``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import boto3
import httpx
import pytest

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess

NEVER = {"KVGW_CATALOG_REFRESH_SECONDS": "3600"}
"""No periodic catalog refresh during a test: what works, works without it."""


@pytest.fixture
def gateway(server_factory: type[ServerProcess], tmp_path: Any) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "data", env=NEVER).start()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway for the read-only checks of this module."""
    with ServerProcess(data_dir=tmp_path_factory.mktemp("control") / "data") as server:
        yield server


def cred_create(server: ServerProcess, *flags: str) -> tuple[str, str]:
    """``kvgw cred create FLAGS`` as an operator runs it, in a subprocess; (access key, secret)."""
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "cred", "create", *flags,
                             "--data-dir", str(server.data_dir)], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK},
                            timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    return doc["access_key"], doc["secret_key"]


def test_a_new_root_credential_works_on_every_endpoint_at_once(gateway: ServerProcess) -> None:
    access_key, secret = cred_create(gateway, "--root")
    auth = {"Authorization": f"Bearer {access_key}:{secret}"}
    with httpx.Client(base_url=gateway.url, headers=auth, timeout=30) as http:
        # the control plane first: before this, /metrics and the admin API answered 401 for up to a
        # refresh interval while the data plane accepted the same key
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/admin/stats").status_code == 200
        assert http.get("/v1/admin/buckets").json() == {"buckets": ["kvcache"]}
        assert http.post("/v1/buckets/kvcache/exists", json={"keys": ["k"]}).json() == {"exists": [False]}
    s3 = boto3.client("s3", endpoint_url=gateway.url, region_name="us-east-1",
                      aws_access_key_id=access_key, aws_secret_access_key=secret)
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["kvcache"]


def test_a_new_bucket_credential_is_known_and_refused_admin(gateway: ServerProcess) -> None:
    """Known at once (403: not root), not mistaken for an unknown one (401)."""
    access_key, secret = cred_create(gateway, "--bucket", "kvcache", "--write")
    auth = {"Authorization": f"Bearer {access_key}:{secret}"}
    for path in ("/metrics", "/v1/admin/stats"):
        r = httpx.get(f"{gateway.url}{path}", headers=auth, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "AccessDenied"
    r = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {access_key}:wrong"}, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize(("method", "path", "status", "root"), [
    ("GET", "/healthz", 200, False),
    ("HEAD", "/healthz", 200, False),
    ("GET", "/readyz", 200, False),
    ("HEAD", "/readyz", 200, False),
    ("GET", "/metrics", 200, True),
    ("GET", "/metrics", 401, False),
    ("GET", "/v1/admin/stats", 200, True),
    ("GET", "/v1/admin/nothing-here", 404, True),
    ("POST", "/healthz", 405, False),
    ("DELETE", "/readyz", 405, False),
    ("GET", "/openapi.json", 200, False),
])
def test_every_control_plane_response_has_a_request_id(
    shared: ServerProcess, method: str, path: str, status: int, root: bool
) -> None:
    server = shared
    r = httpx.request(method, f"{server.url}{path}", headers=server.auth if root else {}, timeout=30)
    assert r.status_code == status
    request_id = r.headers.get("x-kvgw-request-id")
    assert request_id and len(r.headers.get_list("x-kvgw-request-id")) == 1
    if status >= 400:
        assert r.json()["error"]["request_id"] == request_id  # the body names the same request
    if method == "HEAD":
        assert r.content == b""
    again = httpx.request(method, f"{server.url}{path}", headers=server.auth if root else {}, timeout=30)
    assert again.headers["x-kvgw-request-id"] != request_id  # one id per request
