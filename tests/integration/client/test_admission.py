"""Admission under pressure (issue 33 item 2) on a real ``kvgw serve``: at its low watermark a bucket
declines chunks hinted as read by no one again, with 507 ``Declined`` and ``X-Kvgw-Declined``; nothing is
stored, the connection stays usable, the metrics count it, and ``KvgwClient`` reports ``DECLINED``
without counting a failure."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvgw_client import wire
from kvgw_client.health import CircuitState
from kvgw_client.http import KvgwClient, PutOutcome
from kvgw_client.wire import Retention
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, create_bucket, fs_usage, wait_for
from tests.integration.test_metrics import scrape, value

CHUNK = 64 << 10
CAPACITY = 20 * CHUNK  # low watermark (0.8): 16 chunks


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("admission") / "data",
                           env={"KVGW_LIFECYCLE_INTERVAL": "0.2", "KVGW_WORKERS": "1"}).start()
    create_bucket(server, "full", "--capacity-bytes", str(CAPACITY))
    yield server
    server.stop()


def url(server: ServerProcess, key: str) -> str:
    return server.chunk_url(key, bucket="full")


def usage(server: ServerProcess) -> int:
    return fs_usage(server, "full")


def test_below_the_watermark_everything_is_admitted_and_at_it_hinted_one_offs_are_not(
    gateway: ServerProcess, make_client: Callable[..., KvgwClient]
) -> None:
    with httpx.Client(headers=gateway.auth, timeout=30) as http:
        one_off = {wire.H_RETENTION: "one-off"}
        assert http.put(url(gateway, "early-doc"), content=os.urandom(CHUNK), headers=one_off).status_code == 201
        for i in range(18):
            assert http.put(url(gateway, f"fill{i}"), content=os.urandom(CHUNK)).status_code == 201
        wait_for(lambda: CAPACITY * 0.8 <= usage(gateway) <= CAPACITY * 0.9,
                 "the lifecycle holds the bucket between its watermarks")
        before = scrape(gateway)
        big = os.urandom(3 << 20)  # more than a connection's error drain: the body is read all the same
        declined = http.put(url(gateway, "late-doc"), content=big, headers=one_off)
        assert declined.status_code == 507
        assert declined.headers[wire.H_DECLINED] == "one-off"
        assert declined.json()["error"]["code"] == "Declined"
        assert declined.json()["error"]["request_id"] == declined.headers[wire.H_REQUEST_ID]
        assert "connection" not in declined.headers  # the body was read: the connection goes on
        assert http.head(url(gateway, "late-doc")).status_code == 404
        assert http.put(url(gateway, "late-plain"), content=os.urandom(CHUNK)).status_code == 201
        after = scrape(gateway)
    assert value(after, "kvgw_admission_total", bucket="full", outcome="one-off") == \
        value(before, "kvgw_admission_total", bucket="full", outcome="one-off") + 1
    assert value(after, "kvgw_admission_total", bucket="full", outcome="admitted") >= 1

    client = make_client(gateway.url, bucket="full")
    assert client.blocking.put("client-doc", os.urandom(CHUNK), retention=Retention.ONE_OFF) is PutOutcome.DECLINED
    assert client.blocking.put("client-chunk", os.urandom(CHUNK)) is PutOutcome.STORED
    stats = client.stats()
    assert stats["counters"]["put.declined"] == 1  # type: ignore[index]
    assert stats["failures"] == {} and client.health is CircuitState.CLOSED


def test_a_chunk_whose_parent_was_evicted_is_still_admitted(
    gateway: ServerProcess, make_client: Callable[..., KvgwClient]
) -> None:
    """Engines write a request's chunks all at once: a parent evicted earlier may be in flight again in
    the same batch, so an evicted parent is no reason to decline (gateway.lifecycle.admission)."""
    client = make_client(gateway.url, bucket="full")
    c = client.blocking
    assert c.put("chain0", os.urandom(CHUNK)) is PutOutcome.STORED
    for i in range(30):  # push chain0 out
        c.put(f"push{i}", os.urandom(CHUNK))
    wait_for(lambda: not c.exists(["chain0"])[0], "chain0 evicted")
    assert c.put("chain1", os.urandom(CHUNK), parent="chain0") is PutOutcome.STORED


def test_s3_writes_are_never_declined(gateway: ServerProcess) -> None:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=gateway.url, aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    for i in range(3):  # at the watermark: stored
        s3.put_object(Bucket="full", Key=f"s3-{i}", Body=os.urandom(CHUNK))
    assert usage(gateway) >= CAPACITY * 0.8
    assert s3.head_object(Bucket="full", Key="s3-2")["ContentLength"] == CHUNK
