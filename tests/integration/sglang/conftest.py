"""SGLang 0.5.23 (its storage modules, on CPU) driving a real ``kvgw serve``: fixtures.

Every test module here imports SGLang's classes; without SGLang they are not collected and
``test_install.py`` reports why (a skip locally, a failure under ``KVGW_REQUIRE_SERVICES=1``).
SGLang is installed by ``.ci/install-sglang.sh``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess

SGLANG_INSTALLED = all(importlib.util.find_spec(name) is not None for name in ("sglang", "torch"))
collect_ignore = [] if SGLANG_INSTALLED else [
    "test_backend.py", "test_seaweedfs.py", "test_credentials.py",
]

KVGW_BACKEND = {"backend_name": "kvgw", "module_path": "kvgw_client.sglang", "class_name": "KvgwHiCacheStorage",
                "interface_v1": 1}
"""The factory keys of the documented launch flags (docs/sglang.md, README.md)."""

FAST_FAILURE = {
    "connect_timeout_s": 0.5, "read_timeout_s": 2.0, "control_timeout_s": 1.0, "retry_backoff_s": 0.005,
    "retry_backoff_max_s": 0.02, "cooldown_s": 0.1, "cooldown_max_s": 0.5, "lookup_timeout_s": 1.0,
    "io_timeout_s": 3.0,
}

_seeds = itertools.count(random.randrange(1 << 20) << 8)


@pytest.fixture
def seed() -> int:
    """A fresh seed: tests sharing a gateway never write the same (write-once) pages."""
    return next(_seeds)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway for a module's tests (catalog refresh every 60 s: new credentials must not need it)."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw") / "data",
                           env={"KVGW_CATALOG_REFRESH_SECONDS": "60"}).start()
    yield server
    server.stop()


def kvgw_cli(server: ServerProcess, *args: str) -> dict[str, Any]:
    """``kvgw <args> --data-dir <the gateway's>`` in a subprocess, as an operator runs it next to a live
    gateway (same catalog file and key); the JSON it prints."""
    env = dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK, KVGW_LOG_LEVEL="warning")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--data-dir", str(server.data_dir)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, f"kvgw {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    doc: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return doc


def new_credential(server: ServerProcess, *flags: str, bucket: str = "kvcache") -> tuple[str, str]:
    doc = kvgw_cli(server, "cred", "create", "--bucket", bucket, *flags)
    return doc["access_key"], doc["secret_key"]


@pytest.fixture
def make_kvgw(gateway: ServerProcess) -> Iterator[Callable[..., Any]]:
    """``make_kvgw(pool, url=..., tp_rank=..., is_mla=..., **extra)``: kvgw's backend attached through
    SGLang's factory as the cache controller attaches it (root credentials unless given); closed after."""
    made: list[Any] = []

    def make(pool: Any, *, url: str | None = None, model: str = "Qwen/Qwen3-8B", tp_rank: int = 0,
             tp_size: int = 1, is_mla: bool = False, metrics: bool = False, **extra: Any) -> Any:
        from gateway.bench import sglang_engine as harness

        settings: dict[str, Any] = {**KVGW_BACKEND, "url": url or gateway.url, "bucket": "kvcache",
                                    "access_key": ROOT_AK, "secret_key": ROOT_SK}
        settings.update(extra)
        config = harness.storage_config(extra=settings, model=model, tp_rank=tp_rank, tp_size=tp_size,
                                        is_mla=is_mla, page_first=pool.layout == "page_first", metrics=metrics)
        backend = harness.attach("dynamic", config, pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def make_seaweedfs(gateway: ServerProcess) -> Iterator[Callable[..., Any]]:
    """``make_seaweedfs(pool, access_key=..., secret_key=..., **extra)``: SGLang's built-in S3 backend
    (``seaweedfs``, boto3) pointed at kvgw's S3 API, through the same factory."""
    made: list[Any] = []

    def make(pool: Any, *, access_key: str = ROOT_AK, secret_key: str = ROOT_SK, model: str = "Qwen/Qwen3-8B",
             **extra: Any) -> Any:
        from gateway.bench import sglang_engine as harness

        settings = {"endpoint": gateway.url, "bucket": "kvcache", "access_key": access_key,
                    "secret_key": secret_key, **extra}
        config = harness.storage_config(extra=settings, model=model, page_first=pool.layout == "page_first")
        backend = harness.attach("seaweedfs", config, pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend._executor.shutdown(wait=True)


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]
