"""The request path's counters and histograms (gateway.tally): what Prometheus reads from them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.tally import SpreadFamily, TallyCollector, TallyFamily


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_counters_and_histograms_expose_as_prometheus_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    requests = TallyFamily("kvgw_requests", "Requests.", ["api", "status"])
    latency = SpreadFamily("kvgw_request_seconds", "Latency.", ["api"], (0.001, 0.01, 0.1))
    registry.register(TallyCollector([requests, latency]))
    requests.labels("native", "200").inc()
    requests.labels("native", "200").inc(2)
    requests.labels("s3", "404").inc()
    for seconds in (0.0005, 0.001, 0.005, 0.5):
        latency.labels("native").observe(seconds)

    samples = scrape(registry)
    assert samples[("kvgw_requests_total", (("api", "native"), ("status", "200")))] == 3
    assert samples[("kvgw_requests_total", (("api", "s3"), ("status", "404")))] == 1
    buckets = {le: samples[("kvgw_request_seconds_bucket", (("api", "native"), ("le", le)))]
               for le in ("0.001", "0.01", "0.1", "+Inf")}
    assert buckets == {"0.001": 2, "0.01": 3, "0.1": 3, "+Inf": 4}  # cumulative; a bound is inclusive
    assert samples[("kvgw_request_seconds_count", (("api", "native"),))] == 4
    assert abs(samples[("kvgw_request_seconds_sum", (("api", "native"),))] - 0.5065) < 1e-9


def test_a_family_without_children_exposes_nothing_but_its_help() -> None:
    registry = CollectorRegistry()
    registry.register(TallyCollector([TallyFamily("kvgw_idle", "Nothing yet.", ["op"])]))
    text = generate_latest(registry).decode()
    assert "# HELP kvgw_idle_total Nothing yet." in text and "kvgw_idle_total{" not in text
