"""Online trace replay: a Mooncake trace against a running gateway, as an LMCache client would drive it.

Each request, in arrival order (time compressed by ``--time-scale``, at most ``--concurrency`` in
flight): ``prefix`` lookup of its block keys → hits; ``batch-get`` of the hit prefix; ``PUT`` of the
missing blocks (its first ``capacity`` blocks, like the simulator), each with ``X-Kvgw-Parent`` so the
gateway learns the chain. Chunk bytes are scaled down (``--block-bytes`` per 512-token block; a request's
partial last block is as much smaller as it holds fewer tokens, as an engine stores it and as the
simulator sizes it: the lifecycle evicts such partial tails first) and the bucket's filesystem capacity
is set to the bytes of as many full blocks as ``--capacity-tokens`` holds, so the eviction decisions are
the engine's own, at the capacity the simulator uses (the simulator counts blocks, the gateway bytes:
on the first 3000 requests of each Mooncake trace at 3M tokens the two differ by less than 0.6
points). With ``--s3`` a moto S3 server is started and evicted chunks are demoted to it (and promoted
back on reads).

Reports the token-weighted prefix hit rate (beside the simulator's figure for the same requests),
GET / PUT latency p50 / p99, and the bytes the gateway moved between tiers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

from gateway.bench.launcher import KvgwProcess, moto_server
from gateway.bench.trace_sim import BLOCK_TOKENS, TraceRequest, conversation_ends, load_trace, simulate_named
from kvgw_client import wire
from kvgw_client.wire import Hint

ROOT_AK = "KVBENCHROOTACCESSKEY"
ROOT_SK = "kvgw-bench-root-secret"
BUCKET = "trace"


@dataclass
class Stats:
    hit_tokens: int = 0
    total_tokens: int = 0
    get_latencies: list[float] = field(default_factory=list)
    put_latencies: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def block_bytes(req: TraceRequest, pos: int, full: int) -> int:
    """Bytes of block ``pos`` of ``req`` when a full block is ``full`` bytes: in proportion to its tokens
    (``TraceRequest.tokens_at``), at least one byte."""
    return max(1, full * req.tokens_at(pos) // req.block_tokens)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def trace_gateway(args: argparse.Namespace, capacity_blocks: int) -> Iterator[str]:
    """A kvgw process for the replay (its own data dir, the bucket sized to ``capacity_blocks``,
    optional moto S3); its URL. Stopped and removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="kvgw-trace-", dir=args.data_dir))
    # the trace runs --time-scale times faster: so do the gateway's clocks that decide what eviction
    # sees (a read is recorded in the index 1 s late by default: 200 s of trace time at 200x)
    env = {"KVGW_ROOT_ACCESS_KEY": ROOT_AK, "KVGW_ROOT_SECRET_KEY": ROOT_SK, "KVGW_LIFECYCLE_INTERVAL": "0.05",
           "KVGW_LIFECYCLE_BUDGET": "4096", "KVGW_FSYNC": "false",
           "KVGW_INDEX_TOUCH_SECONDS": f"{1.0 / args.time_scale:g}"}
    try:
        with contextlib.ExitStack() as stack:
            if args.s3:
                s3_port, _ = stack.enter_context(moto_server(work / "moto.log"))
                env.update(KVGW_S3__ENDPOINT_URL=f"http://127.0.0.1:{s3_port}", KVGW_S3__BUCKET="kvgw-trace",
                           KVGW_S3__ACCESS_KEY="testing", KVGW_S3__SECRET_KEY="testing",
                           KVGW_S3__CREATE_BUCKET="true", KVGW_S3__ADDRESSING_STYLE="path")
            server = stack.enter_context(KvgwProcess(work / "data", env=env, log_path=work / "kvgw.log"))
            # after the start: only ``kvgw serve`` makes a data directory; the gateway's catalog refresh
            # (or the first request naming it) then finds the bucket
            subprocess.run([sys.executable, "-m", "gateway.cli", "bucket", "create", BUCKET,
                            "--data-dir", str(server.data_dir),
                            "--capacity-bytes", str(capacity_blocks * args.block_bytes),
                            "--eviction-policy", args.policy, "--high-watermark", "1.0", "--low-watermark", "0.98"],
                           env=server.environment(), check=True, stdout=subprocess.DEVNULL)
            yield server.url
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _replay_one(client: httpx.AsyncClient, req: TraceRequest, capacity_blocks: int, trace: str,
                      payload: bytes, stats: Stats, hints: bool) -> None:
    keys = [f"{trace}@{h}" for h in req.hash_ids]
    base = f"/v1/buckets/{BUCKET}"
    try:
        looked = await client.post(f"{base}/prefix", json={"keys": keys})
        if looked.status_code != 200:
            stats.error(f"prefix {looked.status_code} {looked.text[:120]}")
            return
        hits = looked.json()["length"]
        if hits:
            started = time.perf_counter()
            response = await client.post(f"{base}/batch-get", json={"keys": keys[:hits]})
            elapsed = time.perf_counter() - started
            frames = list(wire.BatchParser().feed(response.content))
            got = sum(1 for f in frames if f.ok)
            hits = next((i for i, f in enumerate(frames) if not f.ok), got)  # evicted meanwhile: a miss
            stats.get_latencies.extend([elapsed / max(len(frames), 1)] * len(frames))
        blocks = len(keys)
        stats.total_tokens += req.input_length
        stats.hit_tokens += min(hits, blocks - 1) * BLOCK_TOKENS + (req.last_block_tokens if hits == blocks else 0)
        for i in range(hits, min(blocks, capacity_blocks)):
            headers = {wire.H_PARENT: quote(keys[i - 1], safe="")} if i else {}
            started = time.perf_counter()
            body = payload[: block_bytes(req, i, len(payload))]
            r = await client.put(f"{base}/chunks/{quote(keys[i], safe='')}", content=body, headers=headers)
            stats.put_latencies.append(time.perf_counter() - started)
            if r.status_code not in (200, 201):
                stats.error(f"PUT {r.status_code} {r.text[:80]}")
        if hints and req.last:  # what an engine sends when the conversation closes
            r = await client.post(f"{base}/hints", json={"hint": Hint.SESSION_ENDED.value, "keys": keys})
            if r.status_code != 200:
                stats.error(f"hints {r.status_code} {r.text[:80]}")
    except httpx.HTTPError as exc:
        stats.error(type(exc).__name__)


async def replay(url: str, requests: list[TraceRequest], args: argparse.Namespace, capacity_blocks: int) -> Stats:
    stats = Stats()
    payload = os.urandom(args.block_bytes)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    slots = asyncio.Semaphore(args.concurrency)
    trace = args.trace.stem
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60,
                                 headers={"Authorization": f"Bearer {ROOT_AK}:{ROOT_SK}"}) as client:
        start = time.monotonic()
        t0 = requests[0].timestamp if requests else 0.0
        tasks = []
        for req in requests:
            delay = (req.timestamp - t0) / args.time_scale - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            task = asyncio.create_task(_replay_one(client, req, capacity_blocks, trace, payload, stats, args.hints))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        await asyncio.gather(*tasks)
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench trace --mode online",
                                description="Replay a Mooncake trace against a kvgw process.")
    p.add_argument("--mode", choices=["online"], default="online")
    p.add_argument("--trace", required=True, type=Path)
    p.add_argument("--policy", default="default")
    p.add_argument("--capacity-tokens", required=True, type=int)
    p.add_argument("--max-requests", type=int, default=3000, help="replay the first N requests")
    p.add_argument("--block-bytes", type=int, default=4096, help="chunk bytes per 512-token block")
    p.add_argument("--time-scale", type=float, default=200.0, help="replay this many times faster")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--s3", action="store_true", help="demote evicted chunks to a moto S3 server")
    p.add_argument("--hints", action="store_true",
                   help="send session-ended after each conversation's last request (conversation_ends)")
    p.add_argument("--data-dir", type=Path, default=None, help="where the gateway's temp data dir goes")
    p.add_argument("--json", type=Path, metavar="OUT")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    requests = load_trace(args.trace)
    if args.hints:  # ends judged on the whole trace: a conversation continued after the replayed part goes on
        requests = conversation_ends(requests)
    requests = requests[: args.max_requests]
    capacity_blocks = args.capacity_tokens // BLOCK_TOKENS
    with trace_gateway(args, capacity_blocks) as url:
        started = time.monotonic()
        stats = asyncio.run(replay(url, requests, args, capacity_blocks))
        wall = time.monotonic() - started
        moved = httpx.get(f"{url}/v1/admin/stats", headers={"Authorization": f"Bearer {ROOT_AK}:{ROOT_SK}"}).json()
    sim = simulate_named(requests, args.policy, capacity_blocks, hints=args.hints).hit_rate
    online = stats.hit_tokens / stats.total_tokens if stats.total_tokens else 0.0
    result = {
        "trace": args.trace.name, "policy": args.policy, "capacity_tokens": args.capacity_tokens,
        "hints": args.hints,
        "requests": len(requests), "hit_rate": online, "sim_hit_rate_same_requests": sim,
        "get_p50_ms": 1000 * _percentile(stats.get_latencies, 0.5),
        "get_p99_ms": 1000 * _percentile(stats.get_latencies, 0.99),
        "put_p50_ms": 1000 * _percentile(stats.put_latencies, 0.5),
        "put_p99_ms": 1000 * _percentile(stats.put_latencies, 0.99),
        "moved_bytes": moved.get("moved_bytes", {}), "lifecycle": moved.get("lifecycle", {}),
        "errors": stats.errors, "error_kinds": stats.error_kinds, "wall_seconds": round(wall, 1),
    }
    print(f"trace {args.trace.name}: first {len(requests)} requests, policy {args.policy}, "
          f"capacity {args.capacity_tokens} tokens ({capacity_blocks} blocks x {args.block_bytes} B)"
          f"{', session-ended hints' if args.hints else ''}")
    print(f"  token-weighted prefix hit rate  online {online:.4f}   simulator (same requests) {sim:.4f}")
    print(f"  GET per chunk p50 {result['get_p50_ms']:.2f} ms  p99 {result['get_p99_ms']:.2f} ms   "
          f"PUT p50 {result['put_p50_ms']:.2f} ms  p99 {result['put_p99_ms']:.2f} ms")
    print(f"  bytes moved between tiers {result['moved_bytes']}   lifecycle {result['lifecycle']}")
    print(f"  errors {stats.errors} {stats.error_kinds or ''}   wall {wall:.1f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if stats.errors == 0 else 1
