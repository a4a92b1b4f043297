"""kvgw as a secondary tier of vLLM's tiering manager (vLLM >= 0.33, ``TieringOffloadingSpec``).

Configuration (docs/vllm.md lists every key with its default)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": N,
        "secondary_tiers": [{"type": "KvgwTier", "module_path": "kvgw_client.vllm",
                             "url": "http://kvgw.internal:8080", "bucket": "vllm-kv",
                             "access_key": "...", "secret_key": "..."}]}}'

vLLM's factory imports ``module_path``, takes the class named by ``type`` and calls it with the primary
tier's memoryview and every other key of the entry as a keyword argument (``TierSettings``). How vLLM's
calls map to kvgw (all from the scheduler process, under vLLM's manager lock, none of them waiting):

* ``lookup(key)``: the keys asked during a scheduler step go out as one ``exists`` call (leasing the
  hits) when the step ends (``on_schedule_end``); until its answer is in, a key answers RETRY, then
  HIT or MISS, reused for half the lease (``StepLookups``). A step's batch that fails or passes
  ``lookup_timeout_s`` misses.
* ``submit_store(job)``: the job's blocks as PUTs, all in flight, straight from the primary buffer at
  ``chunk_id * stride``, each naming the block before it in its request (``X-Kvgw-Parent``).
* ``submit_load(job)``: one batch-get per job whose frames are written straight into the primary
  buffer at ``chunk_id * stride`` (no intermediate copy; direct reads from the shared mount with
  ``direct_read_root``). ``get_finished_jobs`` reports each job with its time and bytes; a load that
  got some blocks reports those (``successful_keys``), the rest miss from then on.
* ``touch(keys)``: one ``touch`` per step for the keys vLLM touched (eviction order).
* ``on_request_finished``: kvgw's request-end hint (``ended``) for the request's blocks, in the background.
* ``take_events``: with ``enable_kv_events`` (and vLLM's ``enable_kv_cache_events``), blocks this tier
  stored, and from kvgw's change stream blocks other engines stored and blocks kvgw's lifecycle
  removed (``kv_events: own`` reports own stores only); at most ``events_per_step`` a step.
* ``drain_jobs`` waits for every job; ``shutdown`` drains, stops the stream and closes the client.

Names: vLLM's ``FileMapper`` path of a block with this tier's ``prefix`` as root (``BlockNames``):
``[<prefix>/]<model>_<sha12>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin``, the names vLLM's own ``fs`` and
``obj`` tiers give the same block, so every engine of one model and layout shares blocks (and with an
``obj`` tier on the same bucket and prefix), and nothing else collides.

Faults never reach vLLM: every call catches what it did not expect, counts it (``stats()``) and logs
once per burst; the client's retries and circuit breaker apply to every request.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvgw_client.chains import ParentMap
from kvgw_client.changes import ChangeFollower, ChangePage
from kvgw_client.health import Counters, FailureLog
from kvgw_client.http import KvgwClient
from kvgw_client.tiering import (
    BlockNames,
    EventQueue,
    OwnStores,
    StepLookups,
    TierJobs,
    TierSettings,
    changes_to_events,
)
from kvgw_client.wire import Hint

if TYPE_CHECKING:
    import concurrent.futures as cf

    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

__all__ = ["KvgwTier"]


class KvgwTier(SecondaryTierManager):  # type: ignore[misc]
    """vLLM's secondary tier in kvgw (module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = TierSettings.from_options(options, os.environ)
        self.locality = Locality(self.settings.locality)
        mapper = FileMapper.from_offloading_spec(
            root_dir=self.settings.prefix, offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True,
        )
        self.names = BlockNames(f"{mapper.base_path}_r{mapper.rank}")
        self.counters = Counters()
        self._failures = FailureLog(logger, f"kvgw vLLM tier {self.settings.client.url}", time.monotonic)
        self._client = KvgwClient(self.settings.client, logger=logger)
        self._lookups = StepLookups(self._ask, self.settings.answer_seconds, counters=self.counters)
        self._jobs = TierJobs(self._client, primary_kv_view.cast("B"), self.block_size_bytes,
                              ttl=self.settings.ttl, io_timeout=self.settings.io_timeout,
                              streams=self.settings.load_streams)
        self._job_keys: dict[int, tuple[list[OffloadKey], list[str]]] = {}
        self._parents = ParentMap(self.settings.parent_map_size)
        self._last_looked_up: dict[str, str] = {}  # request id -> its last key looked up (chain order)
        self._request_names: dict[str, dict[str, None]] = {}  # request id -> its blocks, for the end hint
        self._touched: dict[str, None] = {}
        self._own = OwnStores()
        enabled = self.settings.enable_kv_events
        if enabled and not offloading_spec.kv_events_config.enable_kv_cache_events:
            logger.warning("kvgw vLLM tier: enable_kv_events is set but vLLM's KV cache events are off "
                           "(--kv-events-config enable_kv_cache_events); the tier reports no events")
            enabled = False
        self._events: EventQueue | None = (
            EventQueue(self.settings.events_per_step, self.settings.events_queue, self.counters) if enabled else None)
        self._follower: ChangeFollower | None = None
        self._follower_task: cf.Future[None] | None = None
        if self._events is not None and self.settings.kv_events == "all":
            self._follower = ChangeFollower(self._read_changes, self._on_changes,
                                            poll_seconds=self.settings.events_poll_s)
            self._follower_task = self._client.spawn(self._follower.run())
        self._client.spawn(self._client.ping())  # the first step's lookups find a connection open
        logger.info("kvgw vLLM tier: %s bucket %s, blocks of %d bytes named %s/..., events %s",
                    self.settings.client.url, self.settings.client.bucket, self.block_size_bytes,
                    self.names.namespace, self.settings.kv_events if self._events is not None else "off")

    # ------------------------------------------------------------------ helpers

    @property
    def client(self) -> KvgwClient:
        return self._client

    def stats(self) -> dict[str, object]:
        """kvgw's counters: the client's (calls, bytes, failures, circuit) and this tier's (``tier``)."""
        out = self._client.stats()
        out["tier"] = self.counters.snapshot()
        out["tier_failures"] = self._failures.counts()
        return out

    def name_of(self, key: OffloadKey) -> str:
        """The kvgw key of a vLLM block."""
        return self.names.name(get_offload_block_hash(key), get_offload_group_idx(key))

    def key_of(self, name: str) -> OffloadKey | None:
        parsed = self.names.parse(name)
        return None if parsed is None else make_offload_key(*parsed)

    def _failed(self, op: str, exc: BaseException) -> None:
        self._failures.failure(op, type(exc).__name__, str(exc)[:300])

    def _ask(self, names: list[str]) -> cf.Future[list[bool]]:
        return self._client.spawn(self._client.exists(names, quiet=True, timeout=self.settings.lookup_timeout))

    async def _read_changes(self, after: int | None) -> ChangePage:
        page = await self._client.changes(self.names.prefix, after=after, timeout=self.settings.lookup_timeout)
        assert page is not None  # not quiet: a failure raises, and the follower retries from the same cursor
        return page

    def _on_changes(self, page: ChangePage) -> None:
        """On the I/O thread: the page's blocks, as events (the scheduler thread takes them)."""
        if page.reset:
            self.counters.add("events.stream_reset")
        if self._events is not None:
            self._events.add(changes_to_events(page, self.names, self._own))

    # ------------------------------------------------------------------ vLLM's calls

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            name = self.name_of(key)
            request = req_context.req_id
            previous = self._last_looked_up.get(request)
            if previous is not None and previous != name:
                self._parents.learn([previous, name])
            self._last_looked_up[request] = name
            found = self._lookups.lookup(name)
            if found is None:
                return LookupResult.RETRY
            if found:
                self._request_names.setdefault(request, {})[name] = None
            return LookupResult.HIT if found else LookupResult.MISS
        except Exception as exc:
            self._failed("lookup", exc)
            return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        try:
            keys = list(job_metadata.keys)
            names = [self.name_of(k) for k in keys]
            parents = self._parents.parents_of_run(names)
            self._parents.learn(names)
            self._request_names.setdefault(job_metadata.req_context.req_id, {}).update(dict.fromkeys(names))
            self._job_keys[job_metadata.job_id] = (keys, names)
            offsets = [int(c) * self.block_size_bytes for c in job_metadata.chunk_ids]
            self._jobs.store(job_metadata.job_id, names, offsets, parents)
            self.counters.add("store.jobs")
        except Exception as exc:  # reported as a failed job, never raised
            self._failed("submit_store", exc)
            self._fail_job(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        try:
            keys = list(job_metadata.keys)
            names = [self.name_of(k) for k in keys]
            self._request_names.setdefault(job_metadata.req_context.req_id, {}).update(dict.fromkeys(names))
            self._job_keys[job_metadata.job_id] = (keys, names)
            offsets = [int(c) * self.block_size_bytes for c in job_metadata.chunk_ids]
            self._jobs.load(job_metadata.job_id, names, offsets)
            self.counters.add("load.jobs")
        except Exception as exc:
            self._failed("submit_load", exc)
            self._fail_job(job_metadata)

    def _fail_job(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._job_keys[job_metadata.job_id] = (keys, [self.name_of(k) for k in keys])
        self._jobs.fail(job_metadata.job_id, len(keys), store=not job_metadata.is_promotion)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        try:
            for outcome in self._jobs.finished():
                keys, names = self._job_keys.pop(outcome.job_id, ([], []))
                ok = outcome.ok
                if len(ok) != len(keys):
                    ok = [False] * len(keys)
                good = sum(ok)
                kind = "store" if outcome.store else "load"
                self.counters.add(f"{kind}.blocks", len(keys))
                self.counters.add(f"{kind}.failed", len(keys) - good)
                for name, fine in zip(names, ok, strict=True):
                    if outcome.store:
                        if fine:
                            self._lookups.learn(name, True)
                    elif not fine:
                        self._lookups.learn(name, False)  # a failed load misses from now on (no livelock)
                if outcome.store and self._events is not None:
                    stored = [n for n, fine in zip(names, ok, strict=True) if fine]
                    self._own.add(stored)
                    self._events.add((n, False) for n in stored)
                successful = None
                if not outcome.store and 0 < good < len(keys):
                    successful = tuple(k for k, fine in zip(keys, ok, strict=True) if fine)
                results.append(JobResult(job_id=outcome.job_id, success=good == len(keys) and bool(keys),
                                         successful_keys=successful, transfer_time=outcome.seconds,
                                         transfer_bytes=outcome.nbytes))
        except Exception as exc:
            self._failed("get_finished_jobs", exc)
        return results

    def has_pending_work(self) -> bool:
        return self._jobs.pending() > 0 or self._lookups.in_flight() or bool(self._touched)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        try:
            self._touched.update(dict.fromkeys(self.name_of(k) for k in keys))
        except Exception as exc:
            self._failed("touch", exc)

    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            request = req_context.req_id
            self._last_looked_up.pop(request, None)
            names = list(self._request_names.pop(request, {}))
            if names:
                self._request_finished(request, names)
        except Exception as exc:
            self._failed("on_request_finished", exc)

    def _request_finished(self, request: str, names: list[str]) -> None:
        """kvgw's request-end hint (``ended``) for the blocks this request looked up, loaded or stored:
        the lifecycle learns how often such blocks come back and may drop what only this request used
        (docs/lifecycle.md). Sent in the background and quiet: a lost hint costs hit rate, never data."""
        self.counters.add("requests.finished")
        self.counters.add("requests.finished_blocks", len(names))
        self._client.spawn(self._client.hint(Hint.ENDED, names, quiet=True, timeout=self.settings.lookup_timeout))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookups.flush()
            if self._touched:
                names, self._touched = list(self._touched), {}
                self._client.spawn(self._client.touch(names, quiet=True, timeout=self.settings.lookup_timeout))
                self.counters.add("touch.calls")
        except Exception as exc:
            self._failed("on_schedule_end", exc)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return []
        out: list[OffloadingEvent] = []
        try:
            for event in self._events.take():
                keys = [k for k in map(self.key_of, event.names) if k is not None]
                if keys:
                    out.append(OffloadingEvent(keys=keys, medium=self.medium, removed=event.removed,
                                               locality=self.locality, removal_expected=not event.removed))
        except Exception as exc:
            self._failed("take_events", exc)
        return out

    def drain_jobs(self) -> None:
        self._jobs.drain()

    def shutdown(self) -> None:
        try:
            if self._follower_task is not None:
                self._follower_task.cancel()
            if not self._jobs.drain(timeout=self.settings.io_timeout * 2):
                logger.warning("kvgw vLLM tier: jobs still running at shutdown after %.0f s",
                               self.settings.io_timeout * 2)
            else:
                self._jobs.close()
        finally:
            self._client.close()

    def __repr__(self) -> str:
        return f"<KvgwTier {self.settings.client.url} bucket={self.settings.client.bucket} {self.names.namespace}>"
