"""vLLM 0.33's KV offloading tiers against a real ``kvgw serve``: fixtures.

Two kinds of modules. The kvgw tier's (``test_kvgw_tier.py``, ``test_scheduler.py``, ``test_events.py``)
and vLLM's own ``obj`` tier's (``test_vllm_obj.py``) run vLLM's classes on CPU
(``gateway.bench.vllm_engine``): they need vLLM, which lives in a venv of its own
(``.ci/install-vllm.sh``); without it they are not collected and ``test_install.py`` says why (a skip,
a failure only under ``KVGW_REQUIRE_SERVICES=1`` with ``KVGW_TEST_VLLM=1``: the CI run in that venv).
``test_obj_tier.py`` drives NIXL's OBJ backend directly, for what vLLM 0.33 cannot configure
(multipart uploads, required checksums, a frozen gateway's retries); it needs NIXL only.
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
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
VLLM_MODULES = ["test_kvgw_tier.py", "test_scheduler.py", "test_events.py", "test_vllm_obj.py", "test_bench_vllm.py"]
collect_ignore = ([] if NIXL_INSTALLED else ["test_obj_tier.py", "test_vllm_obj.py"]) + (
    [] if VLLM_INSTALLED else VLLM_MODULES)

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


def kvgw_tier(server: ServerProcess, bucket: str = "kvcache", **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for kvgw's tier on ``server`` (root credentials, short deadlines)."""
    doc: dict[str, Any] = {"type": "KvgwTier", "module_path": "kvgw_client.vllm", "url": server.url,
                           "bucket": bucket, "access_key": ROOT_AK, "secret_key": ROOT_SK,
                           "lookup_timeout_s": 5, "io_timeout_s": 20}
    doc.update(options)
    return doc


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    """``engines(secondary_tiers, block_bytes=, cpu_blocks=, events=)``: a vLLM tiering manager on CPU
    (``gateway.bench.vllm_engine.Engine``), shut down after the test."""
    from gateway.bench import vllm_engine

    vllm_engine.load()
    made: list[Any] = []

    def make(tiers: list[dict[str, Any]], *, block_bytes: int = 1 << 20, cpu_blocks: int = 32, **kw: Any) -> Any:
        engine = vllm_engine.Engine(tiers, block_bytes=block_bytes, cpu_blocks=cpu_blocks, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()
