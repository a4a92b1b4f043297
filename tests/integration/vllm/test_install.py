"""The vLLM object-tier tests need NIXL 1.5.1 on CPU (``.ci/install-nixl.sh``)."""

from __future__ import annotations

import importlib.metadata

from tests.conftest import require_or_skip
from tests.integration.vllm.conftest import NIXL_INSTALLED


def test_nixl_is_installed() -> None:
    if not NIXL_INSTALLED:
        require_or_skip("NIXL is not installed: run .ci/install-nixl.sh (the vLLM object-tier tests were skipped)")
    assert importlib.metadata.version("nixl-cu12") == "1.5.1"
    assert importlib.metadata.version("nixl") == "1.5.1"
