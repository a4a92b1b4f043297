"""vLLM's object-store tier (NIXL 1.5.1's OBJ backend, on CPU) against a real ``kvgw serve``: fixtures.

The test modules import NIXL only through ``gateway.bench.vllm_obj.ObjTier``; without NIXL they are not
collected and ``test_install.py`` reports why (a skip locally, a failure under ``KVGW_REQUIRE_SERVICES=1``).
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

from gateway.bench.vllm_obj import ObjTier
from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess

NIXL_INSTALLED = importlib.util.find_spec("nixl") is not None and importlib.util.find_spec("nixl_cu12") is not None
collect_ignore = [] if NIXL_INSTALLED else ["test_obj_tier.py"]

_seeds = itertools.count(random.randrange(1 << 20) << 8, 16)  # a test may use seed .. seed + 15


@pytest.fixture
def seed() -> int:
    """A fresh seed: tests sharing a gateway never write the same (write-once) keys."""
    return next(_seeds)


def cli(server: ServerProcess, *args: str) -> dict[str, Any]:
    """``kvgw ... --data-dir <the running gateway's>``, as an operator runs it; its JSON answer."""
    env = dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK, KVGW_LOG_LEVEL="warning")
    result = subprocess.run([sys.executable, "-m", "gateway.cli", *args, "--data-dir", str(server.data_dir)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return doc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway for a module's tests."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw-vllm") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def make_tier() -> Iterator[Callable[..., ObjTier]]:
    """``make_tier(store_config, block_bytes=, blocks=, **options)``: a NIXL OBJ tier as vLLM builds it,
    closed after the test."""
    made: list[ObjTier] = []

    def make(store_config: dict[str, Any], *, block_bytes: int, blocks: int, **options: Any) -> ObjTier:
        tier = ObjTier(store_config, block_bytes, blocks, **options)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def store_config(server: ServerProcess, bucket: str = "kvcache", host: str = "127.0.0.1", **extra: Any
                 ) -> dict[str, Any]:
    """vLLM's ``store_config`` for ``server`` (root credentials unless ``extra`` says otherwise)."""
    doc: dict[str, Any] = {"bucket": bucket, "endpoint_override": f"{host}:{server.port}", "scheme": "http",
                           "region": "us-east-1", "access_key": ROOT_AK, "secret_key": ROOT_SK}
    doc.update(extra)
    return doc
