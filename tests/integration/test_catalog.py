"""Catalog migrations and operations on SQLite and on the real PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from backends.catalog.secrets import SecretBox, SecretBoxError
from backends.catalog.store import BucketPolicy, Catalog, CatalogConflict, CatalogNotFound, head_revision

HEAD = head_revision()
"""The newest revision: revisions are numbered in order, one head (``test_one_head``)."""


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.sqlite'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def box(tmp_path: Path) -> SecretBox:
    return SecretBox.from_key_file(tmp_path / "secret.key")


def test_migrations_create_the_schema_and_are_idempotent(catalog_url: str, box: SecretBox) -> None:
    catalog = Catalog(catalog_url, box)
    catalog.upgrade()
    catalog.upgrade()
    tables = set(inspect(catalog.engine).get_table_names())
    assert {"buckets", "credentials", "grants", "alembic_version"} <= tables
    with catalog.engine.connect() as conn:
        assert conn.execute(text("select version_num from alembic_version")).scalar() == HEAD
    catalog.close()


def test_a_catalog_at_the_head_starts_without_alembic(catalog_url: str, box: SecretBox,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every start after the first finds nothing to migrate without loading Alembic (a third of a
    gateway's imports); a catalog one revision behind is still migrated by it."""
    from alembic import command

    catalog = Catalog(catalog_url, box)
    catalog.upgrade()
    upgrades: list[str] = []
    real_upgrade = command.upgrade

    def counted(cfg: Any, target: str) -> None:
        upgrades.append(target)
        real_upgrade(cfg, target)

    monkeypatch.setattr(command, "upgrade", counted)
    catalog.upgrade()
    assert upgrades == [] and catalog.revisions() == [HEAD]
    command.downgrade(_config(catalog), "-1")
    assert catalog.revisions() != [HEAD]
    catalog.upgrade()
    assert upgrades == ["head"] and catalog.revisions() == [HEAD]
    catalog.close()


def _config(catalog: Catalog) -> Any:
    from backends.catalog.store import alembic_config

    return alembic_config(catalog.url)


def test_one_head() -> None:
    """Every revision but the first revises the one before it: two branches adding revision N at once
    would leave alembic with two heads (renumber the later one when merging)."""
    from alembic.script import ScriptDirectory

    from backends.catalog.store import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert script.get_heads() == [HEAD]


def test_bucket_and_credential_operations(catalog_url: str, box: SecretBox) -> None:
    catalog = Catalog(catalog_url, box)
    catalog.upgrade()
    policy = BucketPolicy("kvcache", 256 << 20, default_ttl_seconds=3600, capacity_bytes=1 << 40)
    catalog.create_bucket(policy)
    with pytest.raises(CatalogConflict):
        catalog.create_bucket(policy)
    assert catalog.get_bucket("kvcache") == policy
    updated = BucketPolicy("kvcache", 1 << 20, anonymous_read=True)
    catalog.update_bucket(updated)
    assert catalog.get_bucket("kvcache") == updated
    with pytest.raises(CatalogNotFound):
        catalog.update_bucket(BucketPolicy("nope", 1))

    ak, sk = catalog.create_credential(description="reader")
    catalog.grant(ak, "kvcache", read=True, write=False)
    with pytest.raises(CatalogNotFound):
        catalog.grant(ak, "nope", read=True, write=True)
    (record,) = catalog.credentials()
    assert record.access_key == ak and record.secret == sk and not record.is_root
    assert record.grants == {"kvcache": (True, False)}
    assert not catalog.has_root()
    catalog.create_credential(is_root=True)
    assert catalog.has_root()

    assert catalog.delete_bucket("kvcache")
    assert catalog.get_bucket("kvcache") is None
    assert catalog.credentials()[0].grants == {} or catalog.credentials()[1].grants == {}
    assert catalog.delete_credential(ak) and not catalog.delete_credential(ak)
    catalog.close()


def test_a_copy_of_the_catalog_does_not_reveal_secrets(catalog_url: str, box: SecretBox, tmp_path: Path) -> None:
    catalog = Catalog(catalog_url, box)
    catalog.upgrade()
    catalog.create_credential(access_key="AKVISIBLE", secret_key="very-secret-value-123")
    with catalog.engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text("select * from credentials"))]
    assert "very-secret-value-123" not in repr(rows)
    # with another key the rows cannot be decrypted
    other = Catalog(catalog_url, SecretBox.from_key_file(tmp_path / "other.key"))
    with pytest.raises(SecretBoxError):
        other.credentials()
    other.close()
    catalog.close()


def test_secret_key_file_is_private(tmp_path: Path) -> None:
    SecretBox.from_key_file(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600


def test_gateway_bootstrap_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """Two gateways starting on one PostgreSQL catalog: one bucket, one root, both usable."""
    from gateway.config import load_settings
    from gateway.runtime import bootstrap, open_catalog

    settings = load_settings(data_dir=tmp_path / "a", catalog_url=pg_url, secret_key_file=tmp_path / "shared.key")
    first = open_catalog(settings)
    generated = bootstrap(settings, first)
    assert generated is not None and generated.path.stat().st_mode & 0o777 == 0o600
    second = open_catalog(load_settings(data_dir=tmp_path / "b", catalog_url=pg_url,
                                        secret_key_file=tmp_path / "shared.key"))
    assert bootstrap(settings, second) is None  # root exists already: nothing generated twice
    assert [b.name for b in second.list_buckets()] == ["kvcache"]
    assert [c.secret for c in second.credentials()] == [generated.secret_key]
    first.close()
    second.close()
