"""Buckets as a small service: create, delete (only when empty), list with creation dates.

Used by the S3 API (CreateBucket, DeleteBucket, ListBuckets); the CLI keeps its own catalog calls.
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
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import select

from backends.catalog.models import Bucket
from backends.catalog.store import BucketPolicy, Catalog, CatalogConflict
from backends.index import ChunkIndex
from gateway.access import Directory
from gateway.errors import KvgwError, NoSuchBucket
from gateway.keys import is_valid_bucket_name

_EMPTY_SCAN_PAGE = 256


class InvalidBucketName(KvgwError):
    code = "InvalidBucketName"
    default_message = "the bucket name breaks the naming rules"


class BucketAlreadyOwned(KvgwError):
    code = "BucketAlreadyOwnedByYou"
    default_message = "the bucket already exists"


class BucketNotEmpty(KvgwError):
    code = "BucketNotEmpty"
    default_message = "the bucket is not empty"


class BucketService:
    """Bucket lifecycle over the catalog, the directory view and the index."""

    def __init__(self, catalog: Catalog, directory: Directory, index: ChunkIndex, *, max_chunk_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self._catalog = catalog
        self._directory = directory
        self._index = index
        self._max_chunk_bytes = max_chunk_bytes
        self._clock = clock
        self._created: dict[str, float] = {}

    async def create(self, name: str) -> BucketPolicy:
        """A new bucket with the gateway's default policy. BucketAlreadyOwnedByYou if it exists."""
        if not is_valid_bucket_name(name):
            raise InvalidBucketName(f"invalid bucket name {name!r}")
        policy = BucketPolicy(name, self._max_chunk_bytes)
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
