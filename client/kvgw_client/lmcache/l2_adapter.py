"""kvgw as an L2 adapter of LMCache's multiprocess server, on the same client core.

Two ways to load it; both take the same ``adapter_params`` (the flat keys of ``read_client_settings``
plus ``prefetch_bytes`` and ``ttl_s``; credentials may come from $KVGW_ACCESS_KEY/$KVGW_SECRET_KEY)::

    --l2-adapter '{"type": "native_plugin", "module_path": "kvgw_client.lmcache.l2_adapter",
                   "class_name": "KvgwNativeClient",
                   "adapter_params": {"url": "http://127.0.0.1:9000", "bucket": "kvcache"}}'

    --l2-adapter '{"type": "plugin", "module_path": "kvgw_client.lmcache.l2_adapter",
                   "class_name": "KvgwL2Adapter",
                   "adapter_params": {"url": "http://127.0.0.1:9000", "bucket": "kvcache",
                                      "max_capacity_gb": 0}}'

``native_plugin`` constructs ``KvgwNativeClient(**adapter_params)`` and wraps it in LMCache's own
``NativeConnectorL2Adapter`` (event fds, task ids, bitmaps, client-side locks, byte accounting).
``plugin`` constructs ``KvgwL2Adapter``, which is that same wrapper around the same client, plus a
health-aware ``report_status`` and (LMCache 0.5.7) ``submit_touch`` as kvgw's ``touch``; LMCache finds
``KvgwL2AdapterConfig`` by its name. Both work with LMCache 0.5.6 and 0.5.7 (whose wrapper takes the
adapter's memory tags: kvgw is remote storage, ``MemoryTags(STORAGE, REMOTE)``).

The native-client protocol (LMCache 0.5.6/0.5.7, ``native_connector_l2_adapter.py``): ``submit_batch_*``
are called from LMCache's store/prefetch controller threads, under the adapter's lock, and must not
block: each schedules its work on the client's I/O loop and returns an id. When the work is done the
I/O thread queues ``(id, ok, error, per_key_bools)`` and signals ``event_fd()``; LMCache's demux
thread polls that fd and calls ``drain_completions()``. Buffers are LMCache's MemoryObj byte views,
valid until the completion is drained; loads are copied straight into them, and a load succeeds for a
key only when the chunk's size equals the buffer's and its checksum verified.

Failures are never raised into LMCache: a lookup finds nothing, a load reports False for the key, a
store task reports failure; all counted and logged once per burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
    NativeConnectorL2Adapter,
    _object_key_to_string,
)

from kvgw_client.chains import ParentMap
from kvgw_client.config import SettingsReader, credentials_from_env, read_client_settings
from kvgw_client.errors import ClientClosed
from kvgw_client.framing import ItemStatus, byte_view
from kvgw_client.health import CircuitState
from kvgw_client.http import KvgwClient, PutOutcome
from kvgw_client.prefetch import BytesSink, Prefetcher

try:  # LMCache 0.5.7: adapters declare the medium their bytes live in
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags

    MEMORY_TAGS: Any = MemoryTags(MemorySegment.STORAGE, MemoryResidency.REMOTE)
except ImportError:  # LMCache 0.5.6
    MEMORY_TAGS = None

logger = init_logger(__name__)

Completion = tuple[int, bool, str, list[bool] | None]
_Outcome = tuple[bool, str, list[bool] | None]


def same_chain(a: str, b: str) -> bool:
    """Whether two L2 keys (``model@rank@group@hash[@salt]``) can be neighbours in one prefix chain:
    same model, rank, object group and salt."""
    pa, pb = a.split("@"), b.split("@")
    return len(pa) >= 4 and len(pb) >= 4 and pa[:3] == pb[:3] and pa[4:] == pb[4:]


class _EventFd:
    """A readable-when-signalled fd: Linux eventfd, or a pipe elsewhere."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self._r = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self._r, self._w = os.pipe()
            os.set_blocking(self._r, False)
            os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def notify(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            if self._r == self._w:
                os.eventfd_write(self._w, 1)
            else:
                os.write(self._w, b"\0")

    def consume(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            if self._r == self._w:
                os.eventfd_read(self._r)
            else:
                while os.read(self._r, 4096):
                    pass

    def close(self) -> None:
        for fd in {self._r, self._w}:
            with contextlib.suppress(OSError):
                os.close(fd)


class KvgwNativeClient:
    """LMCache's native-client protocol over ``KvgwClient`` (see the module docstring)."""

    def __init__(self, **params: object) -> None:
        reader = SettingsReader(params)
        access_key, secret_key = credentials_from_env(os.environ)
        settings = read_client_settings(reader, access_key=access_key, secret_key=secret_key)
        prefetch_bytes = reader.get_int("prefetch_bytes", 0)
        ttl = reader.get_int("ttl_s", 0)
        unknown = reader.leftover(params)
        if unknown:
            raise ValueError(f"unknown kvgw L2 adapter params: {', '.join(unknown)}")
        if prefetch_bytes < 0:
            raise ValueError("prefetch_bytes must be >= 0")
        self.settings = settings
        self._ttl = ttl if ttl > 0 else None
        self._closed = False
        self._prefetcher: Prefetcher[bytearray] | None = None
        self._efd: _EventFd | None = None
        self._client = KvgwClient(settings, logger=logger)
        try:
            if prefetch_bytes > 0:
                self._prefetcher = Prefetcher(self._client, prefetch_bytes, BytesSink())
            self._efd = _EventFd()
        except BaseException:
            self.close()  # the client's I/O thread (and whatever else was made) must not outlive us
            raise
        self._parents = ParentMap(same_chain=same_chain)
        self._lock = threading.Lock()
        self._done: list[Completion] = []
        self._ids = itertools.count(1)
        logger.info(
            "kvgw L2 client: %s bucket %s, prefetch buffer %d bytes", settings.url, settings.bucket, prefetch_bytes
        )

    @property
    def client(self) -> KvgwClient:
        return self._client

    def stats(self) -> dict[str, object]:
        out = self._client.stats()
        if self._prefetcher is not None:
            out["prefetch"] = self._prefetcher.stats()
        return out

    # ------------------------------------------------------------ native-client protocol

    def event_fd(self) -> int:
        assert self._efd is not None
        return self._efd.fileno()

    def submit_batch_get(self, keys: list[str], buffers: Sequence[object]) -> int:
        return self._submit(lambda: self._get(list(keys), [byte_view(b, writable=True) for b in buffers]))

    def submit_batch_set(self, keys: list[str], buffers: Sequence[object]) -> int:
        return self._submit(lambda: self._set(list(keys), [byte_view(b) for b in buffers]))

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(lambda: self._exists(list(keys)))

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit(lambda: self._delete(list(keys)))

    def submit_batch_touch(self, keys: list[str]) -> None:
        """Reads done elsewhere (LMCache's L1 hits) count for kvgw's eviction: one ``touch`` call, in
        the background, nothing waits for it (not part of LMCache's native-client protocol: KvgwL2Adapter
        calls it for ``submit_touch``)."""
        if keys and not self._closed:
            with contextlib.suppress(ClientClosed):
                self._client.spawn(self._client.touch(list(keys), quiet=True))

    def drain_completions(self) -> list[Completion]:
        assert self._efd is not None
        self._efd.consume()
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._prefetcher is not None:
                self._prefetcher.close()
        finally:
            self._client.close()
            if self._efd is not None:
                self._efd.close()

    # ------------------------------------------------------------ work (I/O loop)

    def _submit(self, work: Callable[[], Coroutine[Any, Any, _Outcome]]) -> int:
        future_id = next(self._ids)

        async def run() -> None:
            try:
                ok, error, bools = await work()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must still complete the task, or LMCache waits forever
                logger.exception("kvgw L2 task failed")
                ok, error, bools = False, f"{type(exc).__name__}: {exc}", None
            self._complete(future_id, ok, error, bools)

        try:
            self._client.spawn(run())
        except ClientClosed:
            self._complete(future_id, False, "kvgw client closed", None)
        return future_id

    def _complete(self, future_id: int, ok: bool, error: str, bools: list[bool] | None) -> None:
        with self._lock:
            self._done.append((future_id, ok, error, bools))
        if self._efd is not None:
            self._efd.notify()

    async def _exists(self, keys: list[str]) -> _Outcome:
        self._parents.learn(keys)
        found = await self._client.exists(keys, quiet=True)
        if self._prefetcher is not None:
            present = [k for k, f in zip(keys, found, strict=True) if f]
            if present:
                self._prefetcher.stage(present, present=len(present))
        return True, "", found

    async def _get(self, keys: list[str], views: list[memoryview]) -> _Outcome:
        loaded = [False] * len(keys)
        rest: list[int] = []
        for i, key in enumerate(keys):
            if self._prefetcher is not None and self._prefetcher.tracks(key):
                data = await self._prefetcher.get(key)
                if data is not None and len(data) == len(views[i]):
                    views[i][:] = data
                    loaded[i] = True
                    continue
            rest.append(i)

        def into(j: int, length: int) -> memoryview | None:
            view = views[rest[j]]
            if length != len(view):
                self._client.counters.add("l2.bad_size")
                return None
            return view

        lost = False
        if rest:
            statuses = await self._client.batch_get_into([keys[i] for i in rest], into, quiet=True)
            for j, i in enumerate(rest):
                loaded[i] = statuses[j] is ItemStatus.OK
                lost = lost or statuses[j] is ItemStatus.LOST
        return not lost, "kvgw unavailable" if lost else "", loaded

    async def _set(self, keys: list[str], views: list[memoryview]) -> _Outcome:
        outcomes = await asyncio.gather(
            *(
                self._client.put(key, view, parent=self._parents.parent(key), ttl=self._ttl, quiet=True)
                for key, view in zip(keys, views, strict=True)
            )
        )
        # a DECLINED key is not stored but no failure: the task stays ok (LMCache 0.5.6's native wrapper has
        # no per-key store result, so it books the key as stored; its next lookup finds it absent)
        stored = [o is PutOutcome.STORED or o is PutOutcome.EXISTED for o in outcomes]
        ok = not any(o is PutOutcome.FAILED for o in outcomes)
        declined = sum(1 for o in outcomes if o is PutOutcome.DECLINED)
        if declined:
            self._client.counters.add("l2.put_declined", declined)
        return ok, "" if ok else "kvgw put failed", stored

    async def _delete(self, keys: list[str]) -> _Outcome:
        deleted = await asyncio.gather(*(self._client.delete(key, quiet=True) for key in keys))
        return True, "", list(deleted)


class KvgwL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    def __init__(self, params: dict[str, object], max_capacity_gb: float = 0.0) -> None:
        self.params = params
        self.max_capacity_gb = max_capacity_gb

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> KvgwL2AdapterConfig:
        params = {k: v for k, v in d.items() if k not in ("type", "max_capacity_gb")}
        cap = d.get("max_capacity_gb", 0.0)
        if isinstance(cap, bool) or not isinstance(cap, int | float) or cap < 0:
            raise ValueError("max_capacity_gb must be a non-negative number")
        # Fail at parse time, before any thread starts, on a missing url/bucket or a bad value.
        access_key, secret_key = credentials_from_env(os.environ)
        read_client_settings(SettingsReader(params), access_key=access_key, secret_key=secret_key)
        return cls(params, float(cap))

    @classmethod
    def help(cls) -> str:
        return (
            "kvgw L2 adapter (kvgw_client.lmcache.l2_adapter):\n"
            "- url (str, required), bucket (str, required)\n"
            "- access_key / secret_key (str): or $KVGW_ACCESS_KEY / $KVGW_SECRET_KEY; none = anonymous\n"
            "- prefetch_bytes (int): CPU staging buffer for looked-up chunks (default 0 = off)\n"
            "- ttl_s (int): TTL sent with every PUT (default none)\n"
            "- connect_timeout_s, read_timeout_s, control_timeout_s, transfer_timeout_s, retry_attempts,\n"
            "  retry_backoff_s, retry_backoff_max_s, failure_threshold, cooldown_s, cooldown_max_s,\n"
            "  pool_size, write_concurrency, max_keys_per_call, max_chunk_bytes, require_checksum\n"
            "- max_capacity_gb (float): capacity for LMCache's usage accounting (default 0 = off)"
        )


def _native_wrapper_takes_memory_tags() -> bool:
    """LMCache 0.5.7's NativeConnectorL2Adapter takes the adapter's memory tags (required, second)."""
    return "memory_tags" in inspect.signature(NativeConnectorL2Adapter.__init__).parameters


class KvgwL2Adapter(NativeConnectorL2Adapter):  # type: ignore[misc]
    config_class_name = "KvgwL2AdapterConfig"

    def __init__(self, config: KvgwL2AdapterConfig | dict[str, object], l1_memory_desc: object = None) -> None:
        if isinstance(config, dict):
            config = KvgwL2AdapterConfig.from_dict(config)
        self._kvgw = KvgwNativeClient(**config.params)
        options: dict[str, Any] = {
            "max_capacity_gb": config.max_capacity_gb,
            "type_name": "kvgw",
            "extra_status": {"url": self._kvgw.settings.url, "bucket": self._kvgw.settings.bucket},
        }
        if _native_wrapper_takes_memory_tags():
            options["memory_tags"] = MEMORY_TAGS
        try:
            super().__init__(self._kvgw, **options)
        except BaseException:
            # LMCache never gets this object, so nobody else would close the client: its I/O thread,
            # connection pool and event fd go now. (What the wrapper made before failing is LMCache's.)
            self._kvgw.close()
            raise

    def get_memory_tags(self) -> Any:
        """LMCache 0.5.7: kvgw keeps bytes off this host (``MemoryTags(STORAGE, REMOTE)``)."""
        return MEMORY_TAGS

    def submit_touch(self, keys: list[Any]) -> None:
        """LMCache 0.5.7 (``StorageManager.touch_cached_keys``): LMCache's own listeners hear of the access
        as from the base class, and kvgw's eviction too (one ``touch`` call in the background)."""
        parent = getattr(super(), "submit_touch", None)
        if parent is not None:
            parent(keys)
        self._kvgw.submit_batch_touch([_object_key_to_string(k) for k in keys])

    def report_status(self) -> dict[str, Any]:
        status: dict[str, Any] = super().report_status()
        status["is_healthy"] = bool(status.get("is_healthy")) and self._kvgw.client.health is CircuitState.CLOSED
        status["kvgw"] = self._kvgw.stats()
        return status
