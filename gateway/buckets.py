"""Buckets as a small service: create, delete (only when empty), list with creation dates; and the one
place a new bucket's default policy comes from (``new_bucket_policy``).

Used by the S3 API (CreateBucket, DeleteBucket, ListBuckets) and the CLI (``kvgw bucket ...``).
Every change is a catalog write followed by ``Directory.refresh()``, so this gateway sees it at once
and gateways sharing the catalog within their refresh interval.

Emptiness is decided by the index (``list_names``): a bucket whose index holds no live chunk is
empty. A chunk another gateway wrote into a shared directory and this index has not seen yet does not
stop the delete; it stays in the tier and is found again if the bucket is re-created.

The catalog is synchronous (SQLAlchemy); every call here runs it in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import select

from backends.catalog.models import Bucket
from backends.catalog.store import BucketPolicy, Catalog, CatalogConflict
from backends.index import ChunkIndex
from gateway.access import Directory
from gateway.config import Settings
from gateway.errors import (
    BucketAlreadyOwned,
    BucketNotEmpty,
    ChunkTooLarge,
    EmptyChunk,
    InvalidBucketName,
    NoSuchBucket,
)
from kvgw_client.keys import is_valid_bucket_name

_EMPTY_SCAN_PAGE = 256


def check_chunk_size(bucket: BucketPolicy, size: int) -> None:
    """The per-bucket size rules, the one check both APIs (and the service) apply: at most
    ``max_chunk_bytes``, and never empty unless the bucket allows empty objects (EmptyChunk)."""
    if size > bucket.max_chunk_bytes:
        raise ChunkTooLarge(f"{size} bytes exceeds the bucket limit of {bucket.max_chunk_bytes}")
    if size == 0 and not bucket.allow_empty_objects:
        raise EmptyChunk.in_bucket(bucket.name)


def filesystem_size(path: os.PathLike[str] | str) -> int:
    """Bytes of the filesystem holding ``path`` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    stats = os.statvfs(probe)
    return stats.f_blocks * stats.f_frsize


def new_bucket_policy(name: str, settings: Settings) -> BucketPolicy:
    """A new bucket's policy: the chunk limit from settings, and a filesystem-tier capacity of
    ``default_capacity_fraction`` of the filesystem the tier lives on, measured now (so nothing fills
    the disk by default; 0 leaves the capacity unset: the tier then grows until the disk is full)."""
    capacity = None
    if settings.default_capacity_fraction > 0:
        capacity = int(filesystem_size(settings.fs_root_path) * settings.default_capacity_fraction)
    return BucketPolicy(name, settings.max_chunk_bytes, capacity_bytes=capacity)


def describe_policy(policy: BucketPolicy) -> str:
    """What the lifecycle will do with the bucket, in one sentence (banner, ``kvgw bucket list``)."""
    parts = []
    if policy.capacity_bytes is None:
        parts.append("no filesystem-tier capacity: it grows until the disk is full (set --capacity-bytes)")
    else:
        where = "demoted to S3" if policy.write_through or policy.s3_capacity_bytes is not None else "evicted"
        parts.append(f"above {policy.high_watermark:.0%} of {_gib(policy.capacity_bytes)} on the filesystem tier, "
                     f"chunks are {where} in {policy.eviction_policy} order down to {policy.low_watermark:.0%}")
    if policy.default_ttl_seconds:
        parts.append(f"chunks expire after {policy.default_ttl_seconds} s unless a PUT says otherwise")
    return "; ".join(parts)


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"


class BucketService:
    """Bucket lifecycle over the catalog, the directory view and the index."""

    def __init__(self, catalog: Catalog, directory: Directory, index: ChunkIndex, *,
                 new_policy: Callable[[str], BucketPolicy], clock: Callable[[], float] = time.time) -> None:
        self._catalog = catalog
        self._directory = directory
        self._index = index
        self._new_policy = new_policy
        self._clock = clock
        self._created: dict[str, float] = {}

    async def create(self, name: str) -> BucketPolicy:
        """A new bucket with the gateway's default policy. BucketAlreadyOwnedByYou if it exists."""
        if not is_valid_bucket_name(name):
            raise InvalidBucketName(f"invalid bucket name {name!r}")
        policy = self._new_policy(name)
        try:
            await asyncio.to_thread(self._catalog.create_bucket, policy)
        except CatalogConflict:
            raise BucketAlreadyOwned(f"bucket {name!r} already exists") from None
        await self._directory.refresh()
        return policy

    async def delete(self, name: str) -> None:
        """Remove an empty bucket (NoSuchBucket, BucketNotEmpty otherwise). Grants go with it."""
        await self._directory.bucket(name)
        if not await self.is_empty(name):
            raise BucketNotEmpty(f"bucket {name!r} holds objects")
        if not await asyncio.to_thread(self._catalog.delete_bucket, name):
            raise NoSuchBucket(f"bucket {name!r} does not exist")
        self._created.pop(name, None)
        await self._directory.refresh()

    async def is_empty(self, name: str) -> bool:
        """No live (unexpired) chunk of ``name`` in the index; pages through expired ones."""

        def scan() -> bool:
            start = ""
            now = self._clock()
            while True:
                page = self._index.list_names(name, start, _EMPTY_SCAN_PAGE)
                if any(entry.alive(now) for entry in page):
                    return False
                if len(page) < _EMPTY_SCAN_PAGE:
                    return True
                start = page[-1].key + "\x00"

        return await asyncio.to_thread(scan)

    async def list(self) -> list[tuple[BucketPolicy, float]]:
        """Every bucket with its creation time (unix seconds), by name."""
        buckets = self._directory.buckets()
        if any(b.name not in self._created for b in buckets):
            self._created.update(await asyncio.to_thread(self._creation_times))
        now = self._clock()
        return [(b, self._created.get(b.name, now)) for b in buckets]

    def _creation_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with contextlib.closing(self._catalog.engine.connect()) as conn:
            for name, created in conn.execute(select(Bucket.name, Bucket.created_at)):
                if isinstance(created, datetime):
                    aware = created if created.tzinfo is not None else created.replace(tzinfo=UTC)  # SQLite: UTC
                    out[name] = aware.timestamp()
        return out
