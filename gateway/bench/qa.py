"""``kvgw bench qa``: what a shared kvgw tier saves in time to first token, end to end, without a GPU.

LMCache's multi-round QA workload (``gateway.bench.qa_workload``: users x rounds over a shared system
prompt, each round's prompt its user's history so far) is replayed through the engines' real client
paths against a live ``kvgw serve`` whose bucket has a capacity, by two client processes standing for
two engine instances that share the tier (requests go to them round-robin, so a user's next round
usually lands on the other instance, which finds its history only in kvgw):

* ``lmcache``: LMCache's own ``StorageManager`` with kvgw's connector as its remote backend
  (``gateway.bench.lmcache_engine.Worker``), keys from LMCache's ``ChunkedTokenDatabase`` over the
  prompt's tokens (256-token chunks): lookup (``batched_contains``), load of the hits
  (``batched_get``), store of the rest (``batched_put``). A session's last round carries
  ``lmcache.kvgw.session_end`` (``--hints``).
* ``sglang``: kvgw's HiCache backend attached through SGLang's factory, driven by the cache
  controller's storage loops (``gateway.bench.sglang_engine``): page hashes from SGLang's native hash,
  ``batch_exists`` per batch, ``batch_get_v1`` into a host pool, ``batch_set_v1`` of the new pages
  (``shared_prefix_tokens`` = the system prompt, ``--hints``).

Requests run one at a time in the workload's order (``--in-flight`` more may overlap), as fast as they
go (the workload's clock only orders them). Per request the bench **measures** the lookup and the load
of the hits (wall time in the client process, connection reuse and all) and **models** the prefill of
the missed tokens: ``missed / prefill_rate``. Time to first token (modelled) = lookup + load +
missed / prefill_rate, beside the same prompt with no shared tier: ``prompt / prefill_rate`` (every
token prefilled; the engines' own GPU prefix caches are not modelled in either). ``prefill_rate``
defaults to Llama-3-70B in BF16 on 4 H100 SXM (tensor parallel) at 50% of their dense BF16 peak:
2 x 70.6e9 FLOP per token (attention left out: it only makes long prompts dearer, reuse worth more)
against 4 x 989e12 x 0.5 FLOP/s, about 14,000 tokens/s; every input is printed with the result.

Stored chunks are smaller than the model's (``--chunk-mib`` per 256 tokens, 4 KiB/token by default,
against Llama-3-70B's 320 KiB): the loads measured here are of those bytes. The Pliops effective
acceleration ``e = T / R`` (T: prefill time per token, R: load time per token) is printed for the bytes
measured and, modelled, for the model's bytes at the load throughput measured (load time taken as
proportional to bytes).

Beside it, the trace simulator (``gateway.bench.trace_sim``) replays the same requests at the same
granularity through the same policy at the tier's two watermarks: the live hit rate should lie within
about a point of that band.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gateway.bench.launcher import KvgwProcess, work_directory
from gateway.bench.qa_workload import QAParams, QARequest, describe, generate

ACCESS_KEY = "KVBENCHQAACCESSKEY00"
SECRET_KEY = "kvgw-bench-qa-secret-key-0123456789abcd"
BUCKET = "qa-bench"
LMCACHE_CHUNK = 256  # LMCache's default chunk (tokens)
SGLANG_PAGE = 64  # tokens per SGLang page here
SGLANG_LAYERS, SGLANG_HEADS, SGLANG_HEAD_DIM = 4, 4, 64  # K and V in BF16: 4 KiB per token, as LMCache's 1 MiB chunk
SGLANG_BYTES_PER_TOKEN = 2 * SGLANG_LAYERS * SGLANG_HEADS * SGLANG_HEAD_DIM * 2
H100_BF16_DENSE = 989e12  # FLOP/s, H100 SXM, dense BF16 (NVIDIA's data sheet)
LLAMA3_70B_PARAMS = 70.6e9
LLAMA3_70B_KV_BYTES = 80 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x BF16 = 327,680 B/token
ENGINES = ("lmcache", "sglang")


@dataclass(frozen=True)
class Model:
    """What the modelled part of time to first token stands on."""

    name: str = "Llama-3-70B, BF16, 4x H100 SXM (TP4), 50% of dense BF16 peak"
    params: float = LLAMA3_70B_PARAMS
    gpus: int = 4
    flops_per_gpu: float = H100_BF16_DENSE
    utilisation: float = 0.5
    kv_bytes_per_token: int = LLAMA3_70B_KV_BYTES
    prefill_tokens_per_s: float | None = None  # given: overrides the formula

    @property
    def rate(self) -> float:
        if self.prefill_tokens_per_s is not None:
            return self.prefill_tokens_per_s
        return self.gpus * self.flops_per_gpu * self.utilisation / (2 * self.params)

    def describe(self) -> str:
        if self.prefill_tokens_per_s is not None:
            return f"prefill rate {self.rate:,.0f} tokens/s (given)"
        return (f"prefill rate = gpus x FLOP/s x utilisation / (2 x params) = {self.gpus} x {self.flops_per_gpu:.3g} x "
                f"{self.utilisation} / (2 x {self.params:.3g}) = {self.rate:,.0f} tokens/s ({self.name}; attention "
                f"FLOPs left out)")


@dataclass
class Record:
    """One request as an instance served it."""

    index: int
    user: int
    round: int
    instance: int
    prompt_tokens: int
    hit_tokens: int
    lookup_s: float  # measured
    load_s: float  # measured
    loaded_bytes: int
    stored_chunks: int


# -- the instances (client processes) ------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceJob:
    engine: str
    instance: int
    url: str
    params: QAParams
    chunk_mib: int
    hints: bool
    in_flight: int
    out: str


def _wait_turn(done: Any, cond: Any, index: int, in_flight: int) -> None:
    """Block until every request more than ``in_flight`` - 1 places before ``index`` is done."""
    with cond:
        while not all(done[j] for j in range(max(0, index - in_flight + 1))):
            cond.wait(1.0)


def _finished(done: Any, cond: Any, index: int) -> None:
    with cond:
        done[index] = 1
        cond.notify_all()


def run_instance(job: InstanceJob, done: Any, cond: Any) -> None:
    """One engine instance: its share of the requests, in order, each after the ones before it."""
    import logging

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    requests = generate(job.params)
    mine = [(i, r) for i, r in enumerate(requests) if r.instance == job.instance]
    runner = _LMCacheInstance(job) if job.engine == "lmcache" else _SGLangInstance(job)
    records: list[Record] = []
    try:
        for n, (index, req) in enumerate(mine):
            try:
                _wait_turn(done, cond, index, job.in_flight)
                records.append(runner.serve(index, req))
            except BaseException:
                for later, _ in mine[n:]:  # the other instance must not wait for them
                    _finished(done, cond, later)
                raise
            _finished(done, cond, index)
        counters = runner.counters()
    finally:
        runner.close()
    Path(job.out).write_text(json.dumps({"records": [asdict(r) for r in records], "counters": counters}))


class _LMCacheInstance:
    def __init__(self, job: InstanceJob) -> None:
        from lmcache.v1.token_database import ChunkedTokenDatabase

        from gateway.bench import lmcache_engine as le

        self.le = le
        self.job = job
        extra = le.kvgw_plugin_extra(job.url, bucket=BUCKET, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                                     prefetch_bytes=0)
        chunks = -(-(job.params.system_tokens + job.params.history_tokens + job.params.rounds *
                     (job.params.question_tokens + job.params.answer_tokens)) // LMCACHE_CHUNK)
        config = le.engine_config(cpu_gb=le.cpu_pool_gb(job.chunk_mib, chunks), extra=extra,
                                  remote_storage_plugins=[le.KVGW_PLUGIN])
        self.worker = le.Worker(config, le.make_metadata(job.chunk_mib))
        self.tokens_db = ChunkedTokenDatabase(config, self.worker.metadata)
        self.chunk_bytes = job.chunk_mib << 20

    def _outcomes(self) -> int:
        c = self._counts()
        return sum(int(c.get(k, 0)) for k in ("put.stored", "put.existed", "put.declined", "lmcache.put_failed"))

    def _counts(self) -> dict[str, Any]:
        conn = self.worker.backend(self.le.REMOTE_KVGW).connection.getWrappedConnector()
        counts: dict[str, Any] = conn.stats()["counters"]
        return counts

    def serve(self, index: int, req: QARequest) -> Record:
        configs = {"lmcache.kvgw.session_end": True} if self.job.hints and req.last else {}
        keys = [key for start, end, key in self.tokens_db.process_tokens(req.tokens(), request_configs=configs)
                if end - start == LMCACHE_CHUNK]  # LMCache stores no partial last chunk by default
        started = time.perf_counter()
        hits = self.worker.lookup(keys)
        looked = time.perf_counter()
        objs = self.worker.retrieve(keys[:hits]) if hits else []
        loaded = time.perf_counter()
        hits = len(objs)
        self.le.release(objs)
        new = keys[hits:]
        if new:
            before = self._outcomes()
            self.worker.store(new, self.worker.allocate(len(new)))
            deadline = time.monotonic() + 120
            while self._outcomes() < before + len(new):  # every write answered (stored or declined)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"request {index}: writes unanswered after 120 s")
                time.sleep(0.001)
        return Record(index, req.user, req.round, req.instance, req.input_length, hits * LMCACHE_CHUNK,
                      looked - started, loaded - looked, hits * self.chunk_bytes, len(new))

    def counters(self) -> dict[str, Any]:
        return dict(self._counts())

    def close(self) -> None:
        self.worker.close()


class _SGLangInstance:
    def __init__(self, job: InstanceJob) -> None:
        from gateway.bench import sglang_engine as se

        self.se = se
        self.job = job
        longest = job.params.system_tokens + job.params.history_tokens + job.params.rounds * (
            job.params.question_tokens + job.params.answer_tokens)
        pages = 2 * (longest // SGLANG_PAGE + 1)
        self.pool = se.MHAHostPool("page_first", page_size=SGLANG_PAGE, pages=pages, layer_num=SGLANG_LAYERS,
                                   head_num=SGLANG_HEADS, head_dim=SGLANG_HEAD_DIM)
        extra = {"backend_name": "kvgw", "module_path": "kvgw_client.sglang", "class_name": "KvgwHiCacheStorage",
                 "interface_v1": 1, "url": job.url, "bucket": BUCKET, "access_key": ACCESS_KEY,
                 "secret_key": SECRET_KEY}
        if job.hints:
            extra["shared_prefix_tokens"] = job.params.system_tokens
        config = se.storage_config(extra=extra, model="bench/QA-70B", page_first=True)
        self.backend = se.attach("dynamic", config, self.pool)

    def serve(self, index: int, req: QARequest) -> Record:
        se, pool = self.se, self.pool
        hashes = se.page_hashes(req.tokens(), SGLANG_PAGE)  # full pages only
        started = time.perf_counter()
        hits = se.hit_query(self.backend, hashes, prefix_keys=[])
        looked = time.perf_counter()
        loaded_pages = 0
        if hits:
            target = self._alloc(hits)
            loaded_pages = se.transfer(self.backend, pool, hashes[:hits], target, prefix_keys=[])
            pool.free(target)
        loaded = time.perf_counter()
        new = hashes[loaded_pages:]
        if new:
            source = self._alloc(len(new))
            se.backup(self.backend, pool, new, source, prefix_keys=hashes[:loaded_pages])
            pool.free(source)
        return Record(index, req.user, req.round, req.instance, req.input_length, loaded_pages * SGLANG_PAGE,
                      looked - started, loaded - looked, loaded_pages * pool.page_bytes, len(new))

    def _alloc(self, pages: int) -> Any:
        indices = self.pool.alloc(pages * SGLANG_PAGE)
        if indices is None:
            raise MemoryError(f"the host pool cannot hold {pages} pages")
        return indices

    def counters(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.backend.stats()
        return {**stats["counters"], **{f"hicache.{k}": v for k, v in stats["hicache"].items()}}

    def close(self) -> None:
        self.backend.close()


# -- one run: a gateway, two instances ------------------------------------------------------------------


@dataclass
class EngineRun:
    engine: str
    records: list[Record]
    counters: list[dict[str, Any]]
    tier: dict[str, Any]  # the bucket's usage and the admission counts, from the gateway's stats
    chunk_tokens: int
    stored_bytes_per_token: float
    seconds: float


@contextlib.contextmanager
def gateway(workdir: Path, engine: str, capacity: int, policy: str) -> Iterator[KvgwProcess]:
    env = {"KVGW_ROOT_ACCESS_KEY": ACCESS_KEY, "KVGW_ROOT_SECRET_KEY": SECRET_KEY,
           "KVGW_LIFECYCLE_INTERVAL": "0.05", "KVGW_WORKERS": "1"}
    data = workdir / f"{engine}-data"
    shutil.rmtree(data, ignore_errors=True)  # every run starts from an empty tier
    server = KvgwProcess(data, extra_args=["--no-fsync"], env=env, inherit_kvgw_env=False,
                         log_path=workdir / f"{engine}-kvgw.log")
    with server:
        # leases may cover the whole tier (the default cap, a tenth of the capacity, is for tiers far larger
        # than one prompt): the engines lease what they look up until they load it
        made = subprocess.run([sys.executable, "-m", "gateway.cli", "bucket", "create", BUCKET, "--capacity-bytes",
                               str(capacity), "--max-leased-bytes", str(capacity), "--eviction-policy", policy,
                               "--data-dir", str(data)],
                              env={**server.environment(), **env}, capture_output=True, text=True, timeout=120)
        if made.returncode != 0:
            raise RuntimeError(f"bucket create failed: {made.stderr}")
        yield server


def tier_stats(server: KvgwProcess) -> dict[str, Any]:
    import httpx

    doc = httpx.get(f"{server.url}/v1/admin/stats", headers={"Authorization": f"Bearer {ACCESS_KEY}:{SECRET_KEY}"},
                    timeout=10).json()
    return {"usage": doc["usage"].get(BUCKET, {}), "admission": doc.get("admission", {}).get(BUCKET, {}),
            "evicted": doc["lifecycle"].get("evicted", 0), "policies": doc.get("lifecycle_policies", {}).get(BUCKET)}


def run_engine(engine: str, args: argparse.Namespace, params: QAParams, workdir: Path, capacity: int) -> EngineRun:
    os.environ["PYTHONHASHSEED"] = "0"  # LMCache's chunk hashes use hash(): the instances must agree
    ctx = mp.get_context("spawn")
    n = len(generate(params))
    done = ctx.Array("b", n)
    cond = ctx.Condition()
    started = time.perf_counter()
    with gateway(workdir, engine, capacity, args.policy) as server:
        jobs = [InstanceJob(engine, i, server.url, params, args.chunk_mib, args.hints, args.in_flight,
                            str(workdir / f"{engine}-instance{i}.json")) for i in range(params.instances)]
        procs = [ctx.Process(target=run_instance, args=(job, done, cond), name=f"qa-{engine}-{job.instance}")
                 for job in jobs]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise RuntimeError(f"an instance of {engine} failed (exit codes {[p.exitcode for p in procs]})")
        tier = tier_stats(server)
    seconds = time.perf_counter() - started
    records: list[Record] = []
    counters: list[dict[str, Any]] = []
    for job in jobs:
        doc = json.loads(Path(job.out).read_text())
        records += [Record(**r) for r in doc["records"]]
        counters.append(doc["counters"])
    records.sort(key=lambda r: r.index)
    chunk = LMCACHE_CHUNK if engine == "lmcache" else SGLANG_PAGE
    per_token = (args.chunk_mib << 20) / LMCACHE_CHUNK if engine == "lmcache" else float(SGLANG_BYTES_PER_TOKEN)
    return EngineRun(engine, records, counters, tier, chunk, per_token, seconds)


# -- what it shows ------------------------------------------------------------------------------------


def ttft(record: Record, model: Model) -> float:
    """Modelled time to first token: measured lookup and load, modelled prefill of the missed tokens."""
    return record.lookup_s + record.load_s + (record.prompt_tokens - record.hit_tokens) / model.rate


def no_tier_ttft(record: Record, model: Model) -> float:
    return record.prompt_tokens / model.rate


def by_round(records: Sequence[Record]) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for r in records:
        out.setdefault(r.round, []).append(r)
    return dict(sorted(out.items()))


def simulated(params: QAParams, chunk_tokens: int, capacity_chunks: float, policy: str, hints: bool) -> float:
    """The simulator's hit rate for the same requests, chunking and policy at ``capacity_chunks``, with
    the session-end hints LMCache's connector sends (``hints``)."""
    from gateway.bench import trace_sim

    requests = trace_sim.qa_requests(params, chunk_tokens)
    return trace_sim.simulate_named(requests, policy, int(capacity_chunks), hints=hints).hit_rate


def _row(label: str, group: Sequence[Record], model: Model) -> str:
    hit = sum(r.hit_tokens for r in group) / sum(r.prompt_tokens for r in group)
    ours = statistics.fmean(ttft(r, model) for r in group)
    base = statistics.fmean(no_tier_ttft(r, model) for r in group)
    lookup = statistics.fmean(r.lookup_s for r in group) * 1e3
    load = statistics.fmean(r.load_s for r in group) * 1e3
    return (f"{label:>5} {len(group):>5} {hit:>9.3f} {lookup:>10.2f} {load:>9.2f} {ours * 1e3:>13.1f} "
            f"{base * 1e3:>16.1f} {base / ours:>7.2f}x")


def hit_rate(records: Sequence[Record]) -> float:
    return sum(r.hit_tokens for r in records) / sum(r.prompt_tokens for r in records)


def _load_lines(run: EngineRun, model: Model) -> list[str]:
    """Load throughput, R and the effective acceleration e = T / R."""
    loaded = [r for r in run.records if r.hit_tokens]
    if not loaded:
        return ["load: nothing was loaded"]
    load_s = sum(r.load_s for r in loaded)
    load_bytes = sum(r.loaded_bytes for r in loaded)
    r_measured = load_s / sum(r.hit_tokens for r in loaded)
    r_model = load_s / load_bytes * model.kv_bytes_per_token
    t = 1.0 / model.rate
    return [f"load: {load_bytes / load_s / 1e9:.2f} GB/s (measured); R = {r_measured * 1e6:.2f} us/token at "
            f"{run.stored_bytes_per_token:,.0f} B/token (measured), {r_model * 1e6:.1f} us/token at "
            f"{model.kv_bytes_per_token:,} B/token (modelled at the measured GB/s); T = 1 / prefill rate = "
            f"{t * 1e6:.1f} us/token",
            f"Pliops effective acceleration e = T / R: {t / r_measured:.1f} (bytes stored here), {t / r_model:.2f} "
            f"(the model's bytes, modelled)"]


def _sim_line(run: EngineRun, params: QAParams, capacity: int, policy: str, hints: bool) -> str:
    usage = run.tier["usage"]
    chunks = usage.get("fs_chunks", 0)
    mean_chunk = usage.get("fs_bytes", 0) / chunks if chunks else run.stored_bytes_per_token * run.chunk_tokens
    session_end = hints and run.engine == "lmcache"  # (SGLang's backend sees no session end)
    low, high = (simulated(params, run.chunk_tokens, capacity * w / mean_chunk, policy, session_end)
                 for w in (0.8, 0.9))
    live = hit_rate(run.records)
    within = min(low, high) - 0.01 <= live <= max(low, high) + 0.01
    return (f"simulator, same requests and policy: hit rate {low:.3f} at the low watermark, {high:.3f} at the high "
            f"one; live {live:.3f} ({'within' if within else 'OUTSIDE'} 1 point of that band)")


def _tier_lines(run: EngineRun) -> list[str]:
    admission = run.tier["admission"]
    declined = {k: v for k, v in admission.items() if k != "admitted"}
    counters = run.counters
    total = {k: sum(int(c.get(k, 0)) for c in counters) for k in (
        "lmcache.session_end_hints", "hicache.set.shared", "put.declined", "lmcache.put_failed", "hicache.set.failed")}
    return [f"tier: {run.tier['evicted']} evicted; writes under pressure {admission or '-'}"
            f"{f' (declined {declined})' if declined else ''}; policy {run.tier['policies']}",
            f"clients: session-end hints {total['lmcache.session_end_hints']}, pages written shared "
            f"{total['hicache.set.shared']}, writes declined {total['put.declined']}, failed "
            f"{total['lmcache.put_failed'] + total['hicache.set.failed']}"]


def report(runs: Sequence[EngineRun], params: QAParams, model: Model, capacity: int, args: argparse.Namespace) -> str:
    lines = [f"kvgw bench qa: {describe(params)}",
             f"tier: bucket capacity {capacity / (1 << 20):.0f} MiB (watermarks 0.8-0.9), eviction policy "
             f"{args.policy}, hints {'on' if args.hints else 'off'}; {params.instances} client processes; "
             f"up to {args.in_flight} request(s) in flight",
             f"model: {model.describe()}; TTFT = lookup (measured) + load (measured) + missed tokens / prefill "
             f"rate (modelled); no shared tier: prompt tokens / prefill rate (modelled)"]
    for run in runs:
        lines += ["", f"-- {run.engine} ({run.chunk_tokens}-token chunks, {run.stored_bytes_per_token:,.0f} B/token "
                      f"stored; {len(run.records)} requests in {run.seconds:.1f} s)",
                  f"{'round':>5} {'reqs':>5} {'hit rate':>9} {'lookup ms':>10} {'load ms':>9} "
                  f"{'TTFT ms kvgw':>13} {'TTFT ms no tier':>16} {'speedup':>8}"]
        lines += [_row(str(rnd), group, model) for rnd, group in by_round(run.records).items()]
        lines.append(_row("all", run.records, model))
        lines += _load_lines(run, model)
        lines.append(_sim_line(run, params, capacity, args.policy, args.hints))
        lines += _tier_lines(run)
    return "\n".join(lines)


def plot(runs: Sequence[EngineRun], model: Model, out: Path) -> None:
    from gateway.bench.plots import _pyplot

    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.4), dpi=110, sharex=True)
    base_drawn = False
    for run in runs:
        rounds = by_round(run.records)
        xs = list(rounds)
        top.plot(xs, [statistics.fmean(ttft(r, model) for r in g) * 1e3 for g in rounds.values()], marker="o",
                 label=f"kvgw shared tier ({run.engine}): measured lookup + load, modelled prefill")
        bottom.plot(xs, [sum(r.hit_tokens for r in g) / sum(r.prompt_tokens for r in g) for g in rounds.values()],
                    marker="o", label=run.engine)
        if not base_drawn:
            top.plot(xs, [statistics.fmean(no_tier_ttft(r, model) for r in g) * 1e3 for g in rounds.values()], "--",
                     color="grey", label="no shared tier (modelled prefill of every token)")
            base_drawn = True
    top.set_ylabel("TTFT, ms (mean per round)")
    top.set_title(f"kvgw bench qa: multi-round QA, two engine instances sharing kvgw\n{model.name}")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_xlabel("round")
    bottom.set_ylabel("prefix hit rate (measured)")
    bottom.set_ylim(0, 1)
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def default_capacity(params: QAParams, chunk_mib: int, policy_fraction: float) -> int:
    """Bytes such that the tier's high watermark (0.9) holds what the simulator says exact LRU needs to
    reach ``policy_fraction`` of its uncapped hit rate on this workload (LMCache's chunking)."""
    from gateway.bench import trace_sim

    requests = trace_sim.qa_requests(params, LMCACHE_CHUNK)
    tokens = trace_sim.capacity_at_lru_fraction(requests, policy_fraction)
    return int(tokens / LMCACHE_CHUNK * (chunk_mib << 20) / 0.9)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgw bench qa", description="LMCache's multi-round QA workload through "
                                "LMCache's and SGLang's client paths against a live kvgw with a capacity, two "
                                "engine instances sharing it: hit rate, lookup and load times (measured), time to "
                                "first token (modelled prefill), beside no shared tier.", allow_abbrev=False)
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--qa-param", nargs="*", default=[], metavar="KEY=VALUE",
                   help="workload parameters (as kvgw bench trace --qa); defaults: users=6 rounds=8 total_users=12 "
                        "history_tokens=3000")
    p.add_argument("--capacity-mib", type=float, help="the bucket's capacity (default: where exact LRU reaches "
                   "--lru-fraction of its uncapped hit rate in the simulator, at the high watermark)")
    p.add_argument("--lru-fraction", type=float, default=0.5)
    p.add_argument("--policy", default="default", help="the bucket's eviction policy")
    p.add_argument("--no-hints", dest="hints", action="store_false", help="send no engine hints")
    p.add_argument("--chunk-mib", type=int, default=1, help="bytes stored per 256 tokens (LMCache's chunk)")
    p.add_argument("--in-flight", type=int, default=1, help="requests that may overlap (default 1: in order)")
    p.add_argument("--prefill-tokens-per-s", type=float, help="the modelled prefill rate (default: the formula)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="TTFT and hit rate per round")
    p.add_argument("--json", type=Path, metavar="OUT", help="every request's record")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--keep", action="store_true")
    return p.parse_args(argv)


BENCH_DEFAULTS = ("users=6", "rounds=8", "total_users=12", "history_tokens=3000")


def main(argv: Sequence[str]) -> int:
    from gateway.bench.trace_sim import qa_params

    args = parse_args(argv)
    params = qa_params([*BENCH_DEFAULTS, *args.qa_param])
    model = replace(Model(), prefill_tokens_per_s=args.prefill_tokens_per_s)
    capacity = (int(args.capacity_mib * (1 << 20)) if args.capacity_mib
                else default_capacity(params, args.chunk_mib, args.lru_fraction))
    runs: list[EngineRun] = []
    with work_directory(args, "kvgw-bench-qa-") as workdir:
        for engine in args.engines:
            print(f"kvgw bench qa: {engine} ...", file=sys.stderr, flush=True)
            runs.append(run_engine(engine, args, params, workdir, capacity))
    print(report(runs, params, model, capacity, args))
    if args.plot is not None:
        plot(runs, model, args.plot)
        print(f"plot written to {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({run.engine: [asdict(r) for r in run.records] for run in runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
