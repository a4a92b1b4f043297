"""``kvgw bench qa`` end to end on a tiny workload: both engines' real client paths (LMCache 0.5.x's
StorageManager with kvgw's connector, SGLang's HiCache backend) in two client processes against a live
gateway with a capacity; the report says what was measured and what modelled, and the records add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench import qa
from tests.requirements import require_module, require_or_skip

TINY = ["users=2", "rounds=3", "total_users=3", "history_tokens=1200", "system_tokens=600"]


def test_the_multi_round_workload_through_both_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_module("torch", "torch 2.13.0 (CPU) is not installed (.ci/install-lmcache.sh)")
    require_module("lmcache")
    from gateway.bench import sglang_engine  # imports torch

    if not sglang_engine.installed():
        require_or_skip("sglang is not installed (.ci/install-sglang.sh)")
    out = tmp_path / "records.json"
    assert qa.main(["--qa-param", *TINY, "--capacity-mib", "64", "--workdir", str(tmp_path / "work"),
                    "--json", str(out), "--plot", str(tmp_path / "qa.png")]) == 0
    printed = capsys.readouterr().out
    assert "lookup (measured) + load (measured) + missed tokens / prefill rate (modelled)" in printed
    assert "Pliops effective acceleration e = T / R" in printed
    for engine in ("lmcache", "sglang"):
        assert f"-- {engine} (" in printed
    records = json.loads(out.read_text())
    for engine, rows in records.items():
        assert [r["index"] for r in rows] == list(range(9)), engine  # every request, once, in order
        assert {r["instance"] for r in rows} == {0, 1}
        assert all(0 <= r["hit_tokens"] <= r["prompt_tokens"] for r in rows)
        later = [r for r in rows if r["round"] > 0]
        assert all(r["hit_tokens"] > 0 for r in later), engine  # 64 MiB holds it all: every later round hits
        assert all(r["hit_tokens"] == 0 for r in rows if r["round"] == 0 and r["user"] == 0)  # the very first
    assert (tmp_path / "qa.png").stat().st_size > 10_000


def test_the_modelled_part() -> None:
    model = qa.Model()
    assert model.rate == pytest.approx(4 * 989e12 * 0.5 / (2 * 70.6e9))
    record = qa.Record(0, 0, 1, 0, prompt_tokens=1000, hit_tokens=768, lookup_s=0.001, load_s=0.002,
                       loaded_bytes=768 * 4096, stored_chunks=1)
    assert qa.ttft(record, model) == pytest.approx(0.003 + 232 / model.rate)
    assert qa.no_tier_ttft(record, model) == pytest.approx(1000 / model.rate)
    given = qa.Model(prefill_tokens_per_s=5000.0)
    assert given.rate == 5000.0 and "given" in given.describe()
