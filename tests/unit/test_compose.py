"""docker-compose.yml holds what a deployment of several gateways needs (``docker-compose config``
validates its syntax in .ci/run; this checks its content)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.conftest import REPO


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return doc


def gateways(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if name.startswith("kvgw")}


def test_images_are_pinned_and_services_restart(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
        image = service.get("image")
        if image is not None:
            assert ":" in image and not image.endswith(":latest"), image


def test_gateways_share_tier_catalog_and_key_but_not_the_index(compose: dict[str, Any]) -> None:
    found = gateways(compose)
    assert len(found) >= 2  # scale-out is shown
    envs = [svc["environment"] for svc in found.values()]
    for key in ("KVGW_CATALOG_URL", "KVGW_CATALOG_KEY", "KVGW_FS_ROOT", "KVGW_S3__BUCKET"):
        assert len({str(env[key]) for env in envs}) == 1, key
    assert all(env["KVGW_DATA_DIR"] == "/data" for env in envs)  # the CLI in the container finds the data
    data_volumes = [next(v for v in svc["volumes"] if v.endswith(":/data")) for svc in found.values()]
    assert len(set(data_volumes)) == len(data_volumes)  # each gateway its own LMDB index
    shared = [{v for v in svc["volumes"] if not v.endswith(":/data")} for svc in found.values()]
    assert all(s == shared[0] for s in shared) and shared[0]


def test_catalog_key_is_a_fernet_key(compose: dict[str, Any]) -> None:
    from gateway.config import is_fernet_key

    for svc in gateways(compose).values():
        assert is_fernet_key(str(svc["environment"]["KVGW_CATALOG_KEY"]))
