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
    seconds: float = 0.0  # from the first lookup until every key was settled (before the bytes are read)


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
        started = time.perf_counter()
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
        seconds = time.perf_counter() - started
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
        return LoadResult(data, steps, answers, seconds)

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


# -- the scheduler ---------------------------------------------------------------------------------

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
              "vocab_size": 1000, "max_position_embeddings": 1024, "torch_dtype": "float32"}
"""A model config vLLM accepts without a hub: only its shapes matter here (no weights are loaded)."""


def pattern(tokens: Sequence[int], size: int) -> bytes:
    """The KV bytes the stand-in worker computes for a block of ``tokens``: a function of the tokens, so
    an engine that loads a block can tell it got the one computed for the same tokens."""
    import hashlib

    seed = hashlib.sha256(repr(list(tokens)).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class Step:
    scheduled: dict[str, int]  # request id -> tokens the model computes this step
    loads: int  # load jobs (offloaded blocks -> GPU) in this step's connector metadata
    stores: int  # store jobs (GPU -> offloaded blocks)


class SchedulerEngine:
    """vLLM's real ``Scheduler`` with the real ``OffloadingConnector`` and ``TieringOffloadingSpec`` on
    CPU, and a stand-in for the GPU worker (the only part of vLLM's offloading that needs CUDA): each
    step it carries out the connector's jobs on the primary tier's memory (a store writes the bytes
    ``pattern`` gives for the block's tokens, a load checks that the bytes there are those) and reports
    them done, and the model samples one token per running request."""

    def __init__(self, model_dir: str, secondary_tiers: list[dict[str, Any]], *, cpu_bytes: int = 64 << 20,
                 gpu_blocks: int = 128, kv_events: dict[str, Any] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        load()
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.block = TOKENS_PER_BLOCK
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=self.block, gpu_memory_utilization=0.9, cache_dtype="auto",
                                     enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                           "secondary_tiers": secondary_tiers}),
            kv_events_config=KVEventsConfig(**kv_events) if kv_events else None,
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = gpu_blocks
        spec = FullAttentionSpec(block_size=self.block, num_kv_heads=4, head_size=16, dtype=torch.float32)
        kv_cache = KVCacheConfig(num_blocks=gpu_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
        self.scheduler: Any = Scheduler(config, kv_cache, StructuredOutputManager(config), self.block)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(self.block, hash_fn)
        self.connector: Any = self.scheduler.connector.connector_scheduler
        self.manager: Any = self.connector.manager
        view = self.manager.primary_tier.get_kv_memoryview()
        self.stride = int(view.strides[0])
        self._flat = view.cast("B")
        self._tokens: dict[str, list[int]] = {}
        self._sleep = sleep
        self.steps: list[Step] = []
        self.loaded_ok = 0  # blocks a load brought whose bytes were the ones computed for their tokens
        self.loaded_bad = 0

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.secondary_tiers)

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._tokens[request_id] = list(prompt)
        self.scheduler.add_request(Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), None,
                                           block_hasher=self._hasher))

    def _block_index(self, request_id: str, gpu_block: int) -> int:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return int(list(ids).index(gpu_block))

    def _work(self, meta: Any) -> tuple[dict[int, int], set[str]]:
        """The stand-in worker: carry the step's jobs out on the primary tier's memory; the jobs done,
        and the requests whose asynchronous loads are done (vLLM's ``finished_recving``)."""
        done: dict[int, int] = {}
        received: set[str] = set()
        for job_id, job in meta.store_jobs.items():
            tokens = self._tokens[job.req_id]
            for gpu, chunk in zip(job.src_spec.block_ids, job.dst_spec.block_ids, strict=True):
                i = self._block_index(job.req_id, int(gpu))
                start = int(chunk) * self.stride
                self._flat[start : start + self.stride] = pattern(tokens[i * self.block : (i + 1) * self.block],
                                                                  self.stride)
            done[job_id] = 1
        for job_id, job in meta.load_jobs.items():
            tokens = self._tokens[job.req_id]
            for chunk, gpu in zip(job.src_spec.block_ids, job.dst_spec.block_ids, strict=True):
                i = self._block_index(job.req_id, int(gpu))
                start = int(chunk) * self.stride
                good = bytes(self._flat[start : start + self.stride]) == pattern(
                    tokens[i * self.block : (i + 1) * self.block], self.stride)
                self.loaded_ok += good
                self.loaded_bad += not good
            done[job_id] = 1
            if not job.sync:
                received.add(job.req_id)
        return done, received

    def step(self) -> Step:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        done, received = self._work(meta)
        ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        # schedule() has advanced num_computed_tokens: a request past its prompt samples a token
        sampling = {r for r in ids if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens}
        result = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if r in sampling else [] for r in ids],
            kv_connector_output=KVConnectorOutput(finished_recving=received or None,
                                                  kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)),
        )
        self.scheduler.update_from_output(out, result)
        step = Step(dict(out.num_scheduled_tokens), len(meta.load_jobs), len(meta.store_jobs))
        self.steps.append(step)
        return step

    def run(self, timeout: float = 60.0, step_seconds: float = 0.005) -> list[Step]:
        """Step until every request finished and no tier has work in flight; the steps taken."""
        first = len(self.steps)
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            if not self.scheduler.has_requests() and not self.connector.has_pending_push_work() \
                    and not self.manager.has_pending_work():
                return self.steps[first:]
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine is still busy after {timeout}s")
            self._sleep(step_seconds)

    def close(self) -> None:
        self._flat.release()
        self.scheduler.shutdown()
