"""kvgw's version, as installed: ``kvgw --version``, the ``/healthz`` body, the start banner and the
cluster's member list all say the same."""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def kvgw_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("kvgw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
