"""The LMCache integration tests need LMCache 0.5.6 on CPU (``.ci/install-lmcache.sh``)."""

from __future__ import annotations

import importlib.metadata

from tests.conftest import require_or_skip
from tests.integration.lmcache.conftest import LMCACHE_INSTALLED


def test_lmcache_is_installed() -> None:
    if not LMCACHE_INSTALLED:
        require_or_skip("LMCache is not importable: run .ci/install-lmcache.sh (the LMCache tests were not collected)")
    assert importlib.metadata.version("lmcache") == "0.5.6"
