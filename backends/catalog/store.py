"""The catalog store: buckets, their policies, credentials and grants, over SQLAlchemy 2.

Synchronous on purpose: the catalog is read at start-up and by the periodic refresh of the service's
in-memory view, never on a request's hot path. Callers on the event loop go through a thread.
SQLite (a file in the data dir) by default; PostgreSQL when several gateways share one catalog.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, delete, event, inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from backends.catalog.models import Bucket, CatalogMeta, Credential, Grant
from backends.catalog.secrets import SecretBox, SecretBoxError
from backends.tiers import TierId

if TYPE_CHECKING:
    from alembic.config import Config


class CatalogConflict(Exception):
    """The object already exists (bucket name, access key)."""


class CatalogKeyMismatch(Exception):
    """The secret key given is not the one the catalog's secrets are encrypted with."""

    def __init__(self, expected: str | None, given: str) -> None:
        self.expected = expected  # the catalog's key fingerprint; None for a catalog that predates them
        self.given = given
        super().__init__(f"catalog key {given} is not the catalog's key {expected or '(unrecorded)'}")


KEY_FINGERPRINT = "secret_key_fingerprint"


class CatalogNotFound(Exception):
    """No such bucket or credential."""


ETAG_MODES = ("xxh3", "md5")
"""A bucket's ETag mode: ``xxh3``, the chunk's own checksum (free: every write computes it anyway);
``md5``, S3's (the MD5 of the body, or of a multipart upload's part MD5s then ``-N``), for buckets
that generic S3 tools (``aws s3 sync``, rclone) compare with the MD5 of their files."""


@dataclass(frozen=True, slots=True)
class BucketPolicy:
    """A bucket's limits, access and placement. Capacities are bytes; None means unlimited."""

    name: str
    max_chunk_bytes: int
    default_ttl_seconds: int | None = None
    capacity_bytes: int | None = None  # filesystem tier
    anonymous_read: bool = False
    anonymous_write: bool = False
    write_tier: str = TierId.FS.label  # a TierId label: where new chunks are written
    write_through: bool = False  # also copy every fs write to S3, asynchronously
    s3_capacity_bytes: int | None = None
    high_watermark: float = 0.9  # evict when usage passes this fraction of capacity...
    low_watermark: float = 0.8  # ...down to this fraction
    eviction_policy: str = "default"
    max_lease_ms: int = 10_000  # the longest read lease a lookup may take (gateway.leases)
    max_leased_bytes: int | None = None  # bytes leased at once; None: a tenth of the capacity, if any
    allow_empty_objects: bool = False  # accept zero-length PUTs (generic S3 use; a KV chunk is never empty)
    etag_mode: str = "xxh3"  # ETAG_MODES: what the S3 API's ETags of new chunks are (gateway.buckets)

    def leased_bytes_cap(self) -> int | None:
        """The bytes that may be leased at once in this bucket (None: no cap: nothing is evicted)."""
        if self.max_leased_bytes is not None:
            return self.max_leased_bytes
        capacities = [c for c in (self.capacity_bytes, self.s3_capacity_bytes) if c is not None]
        return max(capacities) // 10 if capacities else None


_POLICY_FIELDS = tuple(f for f in BucketPolicy.__slots__ if f != "name")


@dataclass(frozen=True, slots=True)
class CredentialRecord:
    access_key: str
    secret: str = field(repr=False)
    is_root: bool
    grants: dict[str, tuple[bool, bool]]  # bucket -> (can_read, can_write)
    disabled: bool = False
    deletes: frozenset[str] = frozenset()  # buckets it may delete chunks from (a grant of its own)


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


def migrations_dir() -> str:
    """The alembic script directory: the installed ``migrations`` package, wherever it was installed
    (a wheel in site-packages as well as a checkout), never a path relative to this file."""
    return str(importlib.resources.files("migrations"))


def head_revision() -> str:
    """The newest migration's revision, read from the file names without loading Alembic: revisions are
    numbered in order with one head (``tests/integration/test_catalog.py::test_one_head`` holds
    Alembic's own head to this)."""
    names = (entry.name for entry in importlib.resources.files("migrations").joinpath("versions").iterdir())
    return max(name.split("_", 1)[0] for name in names if name[:1].isdigit() and name.endswith(".py"))


def alembic_config(url: str) -> Config:
    from alembic.config import Config  # imported here: a gateway's start needs Alembic only to migrate

    cfg = Config()
    cfg.set_main_option("script_location", migrations_dir())
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class Catalog:
    def __init__(self, url: str, box: SecretBox | None) -> None:
        """``box`` None: a catalog that cannot read or write secrets until ``bind_key`` gives it one."""
        self.url = url
        self.engine = make_engine(url)
        self._box = box
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    # -- the secret key ------------------------------------------------------------------------

    @property
    def box(self) -> SecretBox:
        if self._box is None:
            raise RuntimeError("the catalog was opened without its secret key")
        return self._box

    def key_fingerprint(self) -> str | None:
        """The fingerprint of the key the catalog's secrets are encrypted with, once one was bound."""
        with self._session() as s:
            row = s.get(CatalogMeta, KEY_FINGERPRINT)
            return None if row is None else row.value

    def holds_secrets(self) -> bool:
        with self._session() as s:
            return s.scalars(select(Credential.access_key).limit(1)).first() is not None

    def bind_key(self, box: SecretBox) -> None:
        """Use ``box`` for secrets if it is the catalog's key; record its fingerprint on first use.

        CatalogKeyMismatch (and nothing is written) if the catalog records another key, or, for a
        catalog from before fingerprints, if a stored secret does not decrypt with it. Safe to race:
        of gateways binding different keys to a fresh catalog, one wins and the others are refused.
        """
        recorded = self.key_fingerprint()
        if recorded is None:
            with self._session() as s:
                sample = s.scalars(select(Credential.secret_encrypted).limit(1)).first()
            if sample is not None:
                try:
                    box.decrypt(sample)
                except SecretBoxError:
                    raise CatalogKeyMismatch(None, box.fingerprint) from None
            with self._session() as s:
                s.add(CatalogMeta(name=KEY_FINGERPRINT, value=box.fingerprint))
                with contextlib.suppress(IntegrityError):  # bound by another gateway meanwhile: compare below
                    s.commit()
            recorded = self.key_fingerprint()
        if recorded != box.fingerprint:
            raise CatalogKeyMismatch(recorded, box.fingerprint)
        self._box = box

    def upgrade(self) -> None:
        """Apply every pending Alembic migration (idempotent). A catalog at ``head_revision`` already
        (every start after the first) is left as it is without loading Alembic: its imports are about a
        quarter of a gateway's (``python -X importtime``: 0.46 of 1.7 s on the development VM)."""
        if self.revisions() == [head_revision()]:
            return
        from alembic import command

        cfg = alembic_config(self.url)
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def revisions(self) -> list[str]:
        """The revisions the catalog records (``alembic_version``; none before the first migration)."""
        with self.engine.connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return []
            return [str(v) for v in conn.execute(text("SELECT version_num FROM alembic_version")).scalars()]

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
        deletes: Iterable[str] = (),
    ) -> tuple[str, str]:
        """Create a credential and its grants (bucket -> (read, write)) in one transaction; ``deletes``
        names the buckets (among ``grants``) it may also delete chunks from."""
        deletes = set(deletes)
        if not deletes <= set(grants or {}):
            raise ValueError("a delete grant needs a grant on the bucket: " + ", ".join(sorted(deletes)))
        access_key = access_key or generate_access_key()
        secret_key = secret_key or generate_secret_key()
        with self._session() as s:
            s.add(
                Credential(
                    access_key=access_key,
                    secret_encrypted=self.box.encrypt(secret_key),
                    is_root=is_root,
                    description=description,
                )
            )
            try:
                s.flush()
                for bucket, (read, write) in (grants or {}).items():
                    if s.get(Bucket, bucket) is None:
                        raise CatalogNotFound(bucket)
                    s.add(Grant(access_key=access_key, bucket=bucket, can_read=read, can_write=write,
                                can_delete=bucket in deletes))
                s.commit()
            except IntegrityError as exc:
                raise CatalogConflict(f"access key {access_key} already exists") from exc
        return access_key, secret_key

    def delete_credential(self, access_key: str) -> bool:
        with self._session() as s:
            result = s.execute(delete(Credential).where(Credential.access_key == access_key))
            s.commit()
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def grant(self, access_key: str, bucket: str, *, read: bool, write: bool, delete: bool = False) -> None:
        with self._session() as s:
            if s.get(Credential, access_key) is None:
                raise CatalogNotFound(access_key)
            if s.get(Bucket, bucket) is None:
                raise CatalogNotFound(bucket)
            row = s.get(Grant, (access_key, bucket))
            if row is None:
                s.add(Grant(access_key=access_key, bucket=bucket, can_read=read, can_write=write, can_delete=delete))
            else:
                row.can_read, row.can_write, row.can_delete = read, write, delete
            s.commit()

    def credentials(self) -> list[CredentialRecord]:
        """Every credential with its decrypted secret and grants (the service keeps this in memory)."""
        with self._session() as s:
            grants: dict[str, dict[str, tuple[bool, bool]]] = {}
            deletes: dict[str, set[str]] = {}
            for g in s.scalars(select(Grant)):
                grants.setdefault(g.access_key, {})[g.bucket] = (g.can_read, g.can_write)
                if g.can_delete:
                    deletes.setdefault(g.access_key, set()).add(g.bucket)
            return [
                CredentialRecord(
                    access_key=c.access_key,
                    secret=self.box.decrypt(c.secret_encrypted),
                    is_root=c.is_root,
                    grants=grants.get(c.access_key, {}),
                    disabled=c.disabled,
                    deletes=frozenset(deletes.get(c.access_key, ())),
                )
                for c in s.scalars(select(Credential))
            ]

    def secret_of(self, access_key: str) -> str | None:
        """The decrypted secret of one credential, None if there is no such credential."""
        with self._session() as s:
            row = s.get(Credential, access_key)
            return None if row is None else self.box.decrypt(row.secret_encrypted)

    def rotate_secret(self, access_key: str, secret_key: str | None = None) -> str:
        """Give a credential a new secret (generated unless given); CatalogNotFound if it does not exist.

        Gateways pick the new secret up at their next catalog refresh; the old one stops working then.
        """
        secret_key = secret_key or generate_secret_key()
        with self._session() as s:
            row = s.get(Credential, access_key)
            if row is None:
                raise CatalogNotFound(access_key)
            row.secret_encrypted = self.box.encrypt(secret_key)
            s.commit()
        return secret_key

    def has_root(self) -> bool:
        with self._session() as s:
            return s.scalars(select(Credential).where(Credential.is_root.is_(True)).limit(1)).first() is not None

    def has_credential(self, access_key: str) -> bool:
        with self._session() as s:
            return s.get(Credential, access_key) is not None

