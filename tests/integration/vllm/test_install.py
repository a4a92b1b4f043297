"""The vLLM tests need NIXL 1.5.1 on CPU (``.ci/install-nixl.sh``) and, for vLLM's own classes, vLLM 0.33.0
in a venv of its own (``.ci/install-vllm.sh``)."""

from __future__ import annotations

import importlib.metadata

from tests.conftest import require_or_skip
from tests.integration.vllm.conftest import NIXL_INSTALLED, VLLM_INSTALLED
from tests.requirements import require_where


def test_nixl_is_installed() -> None:
    if not NIXL_INSTALLED:
        require_or_skip("NIXL is not installed: run .ci/install-nixl.sh (the vLLM object-tier tests were skipped)")
    assert importlib.metadata.version("nixl-cu12") == "1.5.1"
    assert importlib.metadata.version("nixl") == "1.5.1"


def test_vllm_is_installed() -> None:
    if not VLLM_INSTALLED:
        require_where("KVGW_TEST_VLLM", "vLLM is not installed: run .ci/install-vllm.sh DIR and the tests with "
                      "DIR/bin/python (the tests of kvgw's vLLM tier and of vLLM's obj tier were skipped)")
    assert importlib.metadata.version("vllm") == "0.33.0"
