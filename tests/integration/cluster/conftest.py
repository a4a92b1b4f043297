"""Several real ``kvgw serve`` processes sharing one chunk directory and one PostgreSQL catalog."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from tests.conftest import ServerProcess

Launch = Callable[..., ServerProcess]


@pytest.fixture
def cluster_env(pg_url: str, tmp_path: Path) -> dict[str, str]:
    """What every gateway of the cluster shares: the directory, the catalog and its key."""
    return {
        "KVGW_FS_ROOT": str(tmp_path / "shared-fs"),
        "KVGW_CATALOG_URL": pg_url,
        "KVGW_CATALOG_KEY": Fernet.generate_key().decode(),
        "KVGW_CLUSTER_HEARTBEAT_SECONDS": "0.5",
    }


@pytest.fixture
def launch(cluster_env: dict[str, str], server_factory: type[ServerProcess], tmp_path: Path) -> Launch:
    """``launch("a", KVGW_X="1")``: a gateway of the cluster with its own data dir (index) ``tmp_path/a``.

    ``cluster_env`` (and with it the PostgreSQL schema) is set up before ``server_factory``, so the
    gateways are stopped before the schema is dropped."""

    def start(name: str, **env: str) -> ServerProcess:
        return server_factory(data_dir=tmp_path / name, env={**cluster_env, **env}).start()

    return start
