"""vLLM 0.33's tiering manager on CPU, driven as its scheduler-side connector drives it: for the tests in
``tests/integration/vllm/`` and ``kvgw bench vllm``.

vLLM's KV offloading runs its tiers in the scheduler process: ``TieringOffloadingSpec.get_manager()``
builds a CPU primary tier over a shared-memory region (``/dev/shm``) and the configured secondary tiers
over a memoryview of it. ``Engine`` is one such manager with the calls the scheduler makes, one step at
a time (``step`` = ``on_schedule_end``): a store copies blocks into the primary tier the way the GPU
worker would (``prepare_store``, bytes written at each chunk's offset, ``complete_store``), which
cascades them into every secondary tier; a load looks blocks up until vLLM answers HIT (RETRY while a
tier's lookup is in flight, HIT_PENDING while the promotion runs) and reads the primary tier's bytes.
Only the GPU side is stood in for: the bytes a worker would copy from GPU memory are written directly.

Importing this module does not import vLLM; ``load()`` does (after setting ``VLLM_TARGET_DEVICE=cpu``
and ``HF_HUB_OFFLINE=1``, which vLLM needs on a machine without a GPU and without a hub).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
MODEL = "Qwen/Qwen3-8B"
LAYER = "model.layers.0.self_attn.attn"
TOKENS_PER_BLOCK = 16


def load() -> None:
    """Import vLLM's offloading code (ImportError when vLLM is not installed)."""
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    import vllm.v1.kv_offload.factory
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401


def offloading_config(secondary_tiers: list[dict[str, Any]], *, block_bytes: int, cpu_blocks: int,
                      events: bool = False, model: str = MODEL, engine_id: str | None = None,
                      extra: dict[str, Any] | None = None) -> Any:
    """vLLM's ``OffloadingConfig`` of a one-group, one-worker engine whose blocks (one per chunk) are
    ``block_bytes`` of KV; the primary tier holds ``cpu_blocks`` of them."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, (LAYER,), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_blocks * block_bytes,
                      "secondary_tiers": secondary_tiers, **(extra or {})},
        engine_id=engine_id or uuid.uuid4().hex,
        model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(TOKENS_PER_BLOCK, 1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def block_keys(n: int, seed: int, group: int = 0) -> list[bytes]:
    """``n`` vLLM OffloadKeys (32-byte block hash + 4-byte group), distinct per seed."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(((seed << 32) + i).to_bytes(32, "big"), group) for i in range(n)]


@dataclass
class LoadResult:
    data: list[bytes | None]  # per key: the primary tier's bytes after the load, None if it missed
    steps: int  # scheduler steps until every key was settled
    answers: list[list[str]] = field(default_factory=list)  # per step, vLLM's lookup answer per key


class Engine:
    """One engine's scheduler-side tiering manager (module docstring). Not thread-safe, like vLLM's
    scheduler; ``sleep`` runs between steps (a model step's time)."""

    def __init__(self, secondary_tiers: list[dict[str, Any]], *, block_bytes: int, cpu_blocks: int,
                 events: bool = False, sleep: Callable[[float], None] = time.sleep, step_seconds: float = 0.002,
                 extra: dict[str, Any] | None = None) -> None:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        self.config = offloading_config(secondary_tiers, block_bytes=block_bytes, cpu_blocks=cpu_blocks,
                                        events=events, extra=extra)
        self.spec = OffloadingSpecFactory.create_spec(self.config)
        self.manager: Any = self.spec.get_manager()
        self.view: memoryview = self.manager.primary_tier.get_kv_memoryview()
        self.stride = int(self.view.strides[0])
        self.flat = self.view.cast("B")
        self.block_bytes = block_bytes
        self._sleep = sleep
        self._step_seconds = step_seconds
        self._requests = 0

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    def request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._requests += 1
        ctx = ReqContext(f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: Any) -> None:
        self.manager.on_request_finished(ctx)

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout: float = 60.0) -> int:
        """Step until no tier has work in flight; the steps taken."""
        deadline = time.monotonic() + timeout
        steps = 0
        while True:
            self.step()
            steps += 1
            if not self.manager.has_pending_work():
                return steps
            if time.monotonic() > deadline:
                raise TimeoutError(f"tiers still busy after {timeout}s")
            self._sleep(self._step_seconds)

    def store(self, keys: Sequence[bytes], blocks: Sequence[bytes], *, finish: bool = True) -> Any:
        """Blocks into the primary tier as the GPU worker would put them, then cascaded into every
        secondary tier (returns once their store jobs finished)."""
        ctx = self.request()
        out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None, "the primary tier has no room"
        chunk = {k: int(c) for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True)}
        for key, data in zip(keys, blocks, strict=True):
            if key in chunk:
                start = chunk[key] * self.stride
                self.flat[start : start + len(data)] = data
        self.manager.complete_store(list(out.keys_to_store), ctx, True)
        self.settle()
        if finish:
            self.finish(ctx)
        return ctx

    def lookup(self, keys: Sequence[bytes], ctx: Any, *, timeout: float = 60.0) -> LoadResult:
        """Look ``keys`` up every step, as the scheduler does for a waiting request, until each is HIT
        or MISS; vLLM's answers per step are kept."""
        from vllm.v1.kv_offload.base import LookupResult

        answers: list[list[str]] = []
        settled: dict[bytes, bool] = {}
        deadline = time.monotonic() + timeout
        steps = 0
        while len(settled) < len(keys):
            row = []
            for key in keys:
                if key in settled:
                    row.append("HIT" if settled[key] else "MISS")
                    continue
                result = self.manager.lookup(key, ctx)
                row.append(result.name)
                if result is LookupResult.HIT:
                    settled[key] = True
                elif result is LookupResult.MISS:
                    settled[key] = False
            answers.append(row)
            self.step()
            steps += 1
            if len(settled) < len(keys):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lookups not settled after {timeout}s: {row}")
                self._sleep(self._step_seconds)
        data: list[bytes | None] = []
        hits = [k for k in keys if settled[k]]
        chunk: dict[bytes, int] = {}
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            chunk = {k: int(c) for k, c in zip(hits, spec.chunk_ids, strict=True)}
        for key in keys:
            if key in chunk:
                start = chunk[key] * self.stride
                data.append(bytes(self.flat[start : start + self.block_bytes]))
            else:
                data.append(None)
        if hits:
            self.manager.complete_load(hits, ctx)
        return LoadResult(data, steps, answers)

    def load(self, keys: Sequence[bytes], *, timeout: float = 60.0) -> LoadResult:
        ctx = self.request()
        try:
            return self.lookup(keys, ctx, timeout=timeout)
        finally:
            self.finish(ctx)
            self.settle()

    def events(self) -> list[Any]:
        return list(self.manager.take_events())

    def close(self) -> None:
        self.flat.release()
        self.manager.shutdown()
