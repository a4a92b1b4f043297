"""The pre-0.2 ``gateway.client.*`` module paths still load, as the very modules they moved to, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

from gateway.client import MOVED
from tests.requirements import require_module


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_old_path_is_the_new_module_with_a_deprecation_warning(old: str, new: str) -> None:
    if new.startswith("kvgw_client.lmcache."):
        require_module("lmcache")  # the LMCache modules import LMCache itself
    sys.modules.pop(f"gateway.client.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"gateway.client.{old} moved to {new}"):
        module = importlib.import_module(f"gateway.client.{old}")
    assert module is importlib.import_module(new)


def test_every_client_module_has_an_alias() -> None:
    """Each module the old package had is listed (the LMCache ones under their old names)."""
    assert set(MOVED) == {"blocking", "chains", "config", "direct", "errors", "framing", "health", "http", "loop",
                          "policy", "prefetch", "lmcache_connector", "l2_adapter"}
