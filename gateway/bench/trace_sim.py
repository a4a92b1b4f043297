"""Offline trace simulator: prefix hit rates of the eviction policies on Mooncake-format traces.

It replays a trace through the *engine's* policy classes: the sampled policies of
``gateway.lifecycle.policy`` (names ``default``, ``lru``, ``fifo``, ``lfu``, ``prefix-lru``), run over an
in-memory copy of what the index records (``gateway.lifecycle.memory_source``), exactly as the
lifecycle engine runs them over the LMDB index. Beside them, as baselines, the exact in-memory
policies the engine used before (``gateway.lifecycle.exact``, names ``exact-default``, ``exact-lru``,
...; ``exact-lru`` etc. reproduce the reference hit rates) and Belady. The simulation rules are those
of the reference numbers (``shared/traces/README.md``):

* Each request first looks the cache up: its hits are the longest leading run of its ``hash_ids`` that
  are all cached (prefix hits). Token-weighted: every block counts 512 tokens except the last, which
  counts ``input_length - 512*(n-1)``.
* Then its first ``capacity`` blocks are stored head first: a cached block is touched (read), a missing
  one inserted (evicting victims until a slot is free), and each block is linked to its predecessor,
  as the gateway learns chains from ``x-kvgw-parent``.
* Capacity is counted in whole blocks: ``capacity_tokens // 512``.
* Policies see ``size`` = the block's tokens and ``now`` = the request's timestamp in seconds, plus
  0.1 us per block position (the gateway's clock orders the blocks of one request; the sampled LRU
  then breaks ties as the exact one does).

Belady (offline MIN) is not an engine policy (it needs the future) and lives here.

CLI (wired into ``kvgw bench trace --mode sim``; meanwhile ``python -m gateway.bench.trace_sim``)::

    python -m gateway.bench.trace_sim --trace FILE --policy default --capacity-tokens 1000000 3000000

Printed beside the chosen policy: ``exact-default``, ``exact-lru`` and Belady (``BASELINES``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from backends.index import MARK_ENDED, MARK_ONE_OFF, MARK_SESSION_ENDED
from gateway.bench.plots import plot_hitrate, progress
from gateway.bench.qa_workload import QAParams, describe, generate
from gateway.bench.trace_oracle import NAME as ORACLE_CLASSES
from gateway.bench.trace_oracle import OracleClasses
from gateway.lifecycle.admission import decide
from gateway.lifecycle.exact import EXACT_POLICIES, EvictionPolicy, make_exact_policy
from gateway.lifecycle.memory_source import MemorySource
from gateway.lifecycle.policies import POLICIES, make_policy
from gateway.lifecycle.policy import SampledPolicy

BLOCK_TOKENS = 512
BELADY = "belady"
EXACT = "exact-"
SIM_POLICIES = (*POLICIES, *(EXACT + name for name in EXACT_POLICIES), BELADY, ORACLE_CLASSES)
_POSITION_TICK = 1e-7  # seconds between the blocks of one request

_NEVER = 1 << 62  # next use of a block that is never used again
SESSION_ENDED_MARKS = MARK_ENDED | MARK_SESSION_ENDED  # what the ``session-ended`` hint sets
GHOST_HISTORY = 2.0  # evictions remembered per chunk held, as the engine's ``ghost_history``


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds
    input_length: int
    hash_ids: tuple[int, ...]
    session: int = -1  # the user whose request it is, when the trace says (the QA workload; Mooncake: -1)
    last: bool = False  # the session's last request: an engine hint says so after it (``--hints``)
    block_tokens: int = BLOCK_TOKENS  # tokens per block (the traces': 512)
    one_off_writes: bool = False  # known as the last while it is stored: its writes are one-off (``--hints``)

    @property
    def last_block_tokens(self) -> int:
        return self.input_length - self.block_tokens * (len(self.hash_ids) - 1)

    def tokens_at(self, pos: int) -> int:
        """Tokens of block ``pos``: a full block but the last, which holds what is left (the size every
        replay gives a block: the lifecycle evicts partial tails first)."""
        return self.last_block_tokens if pos == len(self.hash_ids) - 1 else self.block_tokens


@dataclass(frozen=True, slots=True)
class SimResult:
    hit_tokens: int
    total_tokens: int
    hit_blocks: int
    total_blocks: int
    seconds: float
    late_hit_tokens: int = 0  # of the second half of the requests (the first half only warms the cache)
    late_total_tokens: int = 0
    declined: int = 0  # blocks admission did not take (each ends its request's writes)

    @property
    def hit_rate(self) -> float:
        """Token-weighted prefix hit rate."""
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def second_half(self) -> float:
        """Token-weighted prefix hit rate of the second half of the requests, the first half having
        warmed the cache (the reference's ``warm50``)."""
        return self.late_hit_tokens / self.late_total_tokens if self.late_total_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (``timestamp`` in ms, ``input_length``, ``hash_ids``)."""
    requests = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                last = bool(rec.get("last", False))
                requests.append(
                    TraceRequest(rec["timestamp"] / 1000.0, int(rec["input_length"]), tuple(rec["hash_ids"]),
                                 int(rec.get("user", -1)), last, one_off_writes=last)
                )
    return requests


def conversation_ends(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """``requests`` with ``last`` set where no later request continues the conversation: its last full
    block (whose hash id stands for the whole prefix before it) appears in no later request. The Mooncake
    traces record no sessions; this is when an engine that knows its sessions (a chat application
    closing a conversation) sends ``session-ended``. Nobody knows it while the request is stored, so
    its writes are not one-off. Requests of one block are never marked (they continue nothing)."""
    seen_later: set[int] = set()
    out = list(requests)
    for i in range(len(out) - 1, -1, -1):
        ids = out[i].hash_ids
        ended = len(ids) >= 2 and ids[-2] not in seen_later
        out[i] = replace(out[i], last=ended, one_off_writes=False)
        seen_later.update(ids)
    return out


def _prefix_hits(req: TraceRequest, cached: Callable[[int], bool]) -> tuple[int, int]:
    """(hit blocks, hit tokens) of the longest cached leading run of ``req``."""
    ids = req.hash_ids
    hits = 0
    for block in ids:
        if not cached(block):
            break
        hits += 1
    if hits == len(ids):
        return hits, req.input_length
    return hits, hits * req.block_tokens


def simulate(requests: Sequence[TraceRequest], policy: EvictionPolicy[int] | SampledPolicy[int],
             capacity_blocks: int, *, seed: int = 0, hints: bool = False, hint_delay: float = 0.0,
             leader_changes: int = 0) -> SimResult:
    """Replay ``requests`` through ``policy`` (sampled or exact) with room for ``capacity_blocks`` blocks.
    ``seed``: the sampled policies' random source. ``hints``: ``hint_delay`` seconds after a session's
    last request (``TraceRequest.last``) its blocks get the ``session-ended`` hint, as an engine
    integration sends it, and requests with ``one_off_writes`` store one-off chunks (the exact policies
    know no hints). ``leader_changes``: that many times, evenly spaced, the lifecycle
    leader changes (sampled policies): the new leader's policy starts from the learnt state the old one
    left in the catalog (``export`` / ``restore``), which only ``reuse`` keeps; the others start over."""
    if isinstance(policy, SampledPolicy):
        return _simulate_sampled(requests, policy, capacity_blocks, seed, hints, hint_delay, leader_changes)
    return _simulate_exact(requests, policy, capacity_blocks)


class _Tally:
    """Hits and tokens of a replay, overall and over its second half (the first half only warms)."""

    def __init__(self, requests: Sequence[TraceRequest]) -> None:
        self.half = len(requests) // 2
        self.hit_tokens = self.total_tokens = self.hit_blocks = self.total_blocks = 0
        self.late_hit_tokens = self.late_total_tokens = 0
        self.declined = 0  # writes admission declined
        self.start = time.perf_counter()

    def lookup(self, i: int, req: TraceRequest, cached: Callable[[int], bool]) -> None:
        blocks, tokens = _prefix_hits(req, cached)
        self.hit_blocks += blocks
        self.hit_tokens += tokens
        self.total_blocks += len(req.hash_ids)
        self.total_tokens += req.input_length
        if i >= self.half:
            self.late_hit_tokens += tokens
            self.late_total_tokens += req.input_length

    def result(self) -> SimResult:
        return SimResult(self.hit_tokens, self.total_tokens, self.hit_blocks, self.total_blocks,
                         time.perf_counter() - self.start, self.late_hit_tokens, self.late_total_tokens,
                         self.declined)


def _empty(requests: Sequence[TraceRequest]) -> SimResult:
    tally = _Tally(requests)
    for i, req in enumerate(requests):
        tally.lookup(i, req, lambda _: False)
    return tally.result()


def _simulate_sampled(requests: Sequence[TraceRequest], policy: SampledPolicy[int], capacity_blocks: int,
                      seed: int, hints: bool = False, hint_delay: float = 0.0, leader_changes: int = 0
                      ) -> SimResult:
    """The engine's loop in miniature: the index is a ``MemorySource``; the policy learns from the
    source's observations (reads, returns, forgotten ghosts) before each victim, as the engine hands it
    the index's once per pass; victims are evicted (remembered as ghosts) and reported."""
    if capacity_blocks <= 0:
        return _empty(requests)
    tally = _Tally(requests)
    source: MemorySource[int] = MemorySource(seed, history=GHOST_HISTORY)
    contains, touch, insert, evict, link = source.__contains__, source.touch, source.insert, source.evict, source.link
    parent_of, observations = source.parent, source.observations
    victim, evicted, learn = policy.victim, policy.evicted, policy.learn
    learns = policy.learns
    changes = {len(requests) * (k + 1) // (leader_changes + 1) for k in range(leader_changes)}
    ended: deque[tuple[float, tuple[int, ...]]] = deque()  # session-ended hints on their way, by due time
    for i, req in enumerate(requests):
        while ended and ended[0][0] <= req.timestamp:
            for block in ended.popleft()[1]:
                source.mark(block, SESSION_ENDED_MARKS)
        if i in changes:  # a new leader: a policy of its own, from what the old one left in the catalog
            state = policy.export()
            policy = type(policy)()
            if state is not None:
                policy.restore(json.loads(json.dumps(state)))
            victim, evicted, learn = policy.victim, policy.evicted, policy.learn
        tally.lookup(i, req, contains)
        ids = req.hash_ids
        prev: int | None = None
        for pos, block in enumerate(ids[:capacity_blocks]):
            now = req.timestamp + pos * _POSITION_TICK
            if contains(block):
                touch(block, now)
            else:
                size = req.tokens_at(pos)
                # at the watermark, admission first: with hints a session's last request writes one-off
                # chunks (as LMCache's connector does), which a full tier declines
                marks = MARK_ONE_OFF if hints and req.one_off_writes else 0
                if len(source) >= capacity_blocks and decide(marks=marks) is not None:
                    tally.declined += 1
                    break  # the rest of the request's blocks would have no parent
                while len(source) >= capacity_blocks:
                    if learns:
                        while observations:
                            learn(observations.popleft())
                    out = victim(source, now)
                    if out is None:  # pragma: no cover - a policy bug, not a trace property
                        raise RuntimeError(f"{policy.name}: no victim with {len(source)} blocks held")
                    parent = parent_of(out.key)
                    evicted(out, parent, source, now, remembered=evict(out.key, now))
                insert(block, size, now, marks)
            if prev is not None:
                link(block, prev)
            prev = block
        if hints and req.last:  # applied before the first request at or after its due time
            ended.append((req.timestamp + hint_delay, ids))
    return tally.result()


def _simulate_exact(requests: Sequence[TraceRequest], policy: EvictionPolicy[int], capacity_blocks: int
                    ) -> SimResult:
    if capacity_blocks <= 0:
        return _empty(requests)
    tally = _Tally(requests)
    contains = policy.__contains__
    insert, touch, remove, link, victim = (policy.insert, policy.touch, policy.remove, policy.link, policy.victim)
    size = len(policy)  # blocks held; the simulator, like the engine, does the accounting
    for i, req in enumerate(requests):
        tally.lookup(i, req, contains)
        now = req.timestamp
        ids = req.hash_ids
        stored = ids[:capacity_blocks]
        prev: int | None = None
        for pos, block in enumerate(stored):
            if contains(block):
                touch(block, now)
            else:
                while size >= capacity_blocks:
                    out = victim()
                    if out is None:  # pragma: no cover - a policy bug, not a trace property
                        raise RuntimeError(f"{policy.name}: no victim with {size} blocks held")
                    remove(out)
                    size -= 1
                insert(block, req.tokens_at(pos), now)
                size += 1
            if prev is not None:
                link(block, prev)
            prev = block
    return tally.result()


def next_uses(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """For every block of every request, the index of the next request containing it (or never)."""
    following: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        out[i] = [following.get(block, _NEVER) for block in ids]
        for block in ids:
            following[block] = i
    return out


def simulate_belady(
    requests: Sequence[TraceRequest], capacity_blocks: int, uses: list[list[int]] | None = None
) -> SimResult:
    """Offline MIN over blocks: evict the block used farthest in the future.

    Hits update a block's next use. A newcomer is not inserted when no cached block is used later
    than it (ties keep the cache as it is); among cached blocks with the same next use the least
    recently accessed goes first. These tie rules reproduce the reference numbers exactly. Heap of
    ``(-next_use, seq, block)`` with lazy deletion.
    """
    tally = _Tally(requests)
    if uses is None:
        uses = next_uses(requests)
    cached: dict[int, tuple[int, int]] = {}  # block -> (next use, access seq)
    heap: list[tuple[int, int, int]] = []
    seq = 0
    for i, (req, req_uses) in enumerate(zip(requests, uses, strict=True)):
        tally.lookup(i, req, cached.__contains__)
        if capacity_blocks <= 0:
            continue
        for block, nxt in zip(req.hash_ids[:capacity_blocks], req_uses, strict=False):
            seq += 1
            if block not in cached and len(cached) >= capacity_blocks:
                while True:
                    far, old_seq, top = heap[0]
                    if cached.get(top) == (-far, old_seq):
                        break
                    heapq.heappop(heap)
                if nxt >= -far:
                    continue  # nothing cached is needed later than the newcomer: do not cache it
                heapq.heappop(heap)
                del cached[top]
            cached[block] = (nxt, seq)
            heapq.heappush(heap, (-nxt, seq, block))
            if len(heap) > 2 * len(cached) + 64:
                heap = [(-n, s, b) for b, (n, s) in cached.items()]
                heapq.heapify(heap)
    return tally.result()


def make_sim_policy(name: str) -> EvictionPolicy[Any] | SampledPolicy[Any]:
    """A sampled engine policy (``default``, ``lru``, ...) or an exact baseline (``exact-<name>``)."""
    if name.startswith(EXACT):
        return make_exact_policy(name.removeprefix(EXACT))
    return make_policy(name)


def simulate_named(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity_blocks: int,
    uses: list[list[int]] | None = None,
    *,
    seed: int = 0,
    hints: bool = False,
    hint_delay: float = 0.0,
    leader_changes: int = 0,
) -> SimResult:
    if policy_name == BELADY:
        return simulate_belady(requests, capacity_blocks, uses)
    if policy_name == ORACLE_CLASSES:  # a baseline: statistics measured over the whole trace in advance
        return simulate(requests, OracleClasses(requests), capacity_blocks, seed=seed)
    return simulate(requests, make_sim_policy(policy_name), capacity_blocks, seed=seed, hints=hints,
                    hint_delay=hint_delay, leader_changes=leader_changes)


def run_sim(trace_path: str | Path, policy_name: str, capacities_tokens: list[int]) -> list[dict[str, object]]:
    """Hit rates of one policy (``belady`` included) at each capacity, for the ``kvgw bench`` CLI."""
    if policy_name not in SIM_POLICIES:
        raise KeyError(f"unknown policy {policy_name!r}; choose one of {list(SIM_POLICIES)}")
    requests = load_trace(trace_path)
    uses = next_uses(requests) if policy_name == BELADY else None
    name = Path(trace_path).name
    return [
        _row(name, policy_name, int(cap), simulate_named(requests, policy_name, int(cap) // BLOCK_TOKENS, uses))
        for cap in capacities_tokens
    ]


def _row(trace: str, policy: str, capacity_tokens: int, res: SimResult) -> dict[str, object]:
    return {
        "trace": trace,
        "policy": policy,
        "capacity_tokens": capacity_tokens,
        "hit_rate": res.hit_rate,
        "second_half": res.second_half,
        "declined": res.declined,
        "block_hit_rate": res.block_hit_rate,
        "seconds": round(res.seconds, 3),
    }


def gap_closed(ours: float, lru: float, best: float) -> float | None:
    """The share of the exact-LRU -> Belady gap that ``ours`` closes (None where there is no gap)."""
    return (ours - lru) / (best - lru) if best - lru > 1e-9 else None


def capacity_at_lru_fraction(requests: Sequence[TraceRequest], fraction: float) -> int:
    """The capacity (tokens, whole blocks) at which exact LRU reaches ``fraction`` of its uncapped hit
    rate on ``requests`` (bisection over blocks; LRU's hit rate grows with capacity)."""
    total_blocks = len({block for req in requests for block in req.hash_ids})
    uncapped = simulate_named(requests, _LRU, total_blocks).hit_rate
    low, high = 1, total_blocks
    while low < high:
        mid = (low + high) // 2
        if simulate_named(requests, _LRU, mid).hit_rate >= fraction * uncapped:
            high = mid
        else:
            low = mid + 1
    return low * (requests[0].block_tokens if requests else BLOCK_TOKENS)


BASELINES = ("exact-default", "exact-lru", BELADY)
"""Printed beside the chosen policy: what the engine's ``default`` was before issue 11 (exact, in
memory), the reference LRU, and the offline ceiling."""
_LRU = "exact-lru"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="kvgw bench trace --mode sim",
        description="Replay a Mooncake trace, or the generated multi-round QA workload, through an eviction "
                    "policy (the engine's sampled policies, or exact-<name> for the exact in-memory ones); "
                    "exact default, exact LRU and Belady run alongside. Every hit rate is given for the whole "
                    "trace and for its second half (the first half warming the cache).",
    )
    p.add_argument("--mode", choices=["sim"], default="sim")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="Mooncake JSONL trace")
    source.add_argument("--qa", action="store_true",
                        help="LMCache's multi-round QA workload, generated (gateway.bench.qa_workload)")
    p.add_argument("--qa-param", nargs="*", default=[], metavar="KEY=VALUE",
                   help="QA workload parameters (users, rounds, total_users, system_tokens, history_tokens, "
                        "question_tokens, answer_tokens, qps, instances, routing, seed)")
    p.add_argument("--policy", default="default", choices=SIM_POLICIES)
    p.add_argument("--also", nargs="*", default=[], choices=SIM_POLICIES, metavar="POLICY",
                   help="more policies to print beside it")
    p.add_argument("--capacity-tokens", type=int, nargs="*", default=[], metavar="N")
    p.add_argument("--lru-fraction", type=float, nargs="*", default=[], metavar="F",
                   help="also the capacity at which exact LRU reaches F of its uncapped hit rate")
    p.add_argument("--hints", action="store_true",
                   help="send the session-ended hint after each session's last request: the QA workload says "
                        "which requests end a session (and stores them one-off); in a Mooncake trace, a "
                        "request no later request continues ends its conversation (conversation_ends)")
    p.add_argument("--hint-delay", type=float, default=0.0, metavar="S",
                   help="the session-ended hint arrives S seconds after the session's last request")
    p.add_argument("--leader-changes", type=int, default=0, metavar="N",
                   help="the lifecycle leader changes N times, evenly spread (the learnt state the old leader "
                        "kept in the catalog is all the new one has)")
    p.add_argument("--seed", type=int, default=0, help="the sampled policies' random source")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw hit rate against capacity per policy (needs the bench extra)")
    return p


def qa_params(pairs: Sequence[str]) -> QAParams:
    """``QAParams`` from ``key=value`` strings (values typed as the defaults are)."""
    defaults = QAParams()
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not hasattr(defaults, key):
            raise SystemExit(f"--qa-param {pair!r}: expected KEY=VALUE with KEY one of {list(asdict(defaults))}")
        values[key] = type(getattr(defaults, key))(value)
    return replace(defaults, **values)


def qa_requests(params: QAParams, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """The QA workload as trace requests (``block_tokens`` per block; the simulator's hit rates count
    tokens, so other block sizes than 512 replay the same tokens in other blocks)."""
    ids: dict[tuple[int, ...], int] = {}
    out = []
    for req in generate(params):
        hash_ids = tuple(ids.setdefault(name, len(ids)) for name in req.block_names(block_tokens))
        out.append(TraceRequest(req.timestamp, req.input_length, hash_ids, req.user, req.last, block_tokens,
                                one_off_writes=req.last))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the hit-rate tables of ``--policy`` next to the baselines (and write ``--json``)."""
    args = _parser().parse_args(argv)
    policies = list(dict.fromkeys([args.policy, *args.also, *BASELINES]))
    out = sys.stdout
    if args.qa:
        params = qa_params(args.qa_param)
        requests = qa_requests(params)
        name = "qa"
        out.write(f"multi-round QA workload: {describe(params)}\n")
    else:
        requests = load_trace(args.trace)
        name = args.trace.name
        if args.hints and not any(req.last for req in requests):
            requests = conversation_ends(requests)
            out.write(f"session ends derived from the trace: {sum(req.last for req in requests)} of "
                      f"{len(requests)} requests end their conversation (no later request continues them)\n")
    capacities = list(args.capacity_tokens)
    for fraction in args.lru_fraction:
        cap = capacity_at_lru_fraction(requests, fraction)
        out.write(f"exact LRU reaches {fraction:.0%} of its uncapped hit rate at {cap} tokens\n")
        capacities.append(cap)
    if not capacities:
        raise SystemExit("give --capacity-tokens or --lru-fraction")
    uses = next_uses(requests)
    rows: list[dict[str, object]] = []
    table: dict[tuple[str, int], SimResult] = {}
    steps = [(cap, policy) for cap in capacities for policy in policies]
    for cap, policy in progress(steps, f"simulating {name}"):
        res = simulate_named(requests, policy, cap // BLOCK_TOKENS, uses, seed=args.seed, hints=args.hints,
                             hint_delay=args.hint_delay,
                             leader_changes=args.leader_changes)
        table[policy, cap] = res
        rows.append(_row(name, policy, cap, res))
    out.write(f"trace {name}: {len(requests)} requests, token-weighted prefix hit rate"
              f"{', with session-ended hints' if args.hints else ''}"
              f"{f' {args.hint_delay:g} s after the last request' if args.hints and args.hint_delay else ''}"
              f"{f', {args.leader_changes} leader changes' if args.leader_changes else ''}\n")
    show_gap = args.policy not in (_LRU, BELADY)
    for label, rate in (("whole trace", "hit_rate"), ("second half (first half warms)", "second_half")):
        out.write(f"-- {label}\n")
        width = max(12, *(len(n) + 2 for n in policies))
        head = f"{'capacity_tokens':>15}" + "".join(f"{n:>{width}}" for n in policies)
        if show_gap:
            head += f"{'vs lru':>9}{'gap closed':>12}"
        out.write(head + "\n")
        closed: list[float] = []
        for cap in capacities:
            values = {n: getattr(table[n, cap], rate) for n in policies}
            line = f"{cap:>15}" + "".join(f"{values[n]:>{width}.4f}" for n in policies)
            if show_gap:
                ours, lru = values[args.policy], values[_LRU]
                gap = gap_closed(ours, lru, values[BELADY])
                if gap is not None:
                    closed.append(gap)
                line += f"{f'{ours / lru:.2f}x' if lru else '-':>9}{'-' if gap is None else f'{gap:.1%}':>12}"
            out.write(line + "\n")
        if closed:
            out.write(f"{'mean gap closed':>15} {sum(closed) / len(closed):.1%} over {len(closed)} capacities\n")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        plot_hitrate(rows, args.plot)
        out.write(f"plot written to {args.plot}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
