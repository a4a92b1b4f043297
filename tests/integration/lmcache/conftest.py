"""LMCache 0.5.6 or 0.5.7rc2 (CPU) driving a real ``kvgw serve``: fixtures.

Every test module here imports LMCache at import time; without LMCache they are not collected and
``test_install.py`` reports why (a skip locally, a failure under ``KVGW_REQUIRE_SERVICES=1``).
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, require_or_skip

LMCACHE_INSTALLED = importlib.util.find_spec("lmcache") is not None
SUPPORTED_LMCACHE = ("0.5.6", "0.5.7rc2")
collect_ignore = [] if LMCACHE_INSTALLED else sorted(
    path.name for path in Path(__file__).parent.glob("test_*.py") if path.name != "test_install.py")
VHOST = "kvcache.localhost"
"""The virtual-hosted name of bucket ``kvcache`` on a gateway started with ``KVGW_S3_API_BASE_DOMAIN=localhost``."""

FAST_FAILURE = {
    "connect_timeout_s": 0.5,
    "read_timeout_s": 2.0,
    "control_timeout_s": 1.0,
    "lookup_timeout_s": 1.0,
    "retry_backoff_s": 0.005,
    "retry_backoff_max_s": 0.02,
    "cooldown_s": 0.1,
    "cooldown_max_s": 0.5,
}
"""kvgw client settings that make outage tests take seconds, not minutes."""

_seeds = itertools.count(random.randrange(1 << 20) << 8)


@pytest.fixture
def seed() -> int:
    """A fresh key seed: tests sharing a gateway never write the same (write-once) keys."""
    return next(_seeds)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway for a module's tests; tests that stop their gateway use ``server`` instead."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def make_worker() -> Iterator[Callable[..., Any]]:
    """``make_worker(url, chunk_mib=1, chunks=8, meta=True, **kvgw_settings)``: an LMCache worker whose
    remote backend is kvgw's connector (root credentials), closed after the test."""
    from gateway.bench import lmcache_engine as le

    made: list[le.Worker] = []

    def make(url: str, *, chunk_mib: int = 1, chunks: int = 8, meta: bool = True, **settings: object) -> le.Worker:
        values: dict[str, object] = {"access_key": ROOT_AK, "secret_key": ROOT_SK, "prefetch_bytes": 0}
        values.update(settings)
        extra = le.kvgw_plugin_extra(url, **values)
        extra["save_chunk_meta"] = meta
        config = le.engine_config(
            cpu_gb=le.cpu_pool_gb(chunk_mib, chunks), extra=extra,
            remote_storage_plugins=[le.KVGW_PLUGIN], save_unfull_chunk=True,
        )
        worker = le.Worker(config, le.make_metadata(chunk_mib))
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()


@pytest.fixture(scope="module")
def s3_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A gateway whose S3 API takes ``<bucket>.localhost`` as virtual-hosted addressing."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw-s3") / "data",
                           env={"KVGW_S3_API_BASE_DOMAIN": "localhost"}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def vhost() -> str:
    """``kvcache.localhost``, which must resolve to 127.0.0.1 (LMCache connects to the name it signs)."""
    try:
        socket.getaddrinfo(VHOST, None)
    except OSError:
        require_or_skip(f"{VHOST} does not resolve: add '127.0.0.1 {VHOST}' to /etc/hosts (.ci/run does)")
    return VHOST
