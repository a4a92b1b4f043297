"""``kvgw bench io``'s CPU-bound ceiling: the best throughput ratio two targets can reach when both
saturate the same cores, from their CPU per GiB with the load generator's share (pure arithmetic)."""

from __future__ import annotations

from gateway.bench.io import KVGW, NGINX, RAW_WRITE, Sample, cpu_bound_ceiling, total_cpu_per_gib
from gateway.bench.loadgen import Stats

GiB = 1 << 30


def sample(target: str, op: str, rnd: int, *, server_cpu: float, client_cpu: float) -> Sample:
    stats = Stats(clients=8, bytes=GiB, client_cpu=client_cpu)
    return Sample(target, op, 8 << 20, 8, rnd, stats, server_cpu, others_cores=0.0, steal_cores=0.0)


def test_the_load_generator_counts_over_sockets_and_an_in_process_loop_is_all_its_own_cpu() -> None:
    assert total_cpu_per_gib(sample(KVGW, "PUT", 0, server_cpu=0.9, client_cpu=0.2)) == 0.9 + 0.2
    assert total_cpu_per_gib(sample(RAW_WRITE, "PUT", 0, server_cpu=0.8, client_cpu=0.8)) == 0.8


def test_the_ceiling_is_the_baselines_cpu_over_kvgws_per_round_median() -> None:
    samples = [
        sample(KVGW, "GET", 0, server_cpu=0.36, client_cpu=0.14),
        sample(NGINX, "GET", 0, server_cpu=0.19, client_cpu=0.11),
        sample(KVGW, "GET", 1, server_cpu=0.30, client_cpu=0.10),
        sample(NGINX, "GET", 1, server_cpu=0.20, client_cpu=0.12),
        sample(KVGW, "GET", 2, server_cpu=0.40, client_cpu=0.10),
        sample(NGINX, "GET", 2, server_cpu=0.25, client_cpu=0.05),
    ]
    # per round: 0.30 / 0.50 = 0.6, 0.32 / 0.40 = 0.8, 0.30 / 0.50 = 0.6
    ceiling = cpu_bound_ceiling(samples, (KVGW, "GET"), (NGINX, "GET"), 8 << 20, 8)
    assert ceiling is not None and abs(ceiling - 0.6) < 1e-9
    assert cpu_bound_ceiling(samples, (KVGW, "GET"), (NGINX, "GET"), 8 << 20, 1) is None  # no such cell
