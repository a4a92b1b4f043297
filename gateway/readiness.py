"""``/readyz``: whether this gateway can serve, checking what each line claims, and which part failed.

- ``index``: the LMDB index answers a read transaction, and its directory is the one opened at start
  (same device and inode: a removed or replaced directory leaves the open environment working on
  deleted files, which would silently lose every update);
- ``fs``: a file can be created and removed in the tier's staging directory, and the filesystem has
  at least 1 MiB free;
- ``catalog``: the catalog answers a query;
- ``rebuild`` (reported, not failing readiness): an index rebuild from the tiers running or done.

The S3 tier is not part of readiness: with it down the gateway still serves everything the filesystem
tier holds (S3-only reads answer 503 meanwhile).

Blocking: run it in a worker thread.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from backends.tiers import TierId
from gateway.runtime import Gateway

FULL_BELOW_BYTES = 1 << 20
"""The filesystem tier counts as full below this many free bytes (or the chunk size limit, if smaller)."""


@dataclass(frozen=True, slots=True)
class DirectoryIdentity:
    device: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> DirectoryIdentity | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino)


class Readiness:
    """Built once the gateway is open (it remembers the index directory it opened)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._index_path = gateway.settings.index_path
        self._index_identity = DirectoryIdentity.of(self._index_path)

    def check(self) -> tuple[bool, dict[str, str]]:
        checks = {
            "index": self._index(),
            TierId.FS.label: self._fs(),
            "catalog": self._catalog(),
        }
        ready = all(value == "ok" for value in checks.values())
        rebuild = self._rebuild()
        if rebuild is not None:
            checks["rebuild"] = rebuild  # reported, never failing readiness: misses fall through meanwhile
        return ready, checks

    def _rebuild(self) -> str | None:
        """The index's rebuild from the tiers (a new, lost or lagging index): running, or how the last went."""
        cluster = self._gateway.cluster
        if cluster.resyncing:
            return "running: lookups fall through to the tiers; listings and usage complete when it ends"
        last = cluster.last_resync
        if last is None:
            return None
        return f"done: {last.chunks} chunks in {last.seconds:.1f} s"

    def _index(self) -> str:
        if DirectoryIdentity.of(self._index_path) != self._index_identity:
            return f"error: the index directory {self._index_path} was removed or replaced since start (restart)"
        try:
            self._gateway.index.count()
        except Exception as exc:
            return f"error: {type(exc).__name__}: {exc}"
        return "ok"

    def _fs(self) -> str:
        settings = self._gateway.settings
        staging = settings.fs_root_path / "staging"
        probe = staging / f".ready-{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
            stats = os.statvfs(staging)
        except OSError as exc:
            return f"error: cannot write in {staging}: {exc.strerror or exc}"
        free = stats.f_bavail * stats.f_frsize
        if free < min(settings.max_chunk_bytes, FULL_BELOW_BYTES):
            return f"error: full ({free} bytes free in {settings.fs_root_path})"
        return "ok"

    def _catalog(self) -> str:
        try:
            self._gateway.catalog.list_buckets()
        except Exception as exc:
            return f"error: {type(exc).__name__}"
        return "ok"
