"""Several real ``kvgw serve`` processes sharing one chunk directory and one PostgreSQL catalog.

Every test that starts its gateways with ``launch`` runs twice (``fs_view``): ``shared``, every gateway
on the directory itself; ``fuse``, each gateway on its own FUSE view of it (bindfs with
``entry_timeout=3,negative_timeout=3,attr_timeout=3``), whose kernel caches names, missing names and
attributes for 3 s, as an NFS client caches lookups: what each host of an NFS-shared tier sees. The
directory itself (``cluster_env["KVGW_FS_ROOT"]``) stays what tests and CLI commands inspect.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from tests.conftest import ServerProcess, require_or_skip

Launch = Callable[..., ServerProcess]

FUSE_CACHE = "entry_timeout=3,negative_timeout=3,attr_timeout=3"
"""How long each gateway's view caches a name, a missing name and attributes (seconds)."""


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A migrated SQLite catalog in ``tmp_path`` (the embedded default's database), by URL."""
    from backends.catalog.store import Catalog

    url = f"sqlite:///{tmp_path / 'catalog.sqlite'}"
    catalog = Catalog(url, None)
    catalog.upgrade()
    catalog.close()
    return url


@pytest.fixture
def cluster_env(pg_url: str, tmp_path: Path) -> dict[str, str]:
    """What every gateway of the cluster shares: the directory, the catalog and its key."""
    return {
        "KVGW_FS_ROOT": str(tmp_path / "shared-fs"),
        "KVGW_CATALOG_URL": pg_url,
        "KVGW_CATALOG_KEY": Fernet.generate_key().decode(),
        "KVGW_CLUSTER_HEARTBEAT_SECONDS": "0.5",
    }


@pytest.fixture(params=["shared", "fuse"])
def fs_view(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str, Path], Path]]:
    """``view(name, directory)``: the path gateway ``name`` reaches the shared directory by. ``fuse``
    mounts a caching bindfs view per gateway (unmounted after the gateways stop: this fixture is set up
    before ``server_factory``)."""
    if request.param == "shared":
        yield lambda _name, directory: directory
        return
    if shutil.which("bindfs") is None or not Path("/dev/fuse").exists():
        require_or_skip("bindfs (Debian package bindfs) and /dev/fuse are needed for the FUSE-view cluster tests")
    mounted: list[Path] = []

    def view(name: str, directory: Path) -> Path:
        point = tmp_path / f"view-{name}"
        if point in mounted:
            return point
        directory.mkdir(parents=True, exist_ok=True)
        point.mkdir()
        subprocess.run(["bindfs", "-o", FUSE_CACHE, str(directory), str(point)], check=True, capture_output=True,
                       timeout=30)
        mounted.append(point)
        return point

    yield view
    unmount = next(([tool, "-u", "-z"] for tool in ("fusermount3", "fusermount") if shutil.which(tool)),
                   ["umount", "-l"])
    for point in reversed(mounted):
        subprocess.run([*unmount, str(point)], check=False, capture_output=True, timeout=30)


@pytest.fixture
def launch(fs_view: Callable[[str, Path], Path], cluster_env: dict[str, str],
           server_factory: type[ServerProcess], tmp_path: Path) -> Launch:
    """``launch("a", KVGW_X="1")``: a gateway of the cluster with its own data dir (index) ``tmp_path/a``,
    on its own view of the shared directory (``fs_view``).

    ``fs_view`` and ``cluster_env`` (and with it the PostgreSQL schema) are set up before
    ``server_factory``, so the gateways are stopped before the views are unmounted and the schema dropped."""

    def start(name: str, **env: str) -> ServerProcess:
        root = fs_view(name, Path(env.get("KVGW_FS_ROOT", cluster_env["KVGW_FS_ROOT"])))
        return server_factory(data_dir=tmp_path / name, env={**cluster_env, **env, "KVGW_FS_ROOT": str(root)}).start()

    return start
