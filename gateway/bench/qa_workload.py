"""LMCache's multi-round QA workload, generated: users x rounds over a shared system prompt.

The pattern of LMCache's ``benchmarks/multi-round-qa`` (and of the NetApp and LMCache posts that
measure shared KV tiers with it): ``users`` users are active at once; each starts with the shared
system prompt and a long document of its own (its history), asks ``rounds`` questions, one every
``users / qps`` seconds, and each answer joins its history, so round r's prompt is round r-1's plus
that answer and the next question. A user that has asked its last question leaves and a new user
takes its place, until ``total_users`` have come. Requests go to ``instances`` engine instances that
share the tier, round-robin by request (``routing="round-robin"``, what a stateless router does: a
user's next round usually lands on the other instance) or by user (``"session"``).

Nothing here was tuned on, or taken from, the Mooncake traces the eviction policies were developed
on: it is the third workload of issue 33's evaluation.

Two views of the same requests:

* ``QARequest.hash_ids(block_tokens)``: prefix-block ids as in the Mooncake traces (``gateway.bench.
  trace_sim`` replays them): a block's id names its whole prefix, so blocks inside the system prompt are
  shared by every user, every later full block is its user's, and a partial last block is new each round.
* ``QARequest.tokens()``: the prompt's token ids (seeded, so every round repeats the earlier rounds'
  tokens exactly), for engines that hash tokens themselves (``kvgw bench qa`` through LMCache and SGLang).

Pure Python, no I/O; deterministic for a given ``QAParams``.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB = 32000


@dataclass(frozen=True)
class QAParams:
    """The workload's knobs; the defaults are LMCache's benchmark's long-document setting."""

    users: int = 15  # users active at once
    rounds: int = 20  # questions per user
    total_users: int = 60  # users over the whole run (new ones join as others finish)
    system_tokens: int = 1000  # the shared system prompt
    history_tokens: int = 20000  # each user's own document, before its first question
    question_tokens: int = 50
    answer_tokens: int = 100
    qps: float = 1.0  # requests per second, all users together
    instances: int = 2  # engine instances sharing the tier
    routing: str = "round-robin"  # or "session": a user's rounds all go to one instance
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.users, self.rounds, self.total_users, self.instances) < 1 or self.qps <= 0:
            raise ValueError("users, rounds, total_users, instances and qps must be positive")
        if min(self.system_tokens, self.history_tokens, self.question_tokens, self.answer_tokens) < 0:
            raise ValueError("token counts must not be negative")
        if self.routing not in ("round-robin", "session"):
            raise ValueError("routing is round-robin or session")


@dataclass(frozen=True)
class QARequest:
    timestamp: float  # seconds from the start
    user: int
    round: int  # 0-based
    instance: int
    input_length: int  # prompt tokens
    output_length: int
    last: bool  # the user's last round: its session ends with this request
    params: QAParams = field(repr=False, compare=False)

    def prefix_lengths(self) -> tuple[int, int]:
        """(system prompt tokens, tokens of this user's own text) of the prompt."""
        p = self.params
        return p.system_tokens, self.input_length - p.system_tokens

    def block_names(self, block_tokens: int) -> list[tuple[int, ...]]:
        """A name per ``block_tokens`` block of the prompt, equal exactly when the block and everything
        before it are equal: ``(-1, i)`` inside the system prompt, ``(user, i)`` for a full block after
        it, ``(user, i, fill)`` for a partial last block."""
        n = self.input_length
        system = self.params.system_tokens
        names: list[tuple[int, ...]] = []
        for i in range(-(-n // block_tokens)):
            end = min((i + 1) * block_tokens, n)
            if end <= system and end - i * block_tokens == block_tokens:
                names.append((-1, i))
            elif end - i * block_tokens == block_tokens:
                names.append((self.user, i))
            else:
                names.append((self.user, i, end - i * block_tokens))
        return names

    def tokens(self) -> list[int]:
        """The prompt's token ids: the system prompt, the user's document, then each earlier round's
        question and answer, then this round's question. Seeded per piece, so round r's prompt starts
        with round r-1's exactly."""
        p = self.params
        out = _piece(p.seed, -1, 0, p.system_tokens)
        out += _piece(p.seed, self.user, 0, p.history_tokens)
        for r in range(self.round):
            out += _piece(p.seed, self.user, 2 * r + 1, p.question_tokens)
            out += _piece(p.seed, self.user, 2 * r + 2, p.answer_tokens)
        out += _piece(p.seed, self.user, 2 * self.round + 1, p.question_tokens)
        return out

    def doc(self, block_tokens: int, ids: dict[tuple[int, ...], int]) -> dict[str, object]:
        """The request as a Mooncake trace record (plus the workload's fields); ``ids`` numbers block
        names in order of first appearance, as the Mooncake release remapped its hashes."""
        hash_ids = [ids.setdefault(name, len(ids)) for name in self.block_names(block_tokens)]
        return {"timestamp": round(self.timestamp * 1000.0, 3), "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": hash_ids, "user": self.user,
                "round": self.round, "instance": self.instance, "last": self.last}


def _piece(seed: int, user: int, part: int, count: int) -> list[int]:
    rng = random.Random(f"{seed}:{user}:{part}")
    return [rng.randrange(VOCAB) for _ in range(count)]


def generate(params: QAParams) -> list[QARequest]:
    """Every request of the workload, in time order."""
    p = params
    gap = p.users / p.qps  # seconds between two rounds of one user
    due: list[tuple[float, int, int]] = []  # (time, user, round)
    for user in range(min(p.users, p.total_users)):
        heapq.heappush(due, (user / p.qps, user, 0))
    joined = len(due)
    out: list[QARequest] = []
    while due:
        at, user, rnd = heapq.heappop(due)
        length = p.system_tokens + p.history_tokens + rnd * (p.question_tokens + p.answer_tokens) + p.question_tokens
        instance = (len(out) if p.routing == "round-robin" else user) % p.instances
        last = rnd == p.rounds - 1
        out.append(QARequest(at, user, rnd, instance, length, p.answer_tokens, last, p))
        if not last:
            heapq.heappush(due, (at + gap, user, rnd + 1))
        elif joined < p.total_users:  # a new user takes the slot of the one that left
            heapq.heappush(due, (at + gap, joined, 0))
            joined += 1
    return out


def write_trace(path: Path, params: QAParams, block_tokens: int = 512) -> int:
    """Write the workload as a Mooncake-format JSONL trace (with the workload's fields); returns the
    number of requests. The first line is a comment-free JSON record like the others."""
    ids: dict[tuple[int, ...], int] = {}
    requests = generate(params)
    with open(path, "w", encoding="utf-8") as fh:
        for req in requests:
            fh.write(json.dumps(req.doc(block_tokens, ids)) + "\n")
    return len(requests)


def describe(params: QAParams) -> str:
    return ", ".join(f"{k}={v}" for k, v in asdict(params).items())


def sessions(requests: list[QARequest]) -> Iterator[tuple[int, list[QARequest]]]:
    """Each user's requests, users in order of arrival."""
    by_user: dict[int, list[QARequest]] = {}
    for req in requests:
        by_user.setdefault(req.user, []).append(req)
    yield from by_user.items()
