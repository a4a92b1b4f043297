"""Wiring: builds the catalog, index, tiers and service from Settings, and runs their background jobs.

One ``Gateway`` per process. ``open()`` is blocking (start-up, CLI tools); ``start()``/``stop()`` run the
background jobs on the event loop (catalog refresh, staging cleanup).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from backends.base import Tier
from backends.catalog.secrets import SecretBox
from backends.catalog.store import BucketPolicy, Catalog, CatalogConflict
from backends.index import NETWORK_FILESYSTEMS, TIER_FS, TIER_S3, ChunkIndex, filesystem_type
from backends.posix import PosixTier
from gateway.access import Directory
from gateway.config import ConfigurationError, Settings
from gateway.lifecycle.engine import LifecycleEngine
from gateway.service import ChunkService

log = logging.getLogger("kvgw")


@dataclass(frozen=True)
class RootCredentials:
    access_key: str
    secret_key: str
    path: Path


def open_catalog(settings: Settings) -> Catalog:
    """Open the catalog and apply pending migrations."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.secret_key is not None:
        box = SecretBox(settings.secret_key.get_secret_value().encode())
    else:
        box = SecretBox.from_key_file(settings.secret_key_path)
    _refuse_sqlite_on_network_fs(settings.catalog_dsn)
    catalog = Catalog(settings.catalog_dsn, box)
    catalog.upgrade()
    return catalog


def _refuse_sqlite_on_network_fs(dsn: str) -> None:
    """SQLite's locking is not safe on NFS; gateways that share state share a PostgreSQL catalog."""
    if not dsn.startswith("sqlite:///"):
        return
    path = Path(dsn.removeprefix("sqlite:///")).parent
    fstype = filesystem_type(path)
    if fstype in NETWORK_FILESYSTEMS:
        raise ConfigurationError(
            f"the SQLite catalog would live on a network filesystem ({fstype}) at {path}; "
            "use local disk, or KVGW_CATALOG_URL=postgresql+psycopg://... for gateways that share one"
        )


def validate_policy(policy: BucketPolicy) -> None:
    """Refuse placement policies the lifecycle engine could not apply."""
    from gateway.lifecycle.policy import POLICIES

    if policy.write_tier not in ("fs", "s3"):
        raise ConfigurationError(f"write tier must be fs or s3, not {policy.write_tier!r}")
    if not 0.0 < policy.low_watermark < policy.high_watermark <= 1.0:
        raise ConfigurationError("watermarks must satisfy 0 < low < high <= 1")
    if policy.eviction_policy not in POLICIES:
        raise ConfigurationError(f"unknown eviction policy {policy.eviction_policy!r}; one of {sorted(POLICIES)}")
    for name in ("max_chunk_bytes", "capacity_bytes", "s3_capacity_bytes", "default_ttl_seconds"):
        value = getattr(policy, name)
        if value is not None and value <= 0:
            raise ConfigurationError(f"{name} must be positive")


def bootstrap(settings: Settings, catalog: Catalog) -> RootCredentials | None:
    """First-start setup: the default bucket and root credentials. Returns credentials it generated.

    Safe to run on every start and from several gateways at once (conflicts mean someone else won).
    """
    if catalog.get_bucket(settings.default_bucket) is None:
        with contextlib.suppress(CatalogConflict):
            catalog.create_bucket(BucketPolicy(settings.default_bucket, settings.max_chunk_bytes))
    if settings.root_access_key and settings.root_secret_key:
        if not catalog.has_credential(settings.root_access_key):
            with contextlib.suppress(CatalogConflict):
                catalog.create_credential(
                    access_key=settings.root_access_key,
                    secret_key=settings.root_secret_key.get_secret_value(),
                    is_root=True,
                    description="root (from KVGW_ROOT_ACCESS_KEY)",
                )
        return None
    if catalog.has_root():
        return None
    access_key, secret_key = catalog.create_credential(is_root=True, description="root (generated)")
    path = settings.root_credentials_path
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"access_key={access_key}\nsecret_key={secret_key}\n")
    os.chmod(path, 0o600)
    return RootCredentials(access_key, secret_key, path)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = open_catalog(settings)
        self.generated_root = bootstrap(settings, catalog=self.catalog)
        self.directory = Directory(
            self.catalog, anonymous_is_root=settings.anonymous, refresh_seconds=settings.catalog_refresh_seconds
        )
        self.directory.load()
        self.index = ChunkIndex(
            settings.index_path,
            map_size=settings.index_map_size,
            sync=settings.index_sync,
            allow_network_fs=settings.index_allow_network_fs,
        )
        self.fs = PosixTier(settings.fs_root_path, fsync=settings.fsync)
        self.tiers: dict[int, Tier] = {TIER_FS: self.fs}
        if settings.s3 is not None:
            from backends.s3 import S3Tier

            self.tiers[TIER_S3] = S3Tier(settings.s3)
        self.service = ChunkService(settings, self.directory, self.index, self.tiers)
        self.lifecycle = LifecycleEngine(self.service, interval=settings.lifecycle_interval,
                                         budget=settings.lifecycle_budget)
        self.service.events = self.lifecycle
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        removed = await self.fs.cleanup_staging(self.settings.staging_max_age_seconds)
        if removed:
            log.info("removed %d staged files left by interrupted writes", removed)
        await self.lifecycle.start()
        self._tasks.append(asyncio.create_task(self._refresh_catalog(), name="kvgw-catalog-refresh"))
        self._tasks.append(asyncio.create_task(self._clean_staging(), name="kvgw-staging-cleanup"))

    async def _refresh_catalog(self) -> None:
        while True:
            await asyncio.sleep(self.settings.catalog_refresh_seconds)
            try:
                await self.directory.refresh()
            except Exception:
                log.exception("catalog refresh failed; keeping the previous view")

    async def _clean_staging(self) -> None:
        while True:
            await asyncio.sleep(max(60.0, self.settings.staging_max_age_seconds / 4))
            try:
                await self.fs.cleanup_staging(self.settings.staging_max_age_seconds)
            except Exception:
                log.exception("staging cleanup failed")

    async def stop(self) -> None:
        await self.lifecycle.stop()
        await self.service.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.index.flush()
        for tier in self.tiers.values():
            await tier.close()

    def close(self) -> None:
        self.index.close()
        self.catalog.close()
