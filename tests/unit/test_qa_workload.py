"""The generated multi-round QA workload: its prompts grow by whole rounds, its block ids follow the
prefix rule the Mooncake traces follow, users come and go as LMCache's benchmark has them."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from gateway.bench.qa_workload import QAParams, generate, sessions, write_trace

SMALL = QAParams(users=3, rounds=4, total_users=7, system_tokens=700, history_tokens=1500, question_tokens=20,
                 answer_tokens=60, qps=2.0, instances=2)


def test_each_round_extends_the_last_and_the_session_ends_with_its_last_round() -> None:
    requests = generate(SMALL)
    assert len(requests) == 7 * 4
    for _, turns in sessions(requests):
        assert [t.round for t in turns] == [0, 1, 2, 3]
        assert [t.last for t in turns] == [False, False, False, True]
        for before, after in pairwise(turns):
            assert after.tokens()[: before.input_length] == before.tokens()
            assert after.input_length == before.input_length + 80
            assert after.timestamp - before.timestamp == pytest.approx(3 / 2.0)  # users / qps
        assert len(turns[0].tokens()) == turns[0].input_length == 700 + 1500 + 20


def test_users_are_replaced_as_they_leave_and_never_more_than_users_at_once() -> None:
    requests = generate(SMALL)
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    active = 0
    peak = 0
    for req in requests:
        active += req.round == 0
        peak = max(peak, active)
        active -= req.last
    assert peak == 3
    assert {r.user for r in requests} == set(range(7))


def test_block_ids_name_whole_prefixes() -> None:
    requests = generate(SMALL)
    names = [r.block_names(512) for r in requests]
    system = [n for n in names[0] if n[0] == -1]
    assert system == [(-1, 0)]  # 700 tokens: one full block of system prompt, the second block is the user's
    assert all(n[: len(system)] == system for n in names)  # shared by every user
    by_user = {r.user: r.block_names(512) for r in requests if r.round == 0}
    assert len({n[1] for n in by_user.values()}) == len(by_user)  # after the system prompt: per user
    first, second = requests[0], next(r for r in requests if r.user == requests[0].user and r.round == 1)
    full = first.input_length // 512
    assert second.block_names(512)[:full] == first.block_names(512)[:full]
    assert second.block_names(512)[full] != first.block_names(512)[full]  # the partial tail is new


def test_routing_round_robin_or_by_session() -> None:
    rr = generate(SMALL)
    assert [r.instance for r in rr[:6]] == [0, 1, 0, 1, 0, 1]
    sticky = generate(QAParams(**{**SMALL.__dict__, "routing": "session"}))
    for _, turns in sessions(sticky):
        assert len({t.instance for t in turns}) == 1


def test_written_as_a_mooncake_trace(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    assert write_trace(path, SMALL) == 28
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) >= {"timestamp", "input_length", "output_length", "hash_ids", "user", "round", "last"}
    assert len(first["hash_ids"]) == -(-first["input_length"] // 512)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        QAParams(users=0)
    with pytest.raises(ValueError, match="routing"):
        QAParams(routing="random")
