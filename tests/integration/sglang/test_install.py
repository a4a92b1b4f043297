"""The SGLang integration tests need SGLang 0.5.23's storage modules on CPU (``.ci/install-sglang.sh``)."""

from __future__ import annotations

import importlib
import importlib.metadata

from tests.conftest import require_or_skip
from tests.integration.sglang.conftest import SGLANG_INSTALLED


def test_sglang_is_installed() -> None:
    if not SGLANG_INSTALLED:
        require_or_skip("SGLang is not importable: run .ci/install-sglang.sh (the SGLang tests were not collected)")
    from gateway.bench import sglang_engine as harness

    assert importlib.metadata.version("sglang") == harness.SGLANG_VERSION
    assert importlib.metadata.version("torch").startswith("2.13.0")
    harness.load()
    for name in harness.STORAGE_MODULES:
        importlib.import_module(name)
    import kvgw_client.sglang as backend

    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    assert issubclass(backend.KvgwHiCacheStorage, storage.HiCacheStorage)
