"""kvgw as SGLang's HiCache L3 storage backend (SGLang 0.5.23), over kvgw's native chunk API.

Launch flags (docs/sglang.md lists every key with its default)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvgw", "module_path": "kvgw_client.sglang",
        "class_name": "KvgwHiCacheStorage", "interface_v1": 1,
        "url": "http://kvgw.internal:8080", "bucket": "kvcache", "access_key": "...", "secret_key": "..."}'

SGLang's factory checks that the class subclasses ``HiCacheStorage`` and calls ``cls(storage_config,
{})``; its cache controller then calls ``register_mem_pool_host(pool)`` and ``on_host_pools_registered()``
and, with ``interface_v1``, moves pages with ``batch_get_v1`` / ``batch_set_v1`` in batches of up to
128 pages. How each call maps to kvgw:

* ``batch_exists(keys)``: one ``prefix`` call (the length of the leading run of stored pages).
* ``batch_get_v1(keys, host_indices)``: one batch-get whose frames are copied straight into the host
  pool's page buffers (``get_page_buffer_meta``: pointers and sizes; a page's bytes are its buffers
  back to back), each checked for size and xxh3-64 before it counts. The result stops at a miss as
  SGLang expects (it counts the leading run).
* ``batch_set_v1(keys, host_indices)``: one ``exists`` call, then a PUT per missing page, all in
  flight at once (``write_concurrency`` at a time), sent from the page buffers without a copy. Each
  page names its predecessor as ``X-Kvgw-Parent`` (the previous page of the batch; for the first, the
  last of ``extra_info.prefix_keys`` when SGLang passes them, else the one learned from lookups), so
  kvgw's prefix-aware eviction knows the chain. MLA models: only the writer rank (rank 0) stores.
* ``get/set/batch_get/batch_set/exists`` (the generic interface, ``interface_v1: 0``): flat pages as
  torch tensors, read into and written from their memory the same way.
* ``clear()``: deletes this rank's pages (``list`` + ``DELETE``; the credential needs the delete
  grant, ``kvgw cred create --bucket B --write --delete``). ``get_stats()``: SGLang's
  ``StorageMetrics`` (pages and GiB/s per batch) when ``enable_storage_metrics``; ``stats()``: kvgw's
  counters.

These calls run on SGLang's synchronous storage threads, and an exception raised into SGLang disables
its L3 silently. So nothing here raises after construction: a failure is a miss or a failed set,
counted in ``stats()`` and logged once per burst; and no call blocks longer than its timeout
(``lookup_timeout_s``, ``io_timeout_s``, ``clear_timeout_s``). Network I/O runs on the client's own
I/O thread; a page is never written into after its call returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvgw_client.chains import ParentMap
from kvgw_client.framing import Destination, ItemStatus
from kvgw_client.health import Counters, FailureLog
from kvgw_client.hicache import (
    HiCacheSettings,
    RankScope,
    name_prefix,
    page_name,
    pointer_view,
    split_pages,
)
from kvgw_client.http import KvgwClient, Payload, PutOutcome
from kvgw_client.wire import Retention

logger = logging.getLogger(__name__)

_CLEAR_PAGE = 1000
_GIB = float(1 << 30)

__all__ = ["KvgwHiCacheStorage"]


class KvgwHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 storage in kvgw (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = HiCacheSettings.from_extra_config(getattr(storage_config, "extra_config", None), os.environ)
        self.scope = RankScope.of(storage_config)
        self.key_prefix = name_prefix(self.settings.prefix, self.scope)
        self.is_writer = self.scope.is_writer
        self.enable_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.mem_pool_host: Any = None
        self.counters = Counters()
        self._client = KvgwClient(self.settings.client, logger=logger)
        self._parents = ParentMap(self.settings.parent_map_size)
        self._failures = FailureLog(logger, f"kvgw HiCache {self.settings.client.url}", time.monotonic)
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": [],
        }
        logger.info(
            "kvgw HiCache storage: %s bucket %s, pages named %s/<hash>%s",
            self.settings.client.url, self.settings.client.bucket, self.key_prefix or "",
            "" if self.is_writer else " (MLA reader rank: stores nothing)",
        )

    # ------------------------------------------------------------------ SGLang's life cycle

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def on_host_pools_registered(self) -> None:
        pool = self.mem_pool_host
        logger.info(
            "kvgw HiCache storage: host pool %s, layout %s, page size %s tokens",
            type(pool).__name__, getattr(pool, "layout", "?"), getattr(pool, "page_size", "?"),
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    # ------------------------------------------------------------------ helpers

    @property
    def client(self) -> KvgwClient:
        return self._client

    def name(self, key: str) -> str:
        """The kvgw key of SGLang page ``key``."""
        return page_name(self.key_prefix, key)

    def stats(self) -> dict[str, object]:
        """kvgw's counters: the client's (calls, bytes, failures) and this backend's (``hicache``)."""
        out = self._client.stats()
        out["hicache"] = self.counters.snapshot()
        out["hicache_failures"] = self._failures.counts()
        return out

    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def _failed(self, op: str, exc: BaseException) -> None:
        """Something other than the gateway failed (a bad index, an SGLang surprise): counted, logged
        once per burst, never raised."""
        self._failures.failure(op, type(exc).__name__, str(exc)[:300])

    def _page_views(self, host_indices: Any, count: int) -> list[list[memoryview]]:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("no host pool registered")
        page_size = int(pool.page_size)
        if len(host_indices) != count * page_size:
            raise ValueError(f"{len(host_indices)} host indices for {count} pages of {page_size} tokens")
        addresses, sizes = pool.get_page_buffer_meta(host_indices)
        return [[pointer_view(a, n) for a, n in page] for page in split_pages(addresses, sizes, count)]

    def _chain(self, names: list[str], extra_info: Any) -> list[str | None]:
        """Parents of a run of pages stored together, and what they teach about the chain."""
        prefix_keys = getattr(extra_info, "prefix_keys", None)
        if prefix_keys:
            self._parents.learn([self.name(prefix_keys[-1]), names[0]])
        parents = self._parents.parents_of_run(names)
        self._parents.learn(names)
        return parents

    def _learn(self, names: list[str], extra_info: Any) -> None:
        prefix_keys = getattr(extra_info, "prefix_keys", None)
        self._parents.learn(([self.name(prefix_keys[-1])] if prefix_keys else []) + names)

    def _record(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if not self.enable_metrics or pages == 0:
            return
        elapsed = max(time.perf_counter() - started, 1e-9)
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / elapsed / _GIB)

    def _fetch(self, names: list[str], dests: list[list[memoryview]]) -> list[bool]:
        """One batch-get straight into ``dests`` (a page's buffers); True where a page arrived whole."""
        sizes = [sum(len(v) for v in d) for d in dests]

        def into(index: int, length: int) -> Destination | None:
            if length != sizes[index]:
                self._count("size_mismatch")
                return None
            return dests[index]

        statuses = self._client.blocking.batch_get_into(names, into, quiet=True, timeout=self.settings.io_timeout)
        ok = [s is ItemStatus.OK for s in statuses]
        self._count("get.pages", len(names))
        self._count("get.hits", sum(ok))
        return ok

    def _retentions(self, count: int, extra_info: Any) -> list[Retention | None]:
        """``shared`` for the pages of a run that lie within the first ``shared_prefix_tokens`` tokens of
        their prompt (a system prompt every request starts with), found from how many pages precede the
        run (``prefix_keys``); nothing where that is unknown."""
        limit = self.settings.shared_prefix_tokens
        prefix_keys = getattr(extra_info, "prefix_keys", None)
        pool = self.mem_pool_host
        if not limit or prefix_keys is None or pool is None:
            return [None] * count
        page = int(pool.page_size)
        first = len(prefix_keys)
        return [Retention.SHARED if (first + i + 1) * page <= limit else None for i in range(count)]

    def _store(self, names: list[str], bodies: Sequence[Payload], parents: list[str | None],
               retentions: Sequence[Retention | None] | None = None) -> list[bool]:
        """PUT the pages not stored yet, all in flight at once; True where the page is stored."""
        present = [False] * len(names)
        if self.settings.skip_existing:
            present = self._client.blocking.exists(names, quiet=True, timeout=self.settings.lookup_timeout)
        todo = [i for i, p in enumerate(present) if not p]
        classes = list(retentions) if retentions is not None else [None] * len(names)
        self._count("set.shared", sum(1 for i in todo if classes[i] is Retention.SHARED))
        outcomes = self._client.io.call(self._client.put_many(
            [names[i] for i in todo], [bodies[i] for i in todo], parents=[parents[i] for i in todo],
            ttl=self.settings.ttl, retention=[classes[i] for i in todo], timeout=self.settings.io_timeout))
        ok = list(present)
        for i, outcome in zip(todo, outcomes, strict=True):
            # DECLINED (admission under pressure) answers True, as a page stored and evicted at once would:
            # SGLang warns and stops the backup on False, and a later lookup finds the page absent anyway
            ok[i] = outcome is not PutOutcome.FAILED
        self._count("set.pages", len(names))
        self._count("set.existed", len(names) - len(todo))
        self._count("set.declined", sum(1 for o in outcomes if o is PutOutcome.DECLINED))
        self._count("set.failed", ok.count(False))
        return ok

    # ------------------------------------------------------------------ lookups

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        try:
            names = [self.name(k) for k in keys]
            self._learn(names, extra_info)
            found = self._client.blocking.prefix(names, quiet=True, timeout=self.settings.lookup_timeout)
            self._count("exists.pages", len(keys))
            self._count("exists.hits", found)
            return found
        except Exception as exc:
            self._failed("batch_exists", exc)
            return 0

    def exists(self, key: str) -> bool:
        try:
            found = self._client.blocking.exists([self.name(key)], quiet=True, timeout=self.settings.lookup_timeout)
            return bool(found[0])
        except Exception as exc:
            self._failed("exists", exc)
            return False

    # ------------------------------------------------------------------ the zero-copy interface

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        try:
            started = time.perf_counter()
            names = [self.name(k) for k in keys]
            self._learn(names, extra_info)
            dests = self._page_views(host_indices, len(keys))
            ok = self._fetch(names, dests)
            got = ok.index(False) if False in ok else len(ok)
            self._record("prefetch", got, sum(sum(len(v) for v in d) for d in dests[:got]), started)
            return ok
        except Exception as exc:
            self._failed("batch_get_v1", exc)
            return [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer:
            self._count("set.skipped_reader", len(keys))
            return [True] * len(keys)
        try:
            started = time.perf_counter()
            names = [self.name(k) for k in keys]
            parents = self._chain(names, extra_info)
            pages = self._page_views(host_indices, len(keys))
            ok = self._store(names, pages, parents, self._retentions(len(keys), extra_info))
            self._record("backup", len(keys), sum(sum(len(v) for v in p) for p in pages), started)
            return ok
        except Exception as exc:
            self._failed("batch_set_v1", exc)
            return [False] * len(keys)

    # ------------------------------------------------------------------ the generic interface

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if not keys:
            return []
        try:
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            if len(targets) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
            names = [self.name(k) for k in keys]
            self._learn(names, None)
            if all(t is None for t in targets):
                return self._get_new(names)
            dests = [[_tensor_view(t)] for t in targets]
            ok = self._fetch(names, dests)
            return [t if good else None for t, good in zip(targets, ok, strict=True)]
        except Exception as exc:
            self._failed("batch_get", exc)
            return [None] * len(keys)

    def _get_new(self, names: list[str]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for name in names:
            data = self._client.blocking.get(name, quiet=True, timeout=self.settings.io_timeout)
            out.append(None if data is None else torch.frombuffer(data, dtype=torch.uint8) if data else
                       torch.empty(0, dtype=torch.uint8))
        self._count("get.pages", len(names))
        self._count("get.hits", sum(t is not None for t in out))
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        page = value if value is not None else target_location
        return self.batch_set([key], [page])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if not keys:
            return True
        if not self.is_writer:
            self._count("set.skipped_reader", len(keys))
            return True
        try:
            pages = list(values if values is not None else target_locations)
            if len(pages) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
            names = [self.name(k) for k in keys]
            parents = self._chain(names, None)
            tensors = [p.contiguous() for p in pages]  # referenced until the PUTs are done: views do not keep them
            return all(self._store(names, [_tensor_view(t) for t in tensors], parents))
        except Exception as exc:
            self._failed("batch_set", exc)
            return False

    # ------------------------------------------------------------------ the rest

    def clear(self) -> bool:
        """Delete every page of this rank (this ``prefix``, model and rank scope; with neither a prefix
        nor a scope, the whole bucket). True when all are gone."""
        deadline = time.monotonic() + self.settings.clear_timeout
        prefix = f"{self.key_prefix}/" if self.key_prefix else ""
        deleted = 0
        try:
            after: str | None = None
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"clear: not done within {self.settings.clear_timeout}s")
                keys, truncated = self._client.blocking.list_keys(
                    prefix, after=after, limit=_CLEAR_PAGE, timeout=min(remaining, self.settings.lookup_timeout * 5))
                if keys:
                    self._client.io.call(self._delete_all(keys, deadline))
                    deleted += len(keys)
                    after = keys[-1]
                if not truncated:
                    break
            logger.info("kvgw HiCache storage: cleared %d pages under %r", deleted, prefix)
            self._count("cleared", deleted)
            return True
        except Exception as exc:
            self._failed("clear", exc)
            logger.warning("kvgw HiCache storage: clear failed after %d pages: %s", deleted, exc)
            return False

    async def _delete_all(self, keys: list[str], deadline: float) -> None:
        gate = asyncio.Semaphore(self.settings.client.write_concurrency)

        async def one(key: str) -> None:
            async with gate:
                await self._client.delete(key, timeout=max(deadline - time.monotonic(), 0.001))

        for result in await asyncio.gather(*(one(k) for k in keys), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (empty unless ``enable_storage_metrics``)."""
        with self._metrics_lock:
            drained = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # the serving runtime is not importable (a test harness): nothing to report into
            return None
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(int(v) for v in drained["prefetch_pgs"])
        metrics.backup_pgs.extend(int(v) for v in drained["backup_pgs"])
        metrics.prefetch_bandwidth.extend(drained["prefetch_bandwidth"])
        metrics.backup_bandwidth.extend(drained["backup_bandwidth"])
        return metrics

    def __repr__(self) -> str:
        return f"<KvgwHiCacheStorage {self.settings.client.url} bucket={self.settings.client.bucket} {self.key_prefix}>"


def _tensor_view(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("pages must be contiguous CPU tensors")
    return pointer_view(tensor.data_ptr(), tensor.numel() * tensor.element_size())
