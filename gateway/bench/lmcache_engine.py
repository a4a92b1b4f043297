"""LMCache's own storage paths (0.5.6 and 0.5.7), driven the way its engine drives them, without a GPU.

``kvgw bench lmcache`` and the LMCache integration tests (``tests/integration/lmcache``) both use
this module, so what the benchmark measures is what the tests prove correct.

* ``Worker``: LMCache's ``StorageManager`` (its ``LocalCPUBackend`` allocator and every backend the
  config asks for: kvgw's connector as a remote-storage plugin, LMCache's S3 connector via
  ``remote_url``, its local-disk backend) called as ``LMCacheEngine`` calls it: ``batched_contains``
  for a lookup, ``batched_put`` for a store, ``get_block_mapping`` then ``batched_get(location)``
  for a retrieve, keeping only the consecutive prefix of what came back.
* ``L2Driver``: an L2 adapter built by LMCache's own ``--l2-adapter`` parser and factory, fed with L1
  memory objects from LMCache's ``L1MemoryManager``, called as the multiprocess server's controllers
  call it (submit, wait on the event fd, collect).

Chunks are ``chunk_mib`` MiB of bfloat16 KV (``kv_shape``: layers x 2 x 256 tokens x 8 heads x 128).
Importing this module imports LMCache (and torch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import select
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch
import xxhash
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1MemoryManagerConfig
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from kvgw_client.framing import byte_view

try:  # LMCache 0.5.7 moved the in-process engine's pieces under lmcache.inprocess
    from lmcache.inprocess.v1.event_manager import EventManager
except ImportError:  # LMCache 0.5.6
    from lmcache.v1.event_manager import EventManager

T = TypeVar("T")

MODEL = "org/kvgw-bench-model"  # LMCache model names contain "/" (and keys "@")
CHUNK_TOKENS = 256
KVGW_PLUGIN = "kvgw"
REMOTE_KVGW = f"RemoteBackend-{KVGW_PLUGIN}"
REMOTE_URL = "RemoteBackend"  # the backend LMCache builds from ``remote_url``
LOCAL_DISK = "LocalDiskBackend"


def kv_shape(chunk_mib: int, tokens: int = CHUNK_TOKENS) -> tuple[int, int, int, int, int]:
    """A KV shape whose full chunk is ``chunk_mib`` MiB of bfloat16 (one layer per MiB)."""
    return (chunk_mib, 2, tokens, 8, 128)


def make_metadata(chunk_mib: int, model: str = MODEL) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=kv_shape(chunk_mib), chunk_size=CHUNK_TOKENS, role="worker",
    )


def kvgw_plugin_extra(url: str, bucket: str = "kvcache", **settings: object) -> dict[str, object]:
    """``extra_config`` that loads kvgw's connector as remote-storage plugin ``kvgw``; ``settings`` are
    ``kvgw.*`` keys without the prefix (docs/lmcache-0.5.6-interfaces.md lists them)."""
    extra: dict[str, object] = {
        f"remote_storage_plugin.{KVGW_PLUGIN}.module_path": "kvgw_client.lmcache.connector",
        f"remote_storage_plugin.{KVGW_PLUGIN}.class_name": "KvgwConnector",
        "kvgw.url": url,
        "kvgw.bucket": bucket,
    }
    extra.update({f"kvgw.{k}": v for k, v in settings.items()})
    return extra


def s3_connector_extra(access_key: str, secret_key: str, region: str = "us-east-1") -> dict[str, object]:
    """``extra_config`` of LMCache's S3 connector against a plain-HTTP S3 endpoint."""
    return {
        "save_chunk_meta": False,  # LMCache's S3 connector refuses chunk metadata
        "s3_region": region,
        "disable_tls": True,
        "s3_prefer_http2": False,
        "aws_access_key_id": access_key,
        "aws_secret_access_key": secret_key,
    }


def engine_config(*, cpu_gb: float, extra: Mapping[str, object] | None = None, **fields: Any) -> LMCacheEngineConfig:
    """An engine config with LocalCPUBackend as allocator only (``local_cpu: false``): every get goes
    to the backend under test instead of a hot CPU copy."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=cpu_gb,
        extra_config=dict(extra or {}), **fields,
    )


def chunk_keys(n: int, *, seed: int, model: str = MODEL) -> list[CacheEngineKey]:
    """Keys of one request's chunks, in token order (distinct ``seed`` values never collide)."""
    return [CacheEngineKey(model, 1, 0, (seed << 20) + i, torch.bfloat16) for i in range(n)]


def digest(obj: MemoryObj) -> int:
    """xxh3-64 of a memory object's bytes."""
    return int(xxhash.xxh3_64_intdigest(byte_view(obj.byte_array)))


def fill_random(obj: MemoryObj, rng: torch.Generator | None = None) -> int:
    """Fill with random bytes; returns their digest."""
    flat = obj.tensor.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=rng))
    return digest(obj)


def release(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


class Worker:
    """One LMCache worker's storage side: ``StorageManager`` with the backends ``config`` asks for."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> None:
        self.config = config
        self.metadata = metadata
        self.storage = StorageManager(config, metadata, EventManager())

    # ------------------------------------------------------------ what LMCacheEngine does

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """LMCache's storage event loop (thread ``storage-manager-event-loop``)."""
        loop: asyncio.AbstractEventLoop = self.storage.loop
        return loop

    def backend(self, name: str) -> Any:
        return self.storage.storage_backends[name]

    def allocate(self, n: int, *, tokens: int = CHUNK_TOKENS) -> list[MemoryObj]:
        shapes = self.metadata.get_shapes()
        if tokens != CHUNK_TOKENS:
            shapes = [torch.Size([s[0], s[1], tokens, s[3]]) for s in shapes]
        objs: list[MemoryObj] = []
        for _ in range(n):
            obj = self.storage.allocate(shapes, self.metadata.get_dtypes(), MemoryFormat.KV_2LTD, busy_loop=False)
            if obj is None:
                release(objs)
                raise MemoryError("LMCache's CPU pool is exhausted; raise max_local_cpu_size")
            objs.append(obj)
        return objs

    def lookup(self, keys: list[CacheEngineKey]) -> int:
        """How many leading chunks LMCache would retrieve (``LMCacheEngine.lookup``)."""
        hits, _ = self.storage.batched_contains(keys)
        return int(hits)

    def store(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        """Hand chunks to every backend (``LMCacheEngine.store``); consumes the references to ``objs``.
        Returns at once: remote and disk backends write in the background."""
        self.storage.batched_put(keys, objs)

    def retrieve(self, keys: list[CacheEngineKey], location: str | None = None) -> list[MemoryObj]:
        """The consecutive prefix of ``keys`` LMCache gets back (``_process_tokens_internal``): block
        mapping by prefix lookup, one ``batched_get`` per location, stop at the first None. The caller
        owns (and must release) the returned objects."""
        infos = [(key, i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS) for i, key in enumerate(keys)]
        mapping = {location: infos} if location else self.storage.get_block_mapping(infos)
        out: list[MemoryObj] = []
        for where, blocks in mapping.items():
            got = self.storage.batched_get(keys=[k for k, _, _ in blocks], location=where)
            for i, obj in enumerate(got):
                if obj is None:
                    release(got[i + 1 :])
                    return out
                out.append(obj)
        return out

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on LMCache's loop, as its async lookup path does."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_stored(self, name: str, keys: list[CacheEngineKey], timeout: float = 60.0) -> bool:
        """Wait until backend ``name`` holds ``keys``; False on timeout. Asks without side effects:

        * kvgw's connector: an ``exists`` call of its client (a lookup would stage the chunks);
        * a remote backend without batched puts (LMCache's S3 connector): its ``put_tasks`` drain (that
          connector remembers a miss forever, so it must not be asked early);
        * anything else (the local-disk backend): ``batched_contains``.
        """
        backend = self.backend(name)
        connection: Any = getattr(backend, "connection", None)
        inner: Any = connection.getWrappedConnector() if connection is not None else None
        names = [inner.name_of(k) for k in keys] if hasattr(inner, "name_of") else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if names is not None:
                done = all(inner.client.blocking.exists(names, quiet=True))
            elif connection is not None and not connection.support_batched_put():
                with backend.lock:
                    done = not backend.put_tasks
            else:
                done = backend.batched_contains(keys) == len(keys)
            if done:
                return True
            time.sleep(0.002)
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Close every backend (each bounded by ``timeout``) and stop LMCache's loop.

        LMCache 0.5.6's ``S3Connector.close()`` blocks its own event loop forever, so a remote backend
        whose connector is LMCache's S3 connector is left open (its awscrt threads are daemons).
        """
        for name, backend in list(self.storage.storage_backends.items()):
            connection: Any = getattr(backend, "connection", None)
            inner = connection.getWrappedConnector() if hasattr(connection, "getWrappedConnector") else connection
            if type(inner).__name__ == "S3Connector":
                continue
            _bounded(backend.close, timeout, f"closing {name}")

        async def cancel_the_rest() -> None:  # e.g. the job queues of a connector left open
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout) if tasks else None

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.storage.thread.join(timeout)


def _bounded(fn: Callable[[], object], timeout: float, what: str) -> None:
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{what} did not finish within {timeout}s")
    if failure:
        raise failure[0]


# ---------------------------------------------------------------- multiprocess server L2 adapters


def object_keys(n: int, *, seed: int, model: str = MODEL) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=((seed << 20) + i).to_bytes(16, "big"), model_name=model, kv_rank=0)
            for i in range(n)]


def l2_key_string(key: ObjectKey) -> str:
    """The string form LMCache's NativeConnectorL2Adapter and S3 adapter store ``key`` under."""
    return f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"


class L2Driver:
    """An L2 adapter from a ``--l2-adapter`` JSON spec, with L1 memory objects of ``chunk_mib`` MiB."""

    def __init__(self, spec: Mapping[str, object], *, chunk_mib: int, l1_bytes: int, timeout: float = 30.0) -> None:
        self.chunk_mib = chunk_mib
        self.timeout = timeout
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=l1_bytes, use_lazy=False, shm_name=""))
        self.layout = MemoryLayoutDesc(shapes=[torch.Size(kv_shape(chunk_mib))], dtypes=[torch.bfloat16])
        parser = argparse.ArgumentParser()
        add_l2_adapters_args(parser)
        config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
        self.adapter: Any = create_l2_adapter(config.adapters[0], l1_memory_desc=self.l1.get_l1_memory_desc())

    def allocate(self, n: int) -> list[MemoryObj]:
        _, objs = self.l1.allocate(self.layout, n)
        if len(objs) != n:
            raise MemoryError("L1 pool exhausted")
        return list(objs)

    def free(self, objs: list[MemoryObj]) -> None:
        self.l1.free(objs)

    def _wait(self, fd: int, poll: Callable[[], T | None]) -> T:
        deadline = time.monotonic() + self.timeout
        while True:
            result = poll()
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("L2 task did not complete")
            select.select([fd], [], [], min(left, 0.05))

    def store(self, keys: list[ObjectKey], objs: list[MemoryObj]) -> Any:
        """Submit a store and wait for its L2StoreResult."""
        task = self.adapter.submit_store_task(keys, objs)
        done: dict[int, Any] = {}

        def poll() -> Any:
            done.update(self.adapter.pop_completed_store_tasks())
            return done.pop(task, None)

        return self._wait(self.adapter.get_store_event_fd(), poll)

    def lookup(self, keys: list[ObjectKey]) -> list[bool]:
        """Lookup-and-lock: which keys are present (and now locked)."""
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        bitmap = self._wait(self.adapter.get_lookup_and_lock_event_fd(),
                            lambda: self.adapter.query_lookup_and_lock_result(task))
        return [bool(bitmap.test(i)) for i in range(len(keys))]

    def load(self, keys: list[ObjectKey], objs: list[MemoryObj]) -> list[bool]:
        task = self.adapter.submit_load_task(keys, objs)
        bitmap = self._wait(self.adapter.get_load_event_fd(), lambda: self.adapter.query_load_result(task))
        return [bool(bitmap.test(i)) for i in range(len(keys))]

    def unlock(self, keys: list[ObjectKey]) -> None:
        self.adapter.submit_unlock(keys)

    def close(self) -> None:
        self.adapter.close()


def random_fill_many(objs: Sequence[MemoryObj], seed: int) -> list[int]:
    rng = torch.Generator().manual_seed(seed)
    return [fill_random(obj, rng) for obj in objs]


def cpu_pool_gb(chunk_mib: int, chunks: int, *, copies: int = 3) -> float:
    """A LocalCPUBackend size that holds ``copies`` x ``chunks`` chunks (stored, retrieved, staged)."""
    return max(0.25, copies * chunks * chunk_mib / 1024 + 0.05)

