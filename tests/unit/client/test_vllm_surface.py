"""Pinned vLLM surface: fails when vLLM changes what kvgw's tier (``kvgw_client.vllm``) relies on.

Read from vLLM 0.33.0 (``vllm/v1/kv_offload/tiering/base.py``, ``base.py``, ``file_mapper.py``,
``tiering/factory.py``; docs/vllm.md lists them). vLLM calls the out-of-tree tier API "experimental and
subject to change": when a pin breaks, re-read those files, adapt ``client/kvgw_client/vllm.py``, then
update the pin. Runs where vLLM is installed (``.ci/install-vllm.sh``); elsewhere it skips, failing only
under ``KVGW_REQUIRE_SERVICES=1`` with ``KVGW_TEST_VLLM=1``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from tests.requirements import require_where

try:
    from gateway.bench import vllm_engine

    vllm_engine.load()  # vLLM's settings for a machine without a GPU or a hub, then its offloading code
    from vllm.v1.kv_offload import base as offload_base
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering import base as tiering_base
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
except ImportError as exc:
    require_where("KVGW_TEST_VLLM", f"vLLM is not installed (.ci/install-vllm.sh): {exc}")

from kvgw_client.vllm import KvgwTier

SUPPORTED = ("0.33.0",)


def params(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Parameters after self as ``name`` or ``name=default``."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        out.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return tuple(out)


TIER_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector=None"),
    "lookup": ("key", "req_context"),
    "submit_store": ("job_metadata",),
    "submit_load": ("job_metadata",),
    "get_finished_jobs": (),
    "has_pending_work": (),
    "take_events": (),
    "touch": ("keys", "req_context"),
    "on_new_request": ("req_context",),
    "on_request_finished": ("req_context",),
    "on_schedule_end": ("context",),
    "drain_jobs": (),
    "shutdown": (),
}
ABSTRACT = {"lookup", "submit_store", "submit_load", "get_finished_jobs", "on_new_request", "drain_jobs"}


def test_the_version_is_one_we_read() -> None:
    assert importlib.metadata.version("vllm") in SUPPORTED


def test_secondary_tier_methods() -> None:
    cls = tiering_base.SecondaryTierManager
    assert {name: params(getattr(cls, name)) for name in TIER_METHODS} == TIER_METHODS
    assert cls.__abstractmethods__ == ABSTRACT
    assert not KvgwTier.__abstractmethods__
    assert {"block_size_bytes"} <= {n for n, _ in inspect.getmembers(cls, lambda m: isinstance(m, property))}


def test_jobs_events_and_lookup_results() -> None:
    fields = {f.name for f in dataclasses.fields(tiering_base.TransferJob)}
    assert {"job_id", "keys", "chunk_ids", "is_promotion", "req_context"} <= fields
    assert [f.name for f in dataclasses.fields(tiering_base.JobResult)] == [
        "job_id", "success", "successful_keys", "transfer_time", "transfer_bytes"]
    assert {f.name for f in dataclasses.fields(offload_base.OffloadingEvent)} >= {
        "keys", "medium", "removed", "locality", "ownership", "removal_expected"}
    assert {m.name for m in offload_base.LookupResult} == {"MISS", "HIT", "HIT_PENDING", "RETRY"}
    assert {m.value for m in offload_base.Medium} == {"CPU", "STORAGE"}
    assert {m.value for m in offload_base.Locality} == {"LOCAL", "REMOTE"}
    assert {"req_id"} <= {f.name for f in dataclasses.fields(offload_base.ReqContext)}


def test_keys_and_names() -> None:
    key = offload_base.make_offload_key(b"\x01" * 32, 3)
    assert key == b"\x01" * 32 + (3).to_bytes(4, "big")
    assert offload_base.get_offload_block_hash(key) == b"\x01" * 32 and offload_base.get_offload_group_idx(key) == 3
    assert params(FileMapper.from_offloading_spec.__func__) == (  # type: ignore[attr-defined]
        "root_dir", "offloading_spec", "blocks_per_file=1", "parallel_agnostic=False")
    mapper = FileMapper(root_dir="", model_name="org/m", tokens_per_hash=16, blocks_per_file=1, tp_size=1,
                        pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16", parallel_agnostic=True)
    name = mapper.get_file_name(key)
    digest = (b"\x01" * 32).hex()
    assert name == f"{mapper.base_path}_r{mapper.rank}/010/10_g3/{digest}.bin"
    assert mapper.base_path.startswith("/org_m_")


def test_the_factory_passes_every_other_key_to_the_tier() -> None:
    """``type`` names the class in ``module_path``; ``type``, ``module_path`` and ``backpressure`` are
    removed, everything else (``locality`` too) arrives as keyword arguments."""
    source = inspect.getsource(SecondaryTierFactory.create_secondary_tier)
    for fragment in ('config.pop("type")', 'config.pop("module_path", None)', 'config.pop("backpressure", None)',
                     "**config"):
        assert fragment in source, fragment
    assert SecondaryTierFactory.get_tier_class({"type": "KvgwTier", "module_path": "kvgw_client.vllm"}) is KvgwTier
