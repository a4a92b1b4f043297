"""Deprecated: the client moved to the ``kvgw-client`` distribution, import package ``kvgw_client``.

The old module paths (``gateway.client.lmcache_connector``, ``gateway.client.l2_adapter``,
``gateway.client.http``, ...) keep working for one release as aliases of the new modules, so LMCache
configs written for them still load; each import warns once. Remove in the next release.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

# old submodule name -> new module; the aliases below are the whole of this package
MOVED = {
    "blocking": "kvgw_client.blocking",
    "chains": "kvgw_client.chains",
    "config": "kvgw_client.config",
    "direct": "kvgw_client.direct",
    "errors": "kvgw_client.errors",
    "framing": "kvgw_client.framing",
    "health": "kvgw_client.health",
    "http": "kvgw_client.http",
    "loop": "kvgw_client.loop",
    "policy": "kvgw_client.policy",
    "prefetch": "kvgw_client.prefetch",
    "lmcache_connector": "kvgw_client.lmcache.connector",
    "l2_adapter": "kvgw_client.lmcache.l2_adapter",
}


def alias(old_name: str) -> ModuleType:
    """Make ``old_name`` (``gateway.client.X``) the very module it moved to, with a DeprecationWarning."""
    new_name = MOVED[old_name.rsplit(".", 1)[1]]
    warnings.warn(f"{old_name} moved to {new_name}; the old path goes away in the next release",
                  DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new_name)
    sys.modules[old_name] = module
    return module
