"""vLLM's scheduler-side connector (the real ``Scheduler`` + ``OffloadingConnector`` +
``TieringOffloadingSpec``, a stand-in worker: ``gateway.bench.vllm_engine.SchedulerEngine``) with kvgw's
tier, two engine instances sharing one gateway: B computes only the tokens A did not store, and the
blocks B loads hold the bytes A computed for the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.vllm_engine import TINY_LLAMA, SchedulerEngine
from tests.conftest import ServerProcess
from tests.integration.vllm.conftest import kvgw_tier


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path / "model")


@pytest.fixture
def schedulers(model_dir: str) -> Iterator[Any]:
    made: list[SchedulerEngine] = []

    def make(tiers: list[dict[str, Any]], **kw: Any) -> SchedulerEngine:
        engine = SchedulerEngine(model_dir, tiers, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def test_engine_b_computes_only_what_engine_a_did_not_store(
    schedulers: Any, gateway: ServerProcess, seed: int
) -> None:
    prompt = [(seed + i) % 997 + 1 for i in range(4 * 16 + 5)]  # 4 full blocks and 5 tokens more
    a = schedulers([kvgw_tier(gateway)])
    a.add("a-1", prompt)
    steps = a.run()
    assert sum(s.scheduled.get("a-1", 0) for s in steps) == len(prompt)  # A computed the whole prompt
    assert sum(s.stores for s in steps) >= 1
    (tier_a,) = a.tiers
    assert tier_a.stats()["tier"]["store.blocks"] == 4 and tier_a.stats()["tier"]["store.failed"] == 0

    b = schedulers([kvgw_tier(gateway)])  # a fresh primary tier: only kvgw has the blocks
    b.add("b-1", prompt)
    steps = b.run()
    computed = [s.scheduled["b-1"] for s in steps if "b-1" in s.scheduled]
    assert computed[0] == 5  # the prefill: only the 5 tokens after the 4 stored blocks
    assert sum(s.loads for s in steps) >= 1
    assert (b.loaded_ok, b.loaded_bad) == (4, 0)  # A's bytes for these tokens, block for block
    assert b.tiers[0].stats()["tier"]["load.blocks"] == 4
