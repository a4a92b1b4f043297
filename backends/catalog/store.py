"""The catalog store: buckets, their policies, credentials and grants, over SQLAlchemy 2.

Synchronous on purpose: the catalog is read at start-up and by the periodic refresh of the service's
in-memory view, never on a request's hot path. Callers on the event loop go through a thread.
SQLite (a file in the data dir) by default; PostgreSQL when several gateways share one catalog.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, delete, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from backends.catalog.models import Bucket, Credential, Grant
from backends.catalog.secrets import SecretBox

_MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class CatalogConflict(Exception):
    """The object already exists (bucket name, access key)."""


class CatalogNotFound(Exception):
    """No such bucket or credential."""


@dataclass(frozen=True, slots=True)
class BucketPolicy:
    """A bucket's limits, access and placement. Capacities are bytes; None means unlimited."""

    name: str
    max_chunk_bytes: int
    default_ttl_seconds: int | None = None
    capacity_bytes: int | None = None  # filesystem tier
    anonymous_read: bool = False
    anonymous_write: bool = False
    write_tier: str = "fs"  # "fs" | "s3"
    write_through: bool = False  # also copy every fs write to S3, asynchronously
    s3_capacity_bytes: int | None = None
    high_watermark: float = 0.9  # evict when usage passes this fraction of capacity...
    low_watermark: float = 0.8  # ...down to this fraction
    eviction_policy: str = "default"


_POLICY_FIELDS = tuple(f for f in BucketPolicy.__slots__ if f != "name")


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    access_key: str
    secret: str = field(repr=False)
    is_root: bool
    grants: dict[str, tuple[bool, bool]]  # bucket -> (can_read, can_write)
    disabled: bool = False


def _policy(row: Bucket) -> BucketPolicy:
    return BucketPolicy(name=row.name, **{f: getattr(row, f) for f in _POLICY_FIELDS})


def generate_access_key() -> str:
    return "KV" + "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(18))


def generate_secret_key() -> str:
    return secrets.token_urlsafe(30)


def make_engine(url: str) -> Engine:
    engine = create_engine(url, pool_pre_ping=True, future=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

    return engine


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class Catalog:
    def __init__(self, url: str, box: SecretBox) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._box = box
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def upgrade(self) -> None:
        """Apply every pending Alembic migration (idempotent)."""
        cfg = alembic_config(self.url)
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        self.engine.dispose()

    # -- buckets -----------------------------------------------------------------------------

    def get_bucket(self, name: str) -> BucketPolicy | None:
        with self._session() as s:
            row = s.get(Bucket, name)
            return None if row is None else _policy(row)

    def list_buckets(self) -> list[BucketPolicy]:
        with self._session() as s:
            return [_policy(r) for r in s.scalars(select(Bucket).order_by(Bucket.name))]

    def create_bucket(self, policy: BucketPolicy) -> BucketPolicy:
        with self._session() as s:
            s.add(Bucket(name=policy.name, **{f: getattr(policy, f) for f in _POLICY_FIELDS}))
            try:
                s.commit()
            except IntegrityError as exc:
                raise CatalogConflict(f"bucket {policy.name} already exists") from exc
        return policy

    def update_bucket(self, policy: BucketPolicy) -> BucketPolicy:
        with self._session() as s:
            row = s.get(Bucket, policy.name)
            if row is None:
                raise CatalogNotFound(policy.name)
            for f in _POLICY_FIELDS:
                setattr(row, f, getattr(policy, f))
            s.commit()
        return policy

    def delete_bucket(self, name: str) -> bool:
        with self._session() as s:
            result = s.execute(delete(Bucket).where(Bucket.name == name))
            s.commit()
            return bool(result.rowcount)  # type: ignore[attr-defined]

    # -- credentials ---------------------------------------------------------------------------

    def create_credential(
        self,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        is_root: bool = False,
        description: str = "",
        grants: dict[str, tuple[bool, bool]] | None = None,
    ) -> tuple[str, str]:
        """Create a credential and its grants (bucket -> (read, write)) in one transaction."""
        access_key = access_key or generate_access_key()
        secret_key = secret_key or generate_secret_key()
        with self._session() as s:
            s.add(
                Credential(
                    access_key=access_key,
                    secret_encrypted=self._box.encrypt(secret_key),
                    is_root=is_root,
                    description=description,
                )
            )
            try:
                s.flush()
                for bucket, (read, write) in (grants or {}).items():
                    if s.get(Bucket, bucket) is None:
                        raise CatalogNotFound(bucket)
                    s.add(Grant(access_key=access_key, bucket=bucket, can_read=read, can_write=write))
                s.commit()
            except IntegrityError as exc:
                raise CatalogConflict(f"access key {access_key} already exists") from exc
        return access_key, secret_key

    def delete_credential(self, access_key: str) -> bool:
        with self._session() as s:
            result = s.execute(delete(Credential).where(Credential.access_key == access_key))
            s.commit()
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def grant(self, access_key: str, bucket: str, *, read: bool, write: bool) -> None:
        with self._session() as s:
            if s.get(Credential, access_key) is None:
                raise CatalogNotFound(access_key)
            if s.get(Bucket, bucket) is None:
                raise CatalogNotFound(bucket)
            row = s.get(Grant, (access_key, bucket))
            if row is None:
                s.add(Grant(access_key=access_key, bucket=bucket, can_read=read, can_write=write))
            else:
                row.can_read, row.can_write = read, write
            s.commit()

    def credentials(self) -> list[CredentialRecord]:
        """Every credential with its decrypted secret and grants (the service keeps this in memory)."""
        with self._session() as s:
            grants: dict[str, dict[str, tuple[bool, bool]]] = {}
            for g in s.scalars(select(Grant)):
                grants.setdefault(g.access_key, {})[g.bucket] = (g.can_read, g.can_write)
            return [
                CredentialRecord(
                    access_key=c.access_key,
                    secret=self._box.decrypt(c.secret_encrypted),
                    is_root=c.is_root,
                    grants=grants.get(c.access_key, {}),
                    disabled=c.disabled,
                )
                for c in s.scalars(select(Credential))
            ]

    def has_root(self) -> bool:
        with self._session() as s:
            return s.scalars(select(Credential).where(Credential.is_root.is_(True)).limit(1)).first() is not None

    def has_credential(self, access_key: str) -> bool:
        with self._session() as s:
            return s.get(Credential, access_key) is not None

