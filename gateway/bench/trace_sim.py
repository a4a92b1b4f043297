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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.plots import plot_hitrate, progress
from gateway.lifecycle.exact import EXACT_POLICIES, EvictionPolicy, make_exact_policy
from gateway.lifecycle.memory_source import MemorySource
from gateway.lifecycle.policy import POLICIES, SampledPolicy, make_policy

BLOCK_TOKENS = 512
BELADY = "belady"
EXACT = "exact-"
SIM_POLICIES = (*POLICIES, *(EXACT + name for name in EXACT_POLICIES), BELADY)
_POSITION_TICK = 1e-7  # seconds between the blocks of one request

_NEVER = 1 << 62  # next use of a block that is never used again


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds
    input_length: int
    hash_ids: tuple[int, ...]

    @property
    def last_block_tokens(self) -> int:
        return self.input_length - BLOCK_TOKENS * (len(self.hash_ids) - 1)


@dataclass(frozen=True, slots=True)
class SimResult:
    hit_tokens: int
    total_tokens: int
    hit_blocks: int
    total_blocks: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Token-weighted prefix hit rate."""
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

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
                requests.append(
                    TraceRequest(rec["timestamp"] / 1000.0, int(rec["input_length"]), tuple(rec["hash_ids"]))
                )
    return requests


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
    return hits, hits * BLOCK_TOKENS


def simulate(requests: Sequence[TraceRequest], policy: EvictionPolicy[int] | SampledPolicy[int],
             capacity_blocks: int, *, seed: int = 0) -> SimResult:
    """Replay ``requests`` through ``policy`` (sampled or exact) with room for ``capacity_blocks`` blocks.
    ``seed``: the sampled policies' random source."""
    if isinstance(policy, SampledPolicy):
        return _simulate_sampled(requests, policy, capacity_blocks, seed)
    return _simulate_exact(requests, policy, capacity_blocks)


def _empty(requests: Sequence[TraceRequest], start: float) -> SimResult:
    total_tokens = sum(req.input_length for req in requests)
    total_blocks = sum(len(req.hash_ids) for req in requests)
    return SimResult(0, total_tokens, 0, total_blocks, time.perf_counter() - start)


def _simulate_sampled(requests: Sequence[TraceRequest], policy: SampledPolicy[int], capacity_blocks: int,
                      seed: int) -> SimResult:
    """The engine's loop in miniature: the index is a ``MemorySource``; the policy learns from the
    source's observations (reads, returns, forgotten ghosts) before each victim, as the engine hands it
    the index's once per pass; victims are evicted (remembered as ghosts) and reported."""
    start = time.perf_counter()
    if capacity_blocks <= 0:
        return _empty(requests, start)
    source: MemorySource[int] = MemorySource(seed)
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    contains, touch, insert, evict, link = source.__contains__, source.touch, source.insert, source.evict, source.link
    parent_of, observations = source.parent, source.observations
    victim, evicted, learn = policy.victim, policy.evicted, policy.learn
    learns = policy.learns
    for req in requests:
        blocks, tokens = _prefix_hits(req, contains)
        hit_blocks += blocks
        hit_tokens += tokens
        total_blocks += len(req.hash_ids)
        total_tokens += req.input_length
        ids = req.hash_ids
        last = len(ids) - 1
        prev: int | None = None
        for pos, block in enumerate(ids[:capacity_blocks]):
            now = req.timestamp + pos * _POSITION_TICK
            if contains(block):
                touch(block, now)
            else:
                while len(source) >= capacity_blocks:
                    if learns:
                        while observations:
                            learn(observations.popleft())
                    out = victim(source, now)
                    if out is None:  # pragma: no cover - a policy bug, not a trace property
                        raise RuntimeError(f"{policy.name}: no victim with {len(source)} blocks held")
                    parent = parent_of(out.key)
                    evicted(out, parent, source, now, remembered=evict(out.key, now))
                insert(block, req.last_block_tokens if pos == last else BLOCK_TOKENS, now)
            if prev is not None:
                link(block, prev)
            prev = block
    return SimResult(hit_tokens, total_tokens, hit_blocks, total_blocks, time.perf_counter() - start)


def _simulate_exact(requests: Sequence[TraceRequest], policy: EvictionPolicy[int], capacity_blocks: int
                    ) -> SimResult:
    start = time.perf_counter()
    if capacity_blocks <= 0:
        return _empty(requests, start)
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    contains = policy.__contains__
    insert, touch, remove, link, victim = (policy.insert, policy.touch, policy.remove, policy.link, policy.victim)
    size = len(policy)  # blocks held; the simulator, like the engine, does the accounting
    for req in requests:
        blocks, tokens = _prefix_hits(req, contains)
        hit_blocks += blocks
        hit_tokens += tokens
        total_blocks += len(req.hash_ids)
        total_tokens += req.input_length
        now = req.timestamp
        ids = req.hash_ids
        stored = ids[:capacity_blocks]
        last = len(ids) - 1
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
                insert(block, req.last_block_tokens if pos == last else BLOCK_TOKENS, now)
                size += 1
            if prev is not None:
                link(block, prev)
            prev = block
    return SimResult(hit_tokens, total_tokens, hit_blocks, total_blocks, time.perf_counter() - start)


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
    start = time.perf_counter()
    if uses is None:
        uses = next_uses(requests)
    cached: dict[int, tuple[int, int]] = {}  # block -> (next use, access seq)
    heap: list[tuple[int, int, int]] = []
    seq = 0
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    for req, req_uses in zip(requests, uses, strict=True):
        blocks, tokens = _prefix_hits(req, cached.__contains__)
        hit_blocks += blocks
        hit_tokens += tokens
        total_blocks += len(req.hash_ids)
        total_tokens += req.input_length
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
    return SimResult(hit_tokens, total_tokens, hit_blocks, total_blocks, time.perf_counter() - start)


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
) -> SimResult:
    if policy_name == BELADY:
        return simulate_belady(requests, capacity_blocks, uses)
    return simulate(requests, make_sim_policy(policy_name), capacity_blocks, seed=seed)


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
        "block_hit_rate": res.block_hit_rate,
        "seconds": round(res.seconds, 3),
    }


BASELINES = ("exact-default", "exact-lru", BELADY)
"""Printed beside the chosen policy: what the engine's ``default`` was before issue 11 (exact, in
memory), the reference LRU, and the offline ceiling."""
_LRU = "exact-lru"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="kvgw bench trace --mode sim",
        description="Replay a Mooncake trace through an eviction policy (the engine's sampled policies, or "
                    "exact-<name> for the exact in-memory ones); exact default, exact LRU and Belady run "
                    "alongside.",
    )
    p.add_argument("--mode", choices=["sim"], default="sim")
    p.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL trace")
    p.add_argument("--policy", default="default", choices=SIM_POLICIES)
    p.add_argument("--also", nargs="*", default=[], choices=SIM_POLICIES, metavar="POLICY",
                   help="more policies to print beside it")
    p.add_argument("--capacity-tokens", required=True, type=int, nargs="+", metavar="N")
    p.add_argument("--seed", type=int, default=0, help="the sampled policies' random source")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw hit rate against capacity per policy (needs the bench extra)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the hit-rate table of ``--policy`` next to the baselines (and write ``--json``)."""
    args = _parser().parse_args(argv)
    policies = list(dict.fromkeys([args.policy, *args.also, *BASELINES]))
    requests = load_trace(args.trace)
    uses = next_uses(requests)
    rows: list[dict[str, object]] = []
    table: dict[tuple[str, int], float] = {}
    steps = [(cap, name) for cap in args.capacity_tokens for name in policies]
    for cap, name in progress(steps, f"simulating {args.trace.name}"):
        res = simulate_named(requests, name, cap // BLOCK_TOKENS, uses, seed=args.seed)
        table[name, cap] = res.hit_rate
        rows.append(_row(args.trace.name, name, cap, res))
    out = sys.stdout
    out.write(f"trace {args.trace.name}: {len(requests)} requests, token-weighted prefix hit rate\n")
    width = max(12, *(len(n) + 2 for n in policies))
    head = f"{'capacity_tokens':>15}" + "".join(f"{n:>{width}}" for n in policies)
    show_gap = args.policy not in (_LRU, BELADY)
    if show_gap:
        head += f"{'vs lru':>9}{'gap closed':>12}"
    out.write(head + "\n")
    for cap in args.capacity_tokens:
        line = f"{cap:>15}" + "".join(f"{table[n, cap]:>{width}.4f}" for n in policies)
        if show_gap:
            ours, lru, best = table[args.policy, cap], table[_LRU, cap], table[BELADY, cap]
            ratio = f"{ours / lru:.2f}x" if lru else "-"
            gap = f"{(ours - lru) / (best - lru):.1%}" if best - lru > 1e-9 else "-"
            line += f"{ratio:>9}{gap:>12}"
        out.write(line + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        plot_hitrate(rows, args.plot)
        out.write(f"plot written to {args.plot}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
