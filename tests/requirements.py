"""Skip or fail, for tests that need something from outside the project: a service, a package, data.

Locally, a test whose PostgreSQL, moto, LMCache, awscrt, aws CLI, traces... are missing is skipped.
CI sets ``KVGW_REQUIRE_SERVICES=1``: then the same test fails instead, so a green CI run proves that
every such test really ran. Every skip for a missing thing in ``tests/`` goes through this module
(never a bare ``pytest.skip``, ``pytest.importorskip`` or ``skipif``); ``tests.conftest`` re-exports
it. It imports nothing from ``tests`` so that ``tests.s3server``, which conftest imports, can use it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "KVGW_REQUIRE_SERVICES"


def services_required() -> bool:
    """True when a missing service or package must fail the run (CI)."""
    return os.environ.get(REQUIRE_ENV) == "1"


def require_or_skip(reason: str) -> NoReturn:
    """Skip locally; fail when CI demands every service (``KVGW_REQUIRE_SERVICES=1``).

    Usable in a test, a fixture or at module level (there a failure is a collection error).
    """
    if services_required():
        pytest.fail(f"required service missing ({REQUIRE_ENV}=1): {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_where(flag: str, reason: str) -> NoReturn:
    """For what only some of CI's environments hold (vLLM lives in a venv of its own): skip, and fail
    under ``KVGW_REQUIRE_SERVICES=1`` only where the environment variable ``flag`` is ``1``, which CI
    sets for the run that is meant to have it (``KVGW_TEST_VLLM=1`` for ``.ci/.venv-vllm``)."""
    if services_required() and os.environ.get(flag) == "1":
        pytest.fail(f"required package missing ({REQUIRE_ENV}=1, {flag}=1): {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str | None = None) -> ModuleType:
    """``pytest.importorskip`` that fails instead of skipping under ``KVGW_REQUIRE_SERVICES=1``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require_or_skip(f"{reason or f'{name} is not installed'} ({type(exc).__name__}: {exc})")
