"""LMCache 0.5.6 / 0.5.7 remote connector that keeps KV chunks in kvgw, over the native chunk API.

Configuration (LMCache YAML or ``LMCACHE_*`` environment), with ``max_local_cpu_size > 0``; LMCache's own
``remote_url`` names the gateway (``http(s)://host:port[/bucket]``), kvgw's adapter claims it::

    remote_url: http://127.0.0.1:9000/kvcache                   # bucket from the path, or kvgw.bucket
    remote_storage_plugins: ["kvgw"]                            # loads the adapter below
    extra_config:
      remote_storage_plugin.kvgw.module_path: kvgw_client.lmcache.connector
      remote_storage_plugin.kvgw.class_name: KvgwConnectorAdapter
      kvgw.access_key: ...                                      # or $KVGW_ACCESS_KEY / $KVGW_SECRET_KEY
      kvgw.secret_key: ...
      kvgw.prefetch_bytes: 268435456                            # CPU staging buffer; 0 disables

Without ``remote_url`` the plugin itself is the backend (``class_name: KvgwConnector`` or
``KvgwConnectorAdapter``) and ``kvgw.url`` / ``kvgw.bucket`` name the gateway. With an http(s)
``remote_url``, LMCache builds two remote backends from such a config (one per plugin entry, one for
``remote_url``): the plugin entry's declines (``KvgwPluginEntryOnly``, logged once by LMCache as
"Failed to create remote backend for plugin kvgw") so every chunk is stored and looked up once.

All ``kvgw.*`` keys are listed in docs/lmcache-0.5.6-interfaces.md; an unknown one fails start-up
(LMCache then only logs the error and runs without this backend: check that the connector loaded).
With ``class_name: KvgwConnectorAdapter`` the plugin may also be named ``kvgw.<instance>`` and take
per-instance settings as ``remote_storage_plugin.kvgw.<instance>.<key>``.

How it maps LMCache's calls (thread and loop as LMCache 0.5.6 and 0.5.7 make them):

* lookup, sync path (lookup thread): ``batched_contains`` -> one ``prefix`` call, then the present
  prefix is staged in the background; async path (``enable_async_loading``, LMCache's loop):
  ``batched_async_contains`` likewise. Both also learn each key's predecessor (parent).
* retrieve: ``batched_get``/``get``/``batched_get_non_blocking`` (LMCache's loop) take staged chunks
  from memory, wait for ones in flight, and fetch the rest with one batch-get whose payloads are
  copied straight into MemoryObjs allocated from LMCache's LocalCPUBackend.
* store: ``batched_put``/``put`` (LMCache's loop): one PUT per chunk with its parent key; returns only
  after the buffer was sent (LMCache drops its reference right after).
* ``exists``/``exists_sync``/``remove_sync``/``ping``/``close`` as their names say.

Nothing here ever raises into LMCache or blocks its loop on the network: every call uses
``quiet=True``; a dead or slow gateway, a 5xx, a malformed answer make a get return None and a lookup
find nothing, counted in ``stats()`` and logged once per burst. Network I/O runs on the client's own
I/O thread; LMCache's loop only awaits futures. Payload copies and allocations for retrieves happen
on that I/O thread too (LocalCPUBackend's allocator is locked, and we never let it busy-wait).

Chunk format: with LMCache's ``save_chunk_meta`` (its default) a chunk is ``RemoteMetadata`` followed
by the tensor bytes, as LMCache's FS connector writes it; with ``save_chunk_meta: false`` it is the raw
tensor bytes, as LMCache's S3 connector writes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvgw_client.chains import ParentMap
from kvgw_client.config import ClientSettings, SettingsReader, credentials_from_env, read_client_settings
from kvgw_client.framing import BatchItem, Destination, byte_view
from kvgw_client.http import KvgwClient, Payload, PutOutcome
from kvgw_client.prefetch import Prefetcher
from kvgw_client.wire import Hint, Retention

try:  # LMCache 0.5.7 moved the in-process protocol under lmcache.inprocess
    from lmcache.inprocess.v1.protocol import RemoteMetadata
except ImportError:  # LMCache 0.5.6
    from lmcache.v1.protocol import RemoteMetadata

T = TypeVar("T")

logger = init_logger(__name__)

SHARED_PREFIX = "kvgw."
PLUGIN_TYPE = "kvgw"
DEFAULT_PREFETCH_BYTES = 256 << 20
PROBE_TTL_S = 600
URL_SCHEMES = ("http://", "https://")


def gateway_from_remote_url(remote_url: str) -> dict[str, object]:
    """``url`` (and ``bucket``, when the path names one) from LMCache's ``remote_url``:
    ``http(s)://host:port[/bucket]``."""
    parts = urlsplit(remote_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"remote_url {remote_url!r}: expected http(s)://host[:port][/bucket]")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"remote_url {remote_url!r}: no credentials, query or fragment (use kvgw.access_key ...)")
    segments = [s for s in parts.path.split("/") if s]
    if len(segments) > 1:
        raise ValueError(f"remote_url {remote_url!r}: the path is the bucket name, one segment")
    out: dict[str, object] = {"url": f"{parts.scheme}://{parts.netloc}"}
    if segments:
        out["bucket"] = segments[0]
    return out


def _same_url(a: object, b: object) -> bool:
    return isinstance(a, str) and isinstance(b, str) and a.rstrip("/") == b.rstrip("/")


@dataclass(frozen=True)
class ConnectorSettings:
    client: ClientSettings
    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    ttl: int | None = None  # X-Kvgw-TTL on every PUT
    lookup_timeout: float = 2.0  # deadline of a lookup (all attempts), seconds
    parent_map_size: int = 1 << 16

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object] | None, plugin_name: str | None, environ: Mapping[str, str],
        remote_url: str | None = None,
    ) -> ConnectorSettings:
        """Settings from ``extra_config`` (``remote_storage_plugin.<plugin>.<key>`` before ``kvgw.<key>``);
        with ``remote_url`` the gateway's address (and bucket, from the path) come from there, and a
        ``url``/``bucket`` setting that says otherwise is an error."""
        extra = extra or {}
        shared = {k[len(SHARED_PREFIX) :]: v for k, v in extra.items() if k.startswith(SHARED_PREFIX)}
        instance: dict[str, object] = {}
        if plugin_name:
            prefix = f"remote_storage_plugin.{plugin_name}."
            instance = {
                k[len(prefix) :]: v
                for k, v in extra.items()
                if k.startswith(prefix) and k[len(prefix) :] not in ("module_path", "class_name")
            }
        from_url: dict[str, object] = {}
        if remote_url is not None:
            from_url = gateway_from_remote_url(remote_url)
            for key, value in from_url.items():
                for source in (instance, shared):
                    given = source.get(key)
                    if given is not None and not (given == value or (key == "url" and _same_url(given, value))):
                        raise ValueError(f"kvgw.{key} {given!r} contradicts remote_url {remote_url!r}")
        reader = SettingsReader(from_url, instance, shared)
        access_key, secret_key = credentials_from_env(environ)
        client = read_client_settings(reader, access_key=access_key, secret_key=secret_key)
        ttl = reader.get_int("ttl_s", 0)
        settings = cls(
            client=client,
            prefetch_bytes=reader.get_int("prefetch_bytes", DEFAULT_PREFETCH_BYTES),
            ttl=ttl if ttl > 0 else None,
            lookup_timeout=reader.get_float("lookup_timeout_s", 2.0),
            parent_map_size=reader.get_int("parent_map_size", 1 << 16),
        )
        unknown = reader.leftover(shared) + reader.leftover(instance)
        if unknown:
            raise ValueError(f"unknown kvgw connector settings: {', '.join(sorted(set(unknown)))}")
        if settings.prefetch_bytes < 0 or settings.lookup_timeout <= 0:
            raise ValueError("prefetch_bytes must be >= 0 and lookup_timeout_s > 0")
        return settings


RETENTION_CONFIG = "lmcache.kvgw.retention"
"""A request config (vLLM: ``kv_transfer_params``) naming the retention class of the chunks a request
stores: ``shared``, ``normal`` or ``one-off`` (``X-Kvgw-Retention``)."""
SESSION_END_CONFIG = "lmcache.kvgw.session_end"
"""A request config saying the request is its session's last turn: the chunks it stores are written
``one-off`` (unless it names a retention class) and the ones it loads get the ``session-ended`` hint."""


def request_hints(keys: Sequence[CacheEngineKey]) -> tuple[Retention | None, bool]:
    """The retention class and whether the session ends, from the request configs LMCache keeps with a
    request's keys (``CacheEngineKey.request_configs``: every ``lmcache.*`` entry of vLLM's
    ``kv_transfer_params``; they do not change a key's identity). Unknown values count as absent."""
    configs = getattr(keys[0], "request_configs", None) if keys else None
    if not isinstance(configs, Mapping):
        return None, False
    ended = configs.get(SESSION_END_CONFIG)
    session_end = ended is True or str(ended).strip().lower() in ("1", "true", "yes")
    retention: Retention | None = None
    named = configs.get(RETENTION_CONFIG)
    if named is not None:
        with contextlib.suppress(ValueError):
            retention = Retention(str(named).strip().lower())
    if retention is None and session_end:
        retention = Retention.ONE_OFF
    return retention, session_end


def _is_health_probe_key(key: CacheEngineKey) -> bool:
    """The key LMCache's RemoteBackendHealthCheck writes and reads back to test recovery."""
    return bool(key.model_name == "test" and key.world_size == 1 and key.worker_id == 0 and key.chunk_hash == 0)


class _Landing:
    """One chunk on its way into LMCache memory: a full-size MemoryObj (plus the RemoteMetadata header
    the chunk arrives with), or a temporary buffer for a partial chunk whose header gives its shape.
    After ``seal`` only ``obj`` is left: the MemoryObj LMCache gets. Whoever holds a landing either hands
    ``obj`` on or calls ``release``."""

    __slots__ = ("meta", "obj", "temp")

    def __init__(self, obj: MemoryObj | None = None, meta: bytearray | None = None,
                 temp: bytearray | None = None) -> None:
        self.obj = obj
        self.meta = meta
        self.temp = temp

    def release(self) -> None:
        obj, self.obj = self.obj, None
        if obj is not None:
            obj.ref_count_down()


class _LandingSink:
    """The prefetcher's sink: staged chunks land straight in LMCache MemoryObjs (zero-copy hits)."""

    def __init__(self, conn: KvgwConnector) -> None:
        self._c = conn

    def open(self, key: str, length: int) -> tuple[Destination, _Landing] | None:
        return self._c.open_landing(length)

    def seal(self, handle: _Landing, length: int) -> bool:
        return self._c.seal_landing(handle, length)

    def drop(self, handle: _Landing) -> None:
        handle.release()


class _Receiver:
    """Direct (unstaged) fetches of a list of chunks into MemoryObjs; ``into``/``on_item`` run on the
    client's I/O thread, or on LMCache's for chunks read there (``_read_here``). Every MemoryObj it
    allocates is either taken by ``take`` or freed."""

    def __init__(self, conn: KvgwConnector, count: int) -> None:
        self._c = conn
        self._landings: list[_Landing | None] = [None] * count

    def into(self, index: int, length: int) -> Destination | None:
        opened = self._c.open_landing(length)
        if opened is None:
            return None
        dest, self._landings[index] = opened
        return dest

    def on_item(self, item: BatchItem) -> None:
        landing = self._landings[item.index]
        if landing is None:
            return
        if not item.ok or not self._c.seal_landing(landing, item.length):
            landing.release()
            self._landings[item.index] = None

    def take(self, index: int) -> MemoryObj | None:
        landing, self._landings[index] = self._landings[index], None
        return None if landing is None else landing.obj

    def release(self) -> None:
        for i, landing in enumerate(self._landings):
            if landing is not None:
                landing.release()
                self._landings[i] = None


class KvgwConnector(RemoteConnector):  # type: ignore[misc]
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        plugin_name: str | None = None,
        remote_url: str | None = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        engine_config = config if config is not None else local_cpu_backend.config
        self.settings = ConnectorSettings.from_extra_config(
            engine_config.extra_config, plugin_name, os.environ, remote_url=remote_url
        )
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.meta_bytes: int = self.remote_metadata_bytes if self.save_chunk_meta else 0
        self._client = KvgwClient(self.settings.client, logger=logger)
        try:
            self._prefetcher: Prefetcher[_Landing] | None = (
                Prefetcher(self._client, self.settings.prefetch_bytes, _LandingSink(self))
                if self.settings.prefetch_bytes > 0
                else None
            )
        except BaseException:
            self._client.close()  # LMCache never gets this connector: nobody else would stop its I/O thread
            raise
        self._parents = ParentMap(self.settings.parent_map_size)
        self._probe_key: str | None = None
        logger.info(
            "kvgw connector: %s bucket %s, chunk %d bytes, metadata header %d bytes, prefetch buffer %d bytes",
            self.settings.client.url, self.settings.client.bucket, self.full_chunk_size_bytes,
            self.meta_bytes, self.settings.prefetch_bytes,
        )

    # ------------------------------------------------------------------ helpers

    @property
    def client(self) -> KvgwClient:
        return self._client

    @property
    def prefetcher(self) -> Prefetcher[_Landing] | None:
        return self._prefetcher

    def stats(self) -> dict[str, object]:
        out = self._client.stats()
        if self._prefetcher is not None:
            out["prefetch"] = self._prefetcher.stats()
        return out

    def count(self, name: str) -> None:
        self._client.counters.add(f"lmcache.{name}")

    def allocate(self) -> MemoryObj | None:
        """A full-chunk MemoryObj from LocalCPUBackend, or None at once if the pool is exhausted."""
        obj = self.local_cpu_backend.allocate(
            self.meta_shapes, self.meta_dtypes, self.meta_fmt, eviction=True, busy_loop=False
        )
        if obj is None:
            self.count("alloc_failed")
        return obj

    @property
    def chunk_bytes(self) -> int:
        """Size of a full chunk as stored in kvgw."""
        return self.meta_bytes + int(self.full_chunk_size_bytes)

    def open_landing(self, length: int) -> tuple[Destination, _Landing] | None:
        """Where a ``length``-byte chunk payload goes: a full chunk straight into a new MemoryObj (its
        metadata header into a small buffer), a partial one into a temporary buffer. None refuses the
        payload: a size no chunk of this model can have, or LMCache's pool has no memory right now."""
        meta_bytes, full = self.meta_bytes, self.full_chunk_size_bytes
        if meta_bytes:
            if length == meta_bytes + full:
                obj = self.allocate()
                if obj is None:
                    return None
                landing = _Landing(obj, meta=bytearray(meta_bytes))
                assert landing.meta is not None
                return [memoryview(landing.meta), byte_view(obj.byte_array, writable=True)], landing
            if meta_bytes < length < meta_bytes + full:
                landing = _Landing(temp=bytearray(length))
                assert landing.temp is not None
                return memoryview(landing.temp), landing
        elif 0 < length <= full and length % self.single_token_size == 0:
            obj = self.allocate()
            if obj is None:
                return None
            return byte_view(obj.byte_array, writable=True)[:length], _Landing(obj)
        self.count("bad_size")
        return None

    def seal_landing(self, landing: _Landing, length: int) -> bool:
        """Check a received chunk against its metadata and leave in ``landing.obj`` the MemoryObj LMCache
        gets; False (and nothing held) when the chunk does not fit this model."""
        try:
            landing.obj = self._finish(landing.obj, landing.meta, landing.temp, length)
        except Exception as exc:  # LMCache-side surprise: never let it escape into the I/O loop
            self.count("finish_error")
            logger.warning("kvgw: could not rebuild a chunk: %s", exc)
            landing.release()
        landing.meta = landing.temp = None
        return landing.obj is not None

    def _finish(
        self, obj: MemoryObj | None, meta: bytearray | None, temp: bytearray | None, length: int
    ) -> MemoryObj | None:
        if self.meta_bytes == 0:
            assert obj is not None
            return obj if length == self.full_chunk_size_bytes else self.reshape_partial_chunk(obj, length)
        if obj is not None:
            assert meta is not None
            md = RemoteMetadata.deserialize(meta)
            if (
                md.length != self.full_chunk_size_bytes
                or list(md.shapes) != list(self.meta_shapes)
                or list(md.dtypes) != list(self.meta_dtypes)
                or md.fmt != self.meta_fmt
            ):
                self.count("meta_mismatch")
                obj.ref_count_down()
                return None
            return obj
        assert temp is not None
        md = RemoteMetadata.deserialize(temp)
        body = memoryview(temp)[self.meta_bytes :]
        if md.length != len(body):
            self.count("meta_mismatch")
            return None
        part = self.local_cpu_backend.allocate(md.shapes, md.dtypes, md.fmt, eviction=True, busy_loop=False)
        if part is None:
            self.count("alloc_failed")
            return None
        view = byte_view(part.byte_array, writable=True)
        if len(view) != len(body):
            self.count("meta_mismatch")
            part.ref_count_down()
            return None
        view[:] = body
        return part

    def name_of(self, key: CacheEngineKey) -> str:
        """The kvgw key that ``key`` is stored under."""
        return self._key(key)

    def _key(self, key: CacheEngineKey, *, write: bool = False) -> str:
        name: str = key.to_string()
        if not _is_health_probe_key(key):
            return name
        # LMCache's health check writes fresh bytes under this one key and expects to read them back;
        # kvgw is write-once, so each probe write goes to a new key that reads then follow.
        if write or self._probe_key is None:
            self._probe_key = f"{name}@kvgw-probe%{uuid.uuid4().hex}"
        return self._probe_key

    def _body(self, obj: MemoryObj) -> Payload:
        data = byte_view(obj.byte_array)
        if not self.meta_bytes:
            return data
        md = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format())
        return [md.serialize(), data]

    async def _on_io(self, coro: Coroutine[Any, Any, T], orphan: Callable[[T], None]) -> T:
        """Await work on the I/O loop; if LMCache cancels us after it finished, ``orphan`` frees its result."""
        future = self._client.io.submit(coro)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:

            def cleanup(done: cf.Future[T]) -> None:
                if not done.cancelled() and done.exception() is None:
                    orphan(done.result())

            future.add_done_callback(cleanup)
            raise

    def _staged_lookup(self, names: list[str], present: int) -> None:
        if self._prefetcher is not None and present > 0:
            self._prefetcher.stage(names, present=present, expected_size=self.chunk_bytes)

    # ------------------------------------------------------------------ lookups

    async def exists(self, key: CacheEngineKey) -> bool:
        found = await self._client.exists([self._key(key)], quiet=True, timeout=self.settings.lookup_timeout)
        return found[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            found = self._client.blocking.exists(
                [self._key(key)], quiet=True, timeout=self.settings.lookup_timeout
            )
        except RuntimeError:  # called on an event loop thread: refuse to block it
            self.count("blocking_on_loop")
            return False
        return found[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        names = [self._key(k) for k in keys]
        self._parents.learn(names)
        try:
            present = self._client.blocking.prefix(names, quiet=True, timeout=self.settings.lookup_timeout)
        except RuntimeError:
            self.count("blocking_on_loop")
            return 0
        self._staged_lookup(names, present)
        return present

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        names = [self._key(k) for k in keys]
        self._parents.learn(names)
        present = await self._client.prefix(names, quiet=True, timeout=self.settings.lookup_timeout)
        self._staged_lookup(names, present)
        return present

    # ------------------------------------------------------------------ retrieves

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        objs = await self.batched_get([key])
        return objs[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        objs = await self._batched_get(keys)
        self._session_ended(keys, [obj is not None for obj in objs])
        return objs

    async def _batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        if not keys:
            return []
        names = [self._key(k) for k in keys]
        if self._prefetcher is not None:  # every chunk staged already: hand them over right here
            landings = self._prefetcher.take_ready(names)
            if landings is not None:
                objs: list[MemoryObj | None] = []
                for landing in landings:
                    objs.append(landing.obj)
                    landing.obj = None
                return objs
        here = await self._read_here(names)
        if here is not None:
            return here
        return await self._on_io(self._fetch(names), _release_all)

    async def _read_here(self, names: list[str]) -> list[MemoryObj | None] | None:
        """Chunks this client holds leased and located, read right here on LMCache's loop
        (``KvgwClient.read_remembered``); None: nothing kept, take the I/O loop's path."""
        if self._prefetcher is not None and any(map(self._prefetcher.tracks, names)):
            return None
        receiver = _Receiver(self, len(names))
        try:
            items = await self._client.read_remembered(names, receiver.into)
            if items is None:
                return None
            for item in items:
                receiver.on_item(item)
            return [receiver.take(j) for j in range(len(names))]
        finally:
            receiver.release()

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        objs = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                _release_all(objs[i + 1 :])
                break
            prefix.append(obj)
        return prefix

    async def _fetch(self, names: list[str]) -> list[MemoryObj | None]:
        """On the I/O loop: staged chunks from memory (waiting for ones in flight) and, at the same time,
        the rest with one batch-get into new MemoryObjs; staged fetches that failed get one more try."""
        results: list[MemoryObj | None] = [None] * len(names)
        prefetcher = self._prefetcher
        staged = [i for i, n in enumerate(names) if prefetcher is not None and prefetcher.tracks(n)]
        staged_set = set(staged)
        wanted = [i for i in range(len(names)) if i not in staged_set]

        async def direct(indices: list[int]) -> None:
            if not indices:
                return
            receiver = _Receiver(self, len(indices))
            try:
                await self._client.batch_get_into(
                    [names[i] for i in indices], receiver.into, on_item=receiver.on_item, quiet=True
                )
                for j, i in enumerate(indices):
                    results[i] = receiver.take(j)
            finally:
                receiver.release()

        async def from_memory() -> list[int]:
            failed: list[int] = []
            for i in staged:
                assert prefetcher is not None
                landing = await prefetcher.get(names[i])
                if landing is None:
                    failed.append(i)
                else:
                    results[i], landing.obj = landing.obj, None  # the staged MemoryObj itself: no copy
            return failed

        try:
            _, retry = await asyncio.gather(direct(wanted), from_memory())
            await direct(retry)
        except BaseException:
            _release_all(results)
            raise
        misses = sum(1 for r in results if r is None)
        if misses:
            self._client.counters.add("lmcache.get_none", misses)
        return results

    # ------------------------------------------------------------------ stores

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        name = self._key(key, write=True)
        ttl = PROBE_TTL_S if _is_health_probe_key(key) else self.settings.ttl
        retention, _ = request_hints([key])
        outcome = await self._client.put(
            name, self._body(memory_obj), parent=self._parents.parent(name), ttl=ttl, retention=retention,
            quiet=True,
        )
        if outcome is PutOutcome.FAILED:
            self.count("put_failed")
        elif outcome is PutOutcome.DECLINED:  # not stored, and no failure: LMCache recomputes it if asked
            self.count("put_declined")

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        names = [self._key(k, write=True) for k in keys]
        parents = self._parents.parents_of_run(names)
        self._parents.learn(names)
        bodies = [self._body(obj) for obj in memory_objs]
        retention, _ = request_hints(keys)
        outcomes = await self._client.put_many(names, bodies, parents=parents, ttl=self.settings.ttl,
                                               retention=retention)
        failed = sum(1 for o in outcomes if o is PutOutcome.FAILED)
        if failed:
            self._client.counters.add("lmcache.put_failed", failed)
        declined = sum(1 for o in outcomes if o is PutOutcome.DECLINED)
        if declined:
            self._client.counters.add("lmcache.put_declined", declined)

    def _session_ended(self, keys: Sequence[CacheEngineKey], loaded: Sequence[bool]) -> None:
        """A session's last turn loaded these chunks: tell the gateway, in the background (a hint lost
        costs hit rate, never data), once the loads are done (a read after the hint would clear it)."""
        if not keys or not request_hints(keys)[1]:
            return
        names = [self._key(k) for k, ok in zip(keys, loaded, strict=True) if ok]
        if names:
            self.count("session_end_hints")
            self._client.spawn(self._client.hint(Hint.SESSION_ENDED, names, quiet=True))

    # ------------------------------------------------------------------ the rest

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self._client.blocking.delete(self._key(key), quiet=True)
        except RuntimeError:
            self.count("blocking_on_loop")
            return False

    async def list(self) -> list[str]:
        return []  # the native API has no listing; LMCache 0.5.6 never lists remote keys on this path

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        return 0 if await self._client.ping() else 1

    async def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"<KvgwConnector {self.settings.client.url} bucket={self.settings.client.bucket}>"


def _release_all(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


class KvgwPluginEntryOnly(IrrecoverableException):  # type: ignore[misc]
    """The ``remote_storage_plugins`` entry of a config whose ``remote_url`` is kvgw's: it is there only
    to load the adapter, so it declines to become a second backend. LMCache's ``RemoteBackend`` lets this
    exception through (any other would leave a backend without a connection behind), and
    ``CreateStorageBackends`` logs it and goes on without that backend."""


def _kvgw_remote_url(config: Any) -> str | None:
    url = getattr(config, "remote_url", None)
    return url if isinstance(url, str) and url.startswith(URL_SCHEMES) else None


class KvgwConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """Adapter route: claims ``remote_url: http(s)://host:port[/bucket]`` (LMCache tries plugin adapters
    after its built-in ones, none of which takes http), ``plugin://kvgw`` and ``plugin://kvgw.<instance>``;
    passes the plugin name on so per-instance settings apply."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        if url.startswith(URL_SCHEMES):
            return True
        name = url.removeprefix("plugin://")
        return url.startswith("plugin://") and (name == PLUGIN_TYPE or name.startswith(PLUGIN_TYPE + "."))

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url
        if url.startswith("plugin://"):
            remote_url = _kvgw_remote_url(context.config)
            if remote_url is not None:
                raise KvgwPluginEntryOnly(
                    f"kvgw: plugin entry {context.plugin_name!r} only loads kvgw's adapter; "
                    f"remote_url {remote_url} is the kvgw backend"
                )
        from_url = url.startswith(URL_SCHEMES)
        return KvgwConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            # remote_url's backend has no plugin name: remote_storage_plugin.kvgw.<key> settings still apply
            plugin_name=(context.plugin_name or PLUGIN_TYPE) if from_url else context.plugin_name,
            remote_url=url if from_url else None,
        )
