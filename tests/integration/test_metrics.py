"""``GET /metrics`` (Prometheus) on a real gateway: protected like the admin stats, every family appears,
and the families move with the traffic; JSON logs carry the request id."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.config import Config
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, wait_for

FAMILIES = {
    "kvgw_requests", "kvgw_request_seconds", "kvgw_request_body_bytes", "kvgw_response_body_bytes",
    "kvgw_lookup_keys", "kvgw_tier_usage_bytes", "kvgw_tier_chunks", "kvgw_tier_capacity_bytes",
    "kvgw_lifecycle_chunks", "kvgw_promotions", "kvgw_moved_bytes", "kvgw_write_through_backlog",
    "kvgw_chunks_indexed", "kvgw_threaded_receives", "kvgw_retried_requests", "kvgw_event_loop_stalls",
    "kvgw_admission",
}


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{server.url}/metrics", headers=server.auth, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def family_names(server: ServerProcess) -> set[str]:
    text = httpx.get(f"{server.url}/metrics", headers=server.auth, timeout=10).text
    return {family.name for family in text_string_to_metric_families(text)}


@pytest.fixture
def server(server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "d", extra_args=["--log-format", "json"],
                          env={"KVGW_LOG_LEVEL": "info"}).start()


def test_metrics_are_protected_like_admin_stats(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer nobody:nothing"}).status_code == 401


def test_batch_get_bytes_are_counted_however_they_are_written(server: ServerProcess) -> None:
    """Batch-get frames leave gathered (``kvgw.response.parts``), from a file (``sendfile``) or in
    pieces: each way counts every frame byte in ``kvgw_response_body_bytes``."""
    bodies = [os.urandom(size) for size in (1000, 70_000, 300_000)]
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30) as client:
        for i, body in enumerate(bodies):
            assert client.put(server.chunk_url(f"bg-{i}"), content=body).status_code == 201
        before = scrape(server)
        answer = client.post("/v1/buckets/kvcache/batch-get", json={"keys": ["bg-0", "bg-1", "absent", "bg-2"]})
        assert answer.status_code == 200
    after = scrape(server)
    sent = value(after, "kvgw_response_body_bytes_total", api="native") - value(
        before, "kvgw_response_body_bytes_total", api="native")
    assert sent == len(answer.content) and len(answer.content) > sum(map(len, bodies))


def test_every_family_appears_and_moves(server: ServerProcess) -> None:
    assert family_names(server) >= FAMILIES
    before = scrape(server)
    body = os.urandom(100_000)
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30) as client:
        assert client.put(server.chunk_url("m-0"), content=body).status_code == 201
        assert client.get(server.chunk_url("m-0")).content == body
        assert client.head(server.chunk_url("m-0")).status_code == 200
        assert client.head(server.chunk_url("absent")).status_code == 404
        assert client.post("/v1/buckets/kvcache/exists", json={"keys": ["m-0", "absent"]}).status_code == 200
        assert client.post("/v1/buckets/kvcache/prefix", json={"keys": ["m-0", "absent"]}).status_code == 200
    s3 = boto3.client("s3", endpoint_url=server.url, aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    assert s3.get_object(Bucket="kvcache", Key="m-0")["Body"].read() == body
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvgw_requests_total", api="native", op="put_chunk", status="201") == 1
    assert moved("kvgw_requests_total", api="native", op="get_chunk", status="200") == 1
    assert moved("kvgw_requests_total", api="native", op="head_chunk", status="404") == 1
    assert moved("kvgw_requests_total", api="s3", op="GetObject", status="200") == 1
    assert moved("kvgw_request_seconds_count", api="native", op="exists") == 1
    assert moved("kvgw_request_body_bytes_total", api="native") >= len(body)
    assert moved("kvgw_response_body_bytes_total", api="native") >= len(body)
    assert moved("kvgw_response_body_bytes_total", api="s3") == len(body)
    assert moved("kvgw_lookup_keys_total", op="exists", result="hit") == 1
    assert moved("kvgw_lookup_keys_total", op="exists", result="miss") == 1
    assert moved("kvgw_lookup_keys_total", op="head", result="miss") == 1
    assert moved("kvgw_lookup_keys_total", op="prefix", result="hit") == 1
    assert moved("kvgw_tier_usage_bytes", bucket="kvcache", tier="fs") == len(body)
    assert moved("kvgw_tier_chunks", bucket="kvcache", tier="fs") == 1
    assert value(after, "kvgw_tier_capacity_bytes", bucket="kvcache", tier="fs") > 0
    assert moved("kvgw_chunks_indexed") == 1


def test_evictions_move_the_lifecycle_family(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d").start()
    assert httpx.put(f"{server.url}/v1/buckets/kvcache/chunks/seed", content=b"x", headers=server.auth).status_code
    from gateway.cli import main as kvgw

    server.stop()
    assert kvgw(["bucket", "update", "kvcache", "--capacity-bytes", str(3 << 20), "--data-dir",
                 str(tmp_path / "d")]) == 0
    server.start()
    with httpx.Client(headers=server.auth, timeout=30) as client:
        for i in range(6):
            assert client.put(server.chunk_url(f"e-{i}"), content=os.urandom(1 << 20)).status_code == 201
    wait_for(lambda: value(scrape(server), "kvgw_lifecycle_chunks_total", action="evicted") > 0,
             "an eviction counted in kvgw_lifecycle_chunks_total")


def test_json_logs_carry_the_request_id(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--log-format", "json"],
                            env={"KVGW_LOG_LEVEL": "info", "KVGW_ACCESS_LOG": "true"}).start()
    r = httpx.get(server.chunk_url("not-there"), headers=server.auth)
    assert r.status_code == 404
    request_id = r.headers["x-kvgw-request-id"]

    def logged() -> list[dict[str, str]]:
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("request_id") == request_id]

    wait_for(logged, "a JSON log line carrying the request's id")
    (line,) = logged()
    assert {"ts", "level", "logger", "message"} <= set(line) and "404" in line["message"]
