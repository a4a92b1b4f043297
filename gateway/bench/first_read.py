"""``kvgw bench first-read``: what direct writes (``KVGW_FS_DIRECT_WRITES``) cost a chunk's first read,
with the access pattern inference engines produce (issue 31, item 3).

A multi-round chat stores its prefix's KV chunks, then reads them back when the next turn arrives,
seconds to minutes later, often from another process or host than the one that wrote them. Direct
writes make the PUT cheap on these VMs (no fresh page-cache page to fault in) but leave nothing in the
page cache, so that first read comes from the disk; buffered writes leave the chunk in memory, which
the first read then finds unless memory pressure or another host's page cache is what it reads from.

Two gateways on the same disk, fsync on both: ``buffered`` (kvgw's defaults) and ``direct``
(``KVGW_FS_DIRECT_WRITES=true``). In each round, for each gateway in turn (order alternating):

1. **PUT**: ``--chunks`` new chunks of ``--chunk-mib`` MiB, twice (sets A and B), from one load-generator
   client (PUT only: the chunks are kept for the reads), timed: MB/s, p50, the gateway's CPU per GiB;
2. ``--delay`` seconds of nothing (the gap between two turns of a chat);
3. **first read, as written**: set A read back through kvgw's own client (``KvgwClient.blocking.
   batch_get_into`` preallocated buffers, ``--batch`` chunks per call, every frame's xxh3 checked by the
   client, so the gateway sends the files by ``sendfile``) from a fresh process that wrote nothing;
   the share of A's pages the page cache held just before (``mincore``) is reported beside it;
4. **second read**: set A again, from another fresh process (what every later turn reads);
5. **first read, evicted**: set B after its files' page-cache pages were written back and dropped
   (``posix_fadvise(DONTNEED)`` on those files only: nothing else on the machine loses its cache): a
   chunk read from the disk, as a gateway whose memory went to other chunks, or a host reading another
   host's chunks from shared storage, reads it.

Then every chunk is deleted. Each figure is the median over rounds; the ratios (direct / buffered) are
medians of per-round ratios. Read phases report the batch's p50 (the load an engine waits for), MB/s
over the phase and the gateway's CPU per GiB over the reader process's life (every gateway thread's,
from ``schedstat`` in nanoseconds: a phase moves a few hundred MB, too little for clock ticks).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.io import BUCKET, DIRECT_WRITES, chunk_target, kvgw_server
from gateway.bench.launcher import KvgwProcess, drop_page_cache, files_under
from gateway.bench.loadgen import LoadRequest, run_load
from gateway.bench.procstat import task_cpu_seconds

MiB = 1 << 20
GiB = 1 << 30
BUFFERED = "buffered"
DIRECT = "direct"
PUT = "PUT"
FIRST = "first read, as written"
SECOND = "second read"
EVICTED = "first read, evicted"
PHASES = (PUT, FIRST, SECOND, EVICTED)


@dataclass
class Phase:
    """One phase of one gateway in one round."""

    gateway: str
    phase: str
    round: int
    bytes: int
    seconds: float
    p50_s: float
    server_cpu_s: float
    resident: float | None = None  # share of the chunks' pages in the page cache just before a read
    errors: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def cpu_per_gib(self) -> float:
        return self.server_cpu_s / (self.bytes / GiB) if self.bytes else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "mb_per_s": self.mb_per_s, "cpu_per_gib": self.cpu_per_gib}


@dataclass
class Gateway:
    name: str
    process: KvgwProcess
    data_dir: Path
    payload: bytearray
    phases: list[Phase] = field(default_factory=list)

    def chunk_files(self) -> set[Path]:
        return set(files_under(self.data_dir / "fs" / "chunks"))


# -- the page cache ----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def resident_share(paths: Sequence[Path]) -> float:
    """The share of ``paths``' pages the page cache holds (``mincore`` on private mappings, which read
    nothing in by themselves)."""
    held = total = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
            if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            del address  # the buffer export ends before the mapping closes
            held += sum(v & 1 for v in vector)
            total += pages
    return held / total if total else 0.0


# -- the reader process ------------------------------------------------------------------------------

def read_keys(url: str, keys: Sequence[str], batch: int, chunk_bytes: int) -> dict[str, Any]:
    """Read ``keys`` through kvgw's client, ``batch`` per ``batch_get_into``, into preallocated buffers;
    the client's connection is opened (a ping) before the clock starts. Every item must be OK."""
    from kvgw_client.config import ClientSettings
    from kvgw_client.framing import ItemStatus
    from kvgw_client.http import KvgwClient

    client = KvgwClient(ClientSettings(url=url, bucket=BUCKET))
    try:
        client.blocking.ping()
        buffers = [memoryview(bytearray(chunk_bytes)) for _ in range(batch)]
        latencies: list[float] = []
        moved = 0
        errors: list[str] = []
        started = time.perf_counter()
        for at in range(0, len(keys), batch):
            part = keys[at : at + batch]
            began = time.perf_counter()
            statuses = client.blocking.batch_get_into(part, lambda i, n: buffers[i][:n])
            latencies.append(time.perf_counter() - began)
            bad = [f"{k}: {s}" for k, s in zip(part, statuses, strict=True) if s != ItemStatus.OK]
            errors += bad
            moved += chunk_bytes * (len(part) - len(bad))
        return {"latencies": latencies, "bytes": moved, "seconds": time.perf_counter() - started,
                "errors": errors}
    finally:
        client.close()


def read_in_fresh_process(gateway: Gateway, keys: Sequence[str], batch: int,
                          chunk_bytes: int) -> tuple[dict[str, Any], float]:
    """``read_keys`` in a new Python process (one that wrote none of these chunks); its answer and the
    gateway's CPU seconds over the process's life."""
    cpu0 = task_cpu_seconds(gateway.process.pids())
    done = subprocess.run(
        [sys.executable, "-m", "gateway.bench.first_read", "--read-from", gateway.process.url, "--batch", str(batch),
         "--chunk-mib", str(chunk_bytes // MiB), *keys],
        capture_output=True, text=True, check=False, timeout=600)
    cpu = task_cpu_seconds(gateway.process.pids()) - cpu0
    if done.returncode != 0:
        raise RuntimeError(f"reader failed ({done.returncode}): {done.stderr[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer, cpu


# -- one round ---------------------------------------------------------------------------------------

def put_set(gateway: Gateway, keys: Sequence[str], rnd: int) -> Phase:
    payload = gateway.payload
    reqs = [LoadRequest("PUT", chunk_target(k), body=payload, expect=(201,)) for k in keys]
    cpu0 = task_cpu_seconds(gateway.process.pids())
    stats = run_load(gateway.process.address, lambda i, seq: reqs[seq], 1, count=len(reqs))
    cpu = task_cpu_seconds(gateway.process.pids()) - cpu0
    return Phase(gateway.name, PUT, rnd, stats.bytes, stats.elapsed, stats.percentile(0.5), cpu, errors=stats.errors)


def read_phase(gateway: Gateway, name: str, keys: Sequence[str], files: Sequence[Path], rnd: int,
               args: argparse.Namespace) -> Phase:
    resident = resident_share(files)
    answer, cpu = read_in_fresh_process(gateway, keys, args.batch, args.chunk_mib * MiB)
    return Phase(gateway.name, name, rnd, answer["bytes"], answer["seconds"],
                 statistics.median(answer["latencies"]) if answer["latencies"] else float("nan"), cpu, resident,
                 len(answer["errors"]))


def run_round(gateway: Gateway, rnd: int, args: argparse.Namespace, tag: str) -> None:
    keys = {s: [f"fr-{tag}-{gateway.name}-{rnd}-{s}-{i:03d}" for i in range(args.chunks)] for s in "AB"}
    before = gateway.chunk_files()
    puts = [put_set(gateway, keys["A"], rnd)]
    files_a = sorted(gateway.chunk_files() - before)
    puts.append(put_set(gateway, keys["B"], rnd))
    files_b = sorted(gateway.chunk_files() - before - set(files_a))
    both = puts[0]
    gateway.phases.append(Phase(gateway.name, PUT, rnd, both.bytes + puts[1].bytes, both.seconds + puts[1].seconds,
                                statistics.median([both.p50_s, puts[1].p50_s]),
                                both.server_cpu_s + puts[1].server_cpu_s, errors=both.errors + puts[1].errors))
    time.sleep(args.delay)
    gateway.phases.append(read_phase(gateway, FIRST, keys["A"], files_a, rnd, args))
    gateway.phases.append(read_phase(gateway, SECOND, keys["A"], files_a, rnd, args))
    drop_page_cache(files_b)
    gateway.phases.append(read_phase(gateway, EVICTED, keys["B"], files_b, rnd, args))
    deletes = [LoadRequest("DELETE", chunk_target(k), expect=(204, 404)) for k in keys["A"] + keys["B"]]
    run_load(gateway.process.address, lambda i, seq: deletes[seq], 2, count=len(deletes))


# -- the report --------------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(gateways: Sequence[Gateway]) -> str:
    lines = ["| gateway | phase | MB/s | p50 ms (PUT: per chunk; reads: per batch-get) | gateway CPU s/GiB "
             "| in the page cache before |", "|---|---|---|---|---|---|"]
    for gw in gateways:
        for name in PHASES:
            got = [p for p in gw.phases if p.phase == name]
            if not got:
                continue
            held = [p.resident for p in got if p.resident is not None]
            errors = sum(p.errors for p in got)
            lines.append(f"| {gw.name} | {name} | {median([p.mb_per_s for p in got]):.0f}"
                         f"{f' ({errors} errors!)' if errors else ''} | {median([p.p50_s for p in got]) * 1e3:.1f} "
                         f"| {median([p.cpu_per_gib for p in got]):.3f} "
                         f"| {f'{median(held) * 100:.0f}%' if held else '-'} |")
    by = {(p.gateway, p.phase, p.round): p for gw in gateways for p in gw.phases}
    lines += ["", "direct / buffered (median of per-round ratios):", "",
              "| phase | MB/s | p50 | gateway CPU per GiB |", "|---|---|---|---|"]
    rounds = sorted({p.round for gw in gateways for p in gw.phases})
    for name in PHASES:
        pairs = [(by[(DIRECT, name, r)], by[(BUFFERED, name, r)]) for r in rounds
                 if (DIRECT, name, r) in by and (BUFFERED, name, r) in by]
        if not pairs:
            continue

        def ratio(value: Callable[[Phase], float], pairs: list[tuple[Phase, Phase]] = pairs) -> str:
            got = [value(d) / value(b) for d, b in pairs if value(b)]
            return f"{median(got):.2f}" if got else "-"

        lines.append(f"| {name} | {ratio(lambda p: p.mb_per_s)} | {ratio(lambda p: p.p50_s)} "
                     f"| {ratio(lambda p: p.cpu_per_gib)} |")
    return "\n".join(lines)


# -- entry point -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="kvgw bench first-read",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--chunks", type=int, default=32, help="chunks per set (two sets per gateway and round; default 32)")
    p.add_argument("--chunk-mib", type=int, default=8, help="chunk size in MiB (default 8)")
    p.add_argument("--batch", type=int, default=16, help="chunks per batch-get when reading back (default 16)")
    p.add_argument("--delay", type=float, default=5.0, help="seconds between the PUTs and the first read (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported (default 3)")
    p.add_argument("--data-dir", type=Path, default=Path("."), help="where the gateways' data go (the disk measured)")
    p.add_argument("--json", type=Path, help="write every phase of every round here")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 chunks, 1 round, no delay")
    p.add_argument("--read-from", metavar="URL", help=argparse.SUPPRESS)  # the reader process
    p.add_argument("keys", nargs="*", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.read_from:
        print(json.dumps(read_keys(args.read_from, args.keys, args.batch, args.chunk_mib * MiB)))
        return 0
    if args.quick:
        args.chunks, args.rounds, args.delay = 4, 1, 0.0
    if args.chunks < 1 or args.rounds < 1 or args.batch < 1 or args.chunk_mib < 1 or args.delay < 0:
        print("kvgw bench first-read: need chunks, rounds, batch, chunk-mib >= 1 and delay >= 0", file=sys.stderr)
        return 2
    args.data_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    load = os.getloadavg()
    tag = os.urandom(3).hex()
    with tempfile.TemporaryDirectory(prefix="kvgw-bench-first-read-", dir=args.data_dir) as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        payload = bytearray(os.urandom(args.chunk_mib * MiB))
        gateways = []
        for name, env in ((BUFFERED, {}), (DIRECT, DIRECT_WRITES)):
            process = kvgw_server(work / name, env=env).start()
            stack.callback(process.stop)
            gateways.append(Gateway(name, process, work / name, payload))
        print(f"kvgw bench first-read, {started:%Y-%m-%d %H:%M} UTC: {args.rounds} rounds, 2 x {args.chunks} chunks "
              f"of {args.chunk_mib} MiB per gateway and round, read back {args.batch} per batch-get after "
              f"{args.delay:g} s, fsync on, {os.cpu_count()} cores, load {load[0]:.2f}, data in {work}", flush=True)
        for rnd in range(args.rounds):
            for gw in gateways if rnd % 2 == 0 else gateways[::-1]:
                run_round(gw, rnd, args, tag)
            print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    text = report(gateways)
    print()
    print(text)
    print(f"\nload average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "kvgw bench first-read " + " ".join(argv), "started": started.isoformat(),
            "loadavg_before": load, "loadavg_after": os.getloadavg(),
            "config": {k: v for k, v in vars(args).items() if k not in ("keys", "read_from", "json", "data_dir")},
            "phases": [p.as_dict() for gw in gateways for p in gw.phases]}, indent=1) + "\n")
    return 1 if any(p.errors for gw in gateways for p in gw.phases) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
