"""``kvgw bench io``'s issue-31 targets and report rows, from made-up samples (pure arithmetic and
formatting, no timings): GET and batch-get targets read the client-verified ``kvgw`` rows (sent with
``x-kvgw-verify``), never the server-verified ones; PUT targets read kvgw's CPU per GiB, the raw loop
and the receive-only sink; the report names every variant."""

from __future__ import annotations

import argparse

from gateway.bench import io
from gateway.bench.loadgen import Stats

GiB = 1 << 30
MB8 = 8 << 20


def sample(target: str, op: str, size: int, clients: int, rnd: int, *, mb_s: float, cpu_s_per_gib: float) -> io.Sample:
    stats = Stats(clients=clients, ops=10, bytes=GiB, elapsed=GiB / (mb_s * 1e6), window=GiB / (mb_s * 1e6))
    stats.window_bytes = float(GiB)
    stats.window_ops = 10.0
    stats.latencies = [0.01] * 10
    return io.Sample(target, op, size, clients, rnd, stats, cpu_s_per_gib, others_cores=0.0, steal_cores=0.0)


def samples() -> list[io.Sample]:
    out: list[io.Sample] = []
    for rnd in range(3):
        for c in (1, 8):
            out += [sample(io.KVGW, "GET", MB8, c, rnd, mb_s=2000, cpu_s_per_gib=0.20),
                    sample(io.KVGW_SERVER_VERIFIED, "GET", MB8, c, rnd, mb_s=1000, cpu_s_per_gib=0.50),
                    sample(io.NGINX, "GET", MB8, c, rnd, mb_s=1600, cpu_s_per_gib=0.25),
                    sample(io.KVGW, "PUT", MB8, c, rnd, mb_s=900, cpu_s_per_gib=0.8 if c == 1 else 1.2),
                    sample(io.RAW_WRITE, "PUT", MB8, c, rnd, mb_s=1000, cpu_s_per_gib=0.2),
                    sample(io.KVGW_NOFSYNC, "PUT", MB8, c, rnd, mb_s=1000, cpu_s_per_gib=0.7),
                    sample(io.RECEIVE_SINK, "PUT", MB8, c, rnd, mb_s=2000, cpu_s_per_gib=0.1)]
        for target, mb_s in ((io.KVGW, 2700), (io.KVGW_SERVER_VERIFIED, 2000), (io.KVGW_CLIENT, 2400),
                             (io.RAW_STREAM, 3000), (io.VERIFIED_SENDER, 2800)):
            out.append(sample(target, io.BATCH_GET, io.BATCH_PAYLOAD, 1, rnd, mb_s=mb_s, cpu_s_per_gib=0.2))
    return out


def test_issue_31_targets_read_the_client_verified_rows_and_the_put_floors() -> None:
    got = {t.name: t for t in io.targets(samples(), None)}
    for c, clients in ((1, "1 client"), (8, "8 clients")):
        thr = got[f"GET 8 MiB client-verified, {clients}: kvgw / nginx throughput"]
        cpu = got[f"GET 8 MiB client-verified, {clients}: server CPU per GiB, kvgw / nginx"]
        assert (thr.limit, thr.verdict) == (1.0, "PASS") and abs((thr.value or 0) - 1.25) < 1e-9
        assert (cpu.limit, cpu.verdict) == (1.1, "PASS") and abs((cpu.value or 0) - 0.8) < 1e-9
        put_cpu = got[f"PUT 8 MiB, {clients}, fsync: kvgw server CPU per GiB"]
        assert put_cpu.limit == 1.0 and put_cpu.verdict == ("PASS" if c == 1 else "FAIL")
        put_thr = got[f"PUT 8 MiB, {clients}, fsync: kvgw / {io.RAW_WRITE} throughput"]
        assert put_thr.verdict == "PASS" and abs((put_thr.value or 0) - 0.9) < 1e-9
        no_fsync = got[f"PUT 8 MiB, {clients}, no fsync: kvgw / {io.RECEIVE_SINK} throughput"]
        assert no_fsync.verdict == "FAIL" and abs((no_fsync.value or 0) - 0.5) < 1e-9
    for mine, ratio in ((io.KVGW, 0.9), (io.KVGW_CLIENT, 0.8)):
        batch = got[f"{io.BATCH_GET} warm, 1 client: {mine} / raw socket stream throughput"]
        assert batch.limit == 0.9 and abs((batch.value or 0) - ratio) < 1e-9
    assert got["GET 32 MiB client-verified, 1 client: kvgw / nginx throughput"].verdict == "n/a"  # not measured


def test_the_report_names_every_variant() -> None:
    args = argparse.Namespace(sizes=[MB8], clients=[1, 8], rounds=3, duration=2.0, ops=list(io.OPS),
                              keep_puts=False, direct_writes=True)
    got = samples()
    text = io.report(got, io.summarise(got), args, io.targets(got, None), None, {"head_8_clients_per_s": 1.0})
    assert "| GET (server-verified) | 8 MiB | 1 | 1000 |" in text
    assert "| GET | 8 MiB | 8 | 2000 |" in text
    assert f"| PUT (no fsync) | 8 MiB | 1 | 1000 | 10.0 / 10.0 | {io.RECEIVE_SINK} | 2000 |" in text
    assert "kvgw with KVGW_FS_DIRECT_WRITES=true" in text
    assert "| kvgw, server-verified | 8 MiB | 1 | 0.500 | 0.250 | 2.00 |" in text
    for name in (io.KVGW_CLIENT, io.KVGW_SERVER_VERIFIED):
        assert f"\n| {name} | " in text and f"{name} / {io.RAW_STREAM} throughput: " in text
