"""Offline trace simulator: prefix hit rates of the eviction policies on Mooncake-format traces.

It replays a trace through the *engine's* policy classes (``gateway.lifecycle.policy``), following the
simulation rules of the reference numbers (``shared/traces/README.md``):

* Each request first looks the cache up: its hits are the longest leading run of its ``hash_ids`` that
  are all cached (prefix hits). Token-weighted: every block counts 512 tokens except the last, which
  counts ``input_length - 512*(n-1)``.
* Then its first ``capacity`` blocks are stored head first: a cached block is touched, a missing one
  inserted (evicting ``victim()`` until a slot is free), and each block is linked to its predecessor,
  as the gateway learns chains from ``x-kvgw-parent``.
* Capacity is counted in whole blocks: ``capacity_tokens // 512``.
* Policies see ``now`` = the request's timestamp in seconds and ``size`` = the block's tokens.

Belady (offline MIN) is not an engine policy (it needs the future) and lives here.

CLI (wired into ``kvgw bench trace --mode sim``; meanwhile ``python -m gateway.bench.trace_sim``)::

    python -m gateway.bench.trace_sim --trace FILE --policy default --capacity-tokens 1000000 3000000
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

from gateway.lifecycle.policy import POLICIES, EvictionPolicy, make_policy

BLOCK_TOKENS = 512
BELADY = "belady"
SIM_POLICIES = (*POLICIES, BELADY)

_NEVER = 1 << 62  # next use of a block that is never used again


@dataclass(frozen=True, slots=True)
class Request:
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


def load_trace(path: str | Path) -> list[Request]:
    """Read a Mooncake JSONL trace (``timestamp`` in ms, ``input_length``, ``hash_ids``)."""
    requests = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                requests.append(Request(rec["timestamp"] / 1000.0, int(rec["input_length"]), tuple(rec["hash_ids"])))
    return requests


def _prefix_hits(req: Request, cached: Callable[[int], bool]) -> tuple[int, int]:
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


def simulate(requests: Sequence[Request], policy: EvictionPolicy[int], capacity_blocks: int) -> SimResult:
    """Replay ``requests`` through ``policy`` with room for ``capacity_blocks`` blocks."""
    start = time.perf_counter()
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    if capacity_blocks <= 0:
        for req in requests:
            total_tokens += req.input_length
            total_blocks += len(req.hash_ids)
        return SimResult(0, total_tokens, 0, total_blocks, time.perf_counter() - start)
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


def next_uses(requests: Sequence[Request]) -> list[list[int]]:
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
    requests: Sequence[Request], capacity_blocks: int, uses: list[list[int]] | None = None
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


def simulate_named(
    requests: Sequence[Request],
    policy_name: str,
    capacity_blocks: int,
    uses: list[list[int]] | None = None,
) -> SimResult:
    if policy_name == BELADY:
        return simulate_belady(requests, capacity_blocks, uses)
    policy: EvictionPolicy[int] = make_policy(policy_name)
    return simulate(requests, policy, capacity_blocks)


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgw bench trace --mode sim",
        description="Replay a Mooncake trace through an eviction policy; LRU and Belady run alongside.",
    )
    p.add_argument("--mode", choices=["sim"], default="sim")
    p.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL trace")
    p.add_argument("--policy", default="default", choices=SIM_POLICIES)
    p.add_argument("--capacity-tokens", required=True, type=int, nargs="+", metavar="N")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the hit-rate table of ``--policy`` next to LRU and Belady (and write ``--json``)."""
    args = _parser().parse_args(argv)
    policies = [args.policy] + [p for p in ("lru", BELADY) if p != args.policy]
    requests = load_trace(args.trace)
    uses = next_uses(requests)
    rows: list[dict[str, object]] = []
    table: dict[tuple[str, int], float] = {}
    for cap in args.capacity_tokens:
        for name in policies:
            res = simulate_named(requests, name, cap // BLOCK_TOKENS, uses)
            table[name, cap] = res.hit_rate
            rows.append(_row(args.trace.name, name, cap, res))
    out = sys.stdout
    out.write(f"trace {args.trace.name}: {len(requests)} requests, token-weighted prefix hit rate\n")
    head = f"{'capacity_tokens':>15}" + "".join(f"{n:>12}" for n in policies)
    show_gap = args.policy not in ("lru", BELADY)
    if show_gap:
        head += f"{'vs lru':>9}{'gap closed':>12}"
    out.write(head + "\n")
    for cap in args.capacity_tokens:
        line = f"{cap:>15}" + "".join(f"{table[n, cap]:>12.4f}" for n in policies)
        if show_gap:
            ours, lru, best = table[args.policy, cap], table["lru", cap], table[BELADY, cap]
            ratio = f"{ours / lru:.2f}x" if lru else "-"
            gap = f"{(ours - lru) / (best - lru):.1%}" if best - lru > 1e-9 else "-"
            line += f"{ratio:>9}{gap:>12}"
        out.write(line + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
