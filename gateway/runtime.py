"""Wiring: builds the catalog, index, tiers, service, tier mover and lifecycle engine from Settings, and
runs their background jobs.

Everything gets what it uses by its constructor, in dependency order: the lifecycle ledgers (the local
``ChunkEvents`` sink) first, then the cluster (``gateway.cluster``: its ``events`` pass everything to the
ledgers and publish tier changes to the cluster feed; it applies other gateways' changes to the index),
then the tier mover and the chunk service that report to the cluster's events, then the lifecycle
engine that reads the ledgers and moves chunks through the mover. Nothing is patched afterwards.

One ``Gateway`` per process. ``open()`` is blocking (start-up, CLI tools); ``start()``/``stop()`` run the
background jobs on the event loop (catalog refresh, staging cleanup, the cluster's feed and heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from backends.base import Tier
from backends.catalog.secrets import SecretBox, create_key_file, read_key_file
from backends.catalog.store import ETAG_MODES, BucketPolicy, Catalog, CatalogConflict, CatalogKeyMismatch
from backends.index import NETWORK_FILESYSTEMS, ChunkIndex, filesystem_type
from backends.posix import PosixTier
from backends.tiers import TierId
from gateway import datadir
from gateway.access import Directory, anonymous_principal
from gateway.buckets import new_bucket_policy
from gateway.cluster import Cluster
from gateway.cluster.changes import ChangeStream
from gateway.cluster.leader import Leadership, LeaseStore, SoleLeader
from gateway.config import ConfigurationError, Settings, is_fernet_key
from gateway.leases import MAX_LEASE_MS, LeaseBook
from gateway.lifecycle.engine import LifecycleEngine
from gateway.lifecycle.ledgers import LargerUsage, Ledgers, UsageSource, at_low_watermark
from gateway.lifecycle.state import PolicyStates
from gateway.mover import TierMover
from gateway.service import ChunkService

log = logging.getLogger("kvgw")


@dataclass(frozen=True)
class RootCredentials:
    access_key: str
    secret_key: str
    path: Path


def open_catalog(settings: Settings, *, create_data_dir: bool = True) -> Catalog:
    """Open the catalog, apply pending migrations, and bind the secret key (gateway and CLI alike).

    A new key is created only for a catalog that holds no secrets yet; a catalog that does, opened
    without its key or with another one, is refused with one line saying which key it expects,
    before anything is written with the wrong key. ``create_data_dir`` False (every command but
    ``kvgw serve``): a data directory the catalog needs and that is not there is refused in one line
    (``gateway.datadir``), never created.
    """
    if create_data_dir:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    elif settings.catalog_url is None:
        datadir.require(settings)  # the embedded SQLite catalog lives there
    _refuse_sqlite_on_network_fs(settings.catalog_dsn)
    catalog = Catalog(settings.catalog_dsn, None)
    try:
        catalog.upgrade()
        catalog.bind_key(_catalog_box(settings, catalog,
                                      new_key=create_data_dir or settings.catalog_key_path.parent.is_dir()))
    except CatalogKeyMismatch as exc:
        catalog.close()
        raise ConfigurationError(
            f"the catalog {_where(catalog)} is encrypted with key {exc.expected or '(unrecorded)'}, not with "
            f"this key ({exc.given}, from {_key_source(settings)}): give every gateway and CLI of a catalog "
            "the same KVGW_CATALOG_KEY or KVGW_CATALOG_KEY_FILE"
        ) from None
    except BaseException:
        catalog.close()
        raise
    return catalog


def _catalog_box(settings: Settings, catalog: Catalog, *, new_key: bool = True) -> SecretBox:
    """The catalog's key; a new one (a new catalog) only where ``new_key`` allows creating its file."""
    key = settings.given_catalog_key() or read_key_file(settings.catalog_key_path)
    if key is None:
        if catalog.holds_secrets() or catalog.key_fingerprint() is not None:
            raise ConfigurationError(
                f"the catalog {_where(catalog)} holds credentials encrypted with key "
                f"{catalog.key_fingerprint() or '(unrecorded)'}, and no key was given (no KVGW_CATALOG_KEY, "
                f"no {settings.catalog_key_path}): set KVGW_CATALOG_KEY or KVGW_CATALOG_KEY_FILE to that key, "
                "or run from the data dir that holds it (--data-dir); a new key would make them unreadable"
            )
        if not new_key:
            raise datadir.missing(settings)
        key = create_key_file(settings.catalog_key_path)
    try:
        return SecretBox(key)
    except ValueError:
        raise ConfigurationError(
            f"the catalog key from {_key_source(settings)} is not a Fernet key (32 url-safe base64 bytes); "
            'make one with: python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
        ) from None


def _key_source(settings: Settings) -> str:
    if settings.catalog_key is not None:
        return "KVGW_CATALOG_KEY"
    if settings.secret_key is not None and is_fernet_key(settings.secret_key.get_secret_value()):
        return "KVGW_SECRET_KEY"
    return str(settings.catalog_key_path)


def _where(catalog: Catalog) -> str:
    return f"at {catalog.engine.url.render_as_string(hide_password=True)}"


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
    from gateway.lifecycle.policies import POLICIES

    try:
        TierId.parse(policy.write_tier)
    except ValueError:
        raise ConfigurationError(
            f"write tier must be {' or '.join(TierId.labels())}, not {policy.write_tier!r}"
        ) from None
    if not 0.0 < policy.low_watermark < policy.high_watermark <= 1.0:
        raise ConfigurationError("watermarks must satisfy 0 < low < high <= 1")
    if policy.eviction_policy not in POLICIES:
        raise ConfigurationError(f"unknown eviction policy {policy.eviction_policy!r}; one of {sorted(POLICIES)}")
    for name in ("max_chunk_bytes", "capacity_bytes", "s3_capacity_bytes", "default_ttl_seconds"):
        value = getattr(policy, name)
        if value is not None and value <= 0:
            raise ConfigurationError(f"{name} must be positive")
    if not 0 <= policy.max_lease_ms <= MAX_LEASE_MS:
        raise ConfigurationError(f"max_lease_ms must be 0 (no leases) to {MAX_LEASE_MS}")
    if policy.max_leased_bytes is not None and policy.max_leased_bytes < 0:
        raise ConfigurationError("max_leased_bytes must not be negative")
    if policy.etag_mode not in ETAG_MODES:
        raise ConfigurationError(f"etag mode must be {' or '.join(ETAG_MODES)}, not {policy.etag_mode!r}")


def bootstrap(settings: Settings, catalog: Catalog) -> RootCredentials | None:
    """First-start setup: the default bucket and root credentials. Returns credentials it generated.

    Safe to run on every start and from several gateways at once (conflicts mean someone else won).
    """
    if catalog.get_bucket(settings.default_bucket) is None:
        with contextlib.suppress(CatalogConflict):
            catalog.create_bucket(new_bucket_policy(settings.default_bucket, settings))
    if settings.root_access_key and settings.root_secret_key:
        wanted = settings.root_secret_key.get_secret_value()
        if not catalog.has_credential(settings.root_access_key):
            with contextlib.suppress(CatalogConflict):
                catalog.create_credential(
                    access_key=settings.root_access_key,
                    secret_key=wanted,
                    is_root=True,
                    description="root (from KVGW_ROOT_ACCESS_KEY)",
                )
        elif catalog.secret_of(settings.root_access_key) != wanted:
            # Refused, not applied: gateways sharing the catalog would otherwise flip the secret back
            # and forth as each restarts with its own environment.
            raise ConfigurationError(
                f"KVGW_ROOT_SECRET_KEY is not the secret the catalog holds for {settings.root_access_key}; "
                f"to change it run `kvgw cred rotate {settings.root_access_key} --secret-key NEW`, then set "
                "KVGW_ROOT_SECRET_KEY=NEW on every gateway (or set the old value back)"
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
    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.time) -> None:
        """``clock`` (unix seconds) dates chunks and drives expiry and eviction; tests pass a fake one."""
        self.settings = settings
        self.catalog = open_catalog(settings)
        self.generated_root = bootstrap(settings, catalog=self.catalog)
        self.directory = Directory(
            self.catalog, anonymous=anonymous_principal(anonymous=settings.anonymous, admin=settings.anonymous_admin),
            refresh_seconds=settings.catalog_refresh_seconds,
        )
        self.directory.load()
        self.index = ChunkIndex(
            settings.index_path,
            map_size=settings.index_map_size,
            sync=settings.index_sync,
            allow_network_fs=settings.index_allow_network_fs,
            touch_interval=settings.index_touch_seconds,
        )
        self.fs = PosixTier(settings.fs_root_path, fsync=settings.fsync, direct_writes=settings.fs_direct_writes,
                            visibility_seconds=settings.fs_visibility_seconds)
        self.tiers: dict[TierId, Tier] = {TierId.FS: self.fs}
        if settings.s3 is not None:
            from backends.s3 import S3Tier

            self.tiers[TierId.S3] = S3Tier(settings.s3)
        self.ledgers = Ledgers(self.directory, self.index)
        # the cluster: publishes every tier change to the feed, applies other gateways' to the index
        self.cluster = Cluster(settings, self.catalog.url, self.index, self.tiers, local=self.ledgers,
                               local_usage=self.ledgers.usage, clock=clock)
        # the change stream clients follow (stored / removed per bucket and prefix), read from the feed
        self.changes = (ChangeStream(self.cluster.db, self.index, self.cluster.subscriber.index_token)
                        if self.cluster.enabled else None)
        # read leases between lookup and load: granted in memory, shared through the catalog database
        self.leases = LeaseBook(self.cluster.db, self.cluster.member, sync_seconds=settings.lease_sync_seconds,
                                clock=clock)
        self.mover = TierMover(
            self.index, self.tiers, events=self.cluster.events, clock=clock,
            read_window_bytes=settings.read_window_bytes, prefetch_concurrency=settings.prefetch_concurrency,
        )
        # what capacity is enforced against, and admission under pressure reads (the whole tier's usage)
        usage: UsageSource = LargerUsage(self.cluster.usage, self.ledgers) if self.cluster.enabled else self.ledgers
        self.service = ChunkService(settings, self.directory, self.index, self.tiers, mover=self.mover,
                                    events=self.cluster.events, clock=clock,
                                    admit_writes=self.cluster.admit_writes, leases=self.leases,
                                    pressed=functools.partial(at_low_watermark, usage))
        # one process of the whole cluster runs eviction and TTL reclaim: the holder of the lifecycle lease
        self.leadership: Leadership | SoleLeader = (
            Leadership(LeaseStore(self.cluster.db.engine), self.cluster.member,
                       lease_seconds=settings.lifecycle_lease_seconds)
            if self.cluster.enabled else SoleLeader())
        self.lifecycle = LifecycleEngine(
            self.index, self.directory, self.mover, self.ledgers,
            usage=usage,
            leader=self.leadership, leases=self.leases,
            states=PolicyStates(self.cluster.db, self.cluster.member, clock=clock),
            save_seconds=settings.lifecycle_state_save_seconds,
            clock=clock, interval=settings.lifecycle_interval, budget=settings.lifecycle_budget)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        removed = await self.fs.cleanup_staging(self.settings.staging_max_age_seconds)
        if removed:
            log.info("removed %d staged files left by interrupted writes", removed)
        await self.cluster.start()
        await self.leadership.start()
        await self.leases.start()
        await self.lifecycle.start()
        settings = self.settings
        self._every(settings.catalog_refresh_seconds, "catalog refresh", self.directory.refresh)
        self._every(max(60.0, settings.staging_max_age_seconds / 4), "staging cleanup",
                    lambda: self.fs.cleanup_staging(settings.staging_max_age_seconds))
        s3 = self.tiers.get(TierId.S3)
        if s3 is not None:
            self._every(settings.s3_staging_cleanup_seconds, "S3 staging cleanup",
                        lambda: s3.cleanup_staging(settings.staging_max_age_seconds), leader_only=True)
        if self.cluster.enabled and self.settings.cluster_snapshot_seconds > 0:
            self._tasks.append(asyncio.create_task(self._share_snapshots(), name="kvgw-index-snapshots"))

    def _every(self, seconds: float, what: str, job: Callable[[], Awaitable[object]], *,
               leader_only: bool = False) -> None:
        """Run ``job`` every ``seconds`` until ``stop`` (only while this process is the lifecycle leader
        with ``leader_only``: jobs one gateway does for all). A failure is logged and the next round
        tries again; the job's earlier results (a catalog view, say) stay as they were."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(seconds)
                if leader_only and not self.leadership.is_leader():
                    continue
                try:
                    await job()
                except Exception:
                    log.exception("%s failed; trying again in %g s", what, seconds)

        self._tasks.append(asyncio.create_task(loop(), name=f"kvgw-{what.replace(' ', '-').lower()}"))

    async def _share_snapshots(self) -> None:
        """The lifecycle leader shares an index snapshot in the directory every
        ``cluster_snapshot_seconds``, so a gateway that joins starts from it (``gateway.cluster.snapshot``).
        Only the process that applies the feed to its index writes one (its index is current)."""
        while True:
            await asyncio.sleep(self.settings.cluster_snapshot_seconds)
            if not (self.leadership.is_leader() and self.cluster.subscribing):
                continue
            try:
                info = await self.cluster.write_snapshot()
                if info is not None:
                    log.info("shared an index snapshot: %d chunks at feed position %d", info.records, info.seq)
            except Exception:
                log.exception("writing the shared index snapshot failed")

    async def stop(self) -> None:
        await self.lifecycle.stop()
        await self.leadership.stop()
        await self.leases.stop()
        await self.service.close()
        await self.cluster.stop()
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
        self.leases.close()
        self.cluster.close()
        self.catalog.close()
