"""The LMCache integration tests need LMCache 0.5.6 or 0.5.7rc2 on CPU (``.ci/install-lmcache.sh``).

CI runs this directory twice: with the project's environment (LMCache 0.5.6) and with
``.ci/.venv-lmcache057`` (0.5.7rc2), each proving the version it was meant to have.
"""

from __future__ import annotations

import importlib.metadata
import os

from tests.conftest import require_or_skip
from tests.integration.lmcache.conftest import LMCACHE_INSTALLED, SUPPORTED_LMCACHE


def test_lmcache_is_installed() -> None:
    if not LMCACHE_INSTALLED:
        require_or_skip("LMCache is not importable: run .ci/install-lmcache.sh (the LMCache tests were not collected)")
    version = importlib.metadata.version("lmcache")
    assert version in SUPPORTED_LMCACHE
    wanted = os.environ.get("KVGW_TEST_LMCACHE_VERSION")  # .ci/run names the version each run must have
    assert wanted in (None, version), f"LMCache {version} installed, the run wants {wanted}"
