"""``kvgw bench trace --mode online`` against a live gateway on a handmade trace: with room for every
block nothing is evicted, so the replay's hit rate must equal the simulator's exactly (the replay's
lookups, reads, writes and hit accounting are the simulator's), hints included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench import trace_online


def _trace(path: Path) -> Path:
    """Three conversations of three turns over a shared two-block system prompt; every prompt ends in
    a partial block; the third conversation branches off the first one after its first own block."""
    system = [1, 2]
    lines = []
    turns = {0: [10, 11, 12], 1: [20, 21, 22], 2: [10, 31, 32]}
    at = 0
    for turn in range(3):
        for conversation, own in turns.items():
            ids = system + own[: turn + 1]
            lines.append({"timestamp": at, "input_length": 512 * (len(ids) - 1) + 100 + conversation,
                          "hash_ids": ids})
            at += 50
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("hints", [False, True])
def test_with_room_for_everything_the_replay_hits_what_the_simulator_hits(tmp_path: Path, hints: bool) -> None:
    out = tmp_path / "result.json"
    argv = ["--trace", str(_trace(tmp_path / "chat.jsonl")), "--capacity-tokens", str(512 * 64),
            "--concurrency", "1", "--data-dir", str(tmp_path), "--json", str(out)]
    assert trace_online.main(argv + (["--hints"] if hints else [])) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_kinds"]
    assert result["requests"] == 9
    assert result["lifecycle"]["evicted"] == 0
    assert result["hit_rate"] > 0.4  # every later turn reads its earlier prefix back
    assert result["hit_rate"] == pytest.approx(result["sim_hit_rate_same_requests"], abs=1e-12)
