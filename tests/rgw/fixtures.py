"""Pytest fixtures for the throwaway Ceph RGW (``gateway.bench.rgw``), beside moto (``tests.s3server``).

::

    rgw_cluster    session: one cluster per test run, started on first use (~3 s), stopped at the end;
                   missing Ceph packages skip locally and fail under KVGW_REQUIRE_SERVICES=1
    rgw_endpoint   session: an ``S3Endpoint`` on it (``s3_bucket``-like buckets via ``create_bucket``)
    rgw_outage     function: the same RGW, whose radosgw process the test may stop, start, pause and
                   resume (``endpoint.server``, MotoServer's interface); bucket ``kvgw-private`` exists
                   and is empty; radosgw is running again afterwards

``S3_SERVERS`` are the parameter ids of tests that run against every S3 server: ``"s3"`` is
``s3_endpoint`` (moto, or ``KVGW_TEST_S3_ENDPOINT``), ``"rgw"`` is ``rgw_endpoint``. With
``KVGW_TEST_S3_ENDPOINT`` set, only ``"s3"``: the same tests then run once, against that endpoint.
``STOPPABLE_S3`` likewise for outage tests: ``"moto"`` (``moto_server``) and ``"rgw"`` (``rgw_outage``).

Clusters live under ``$KVGW_TEST_RGW_DIR`` (default ``<tmp>/kvgw-rgw``), one directory per test run;
each run first removes those whose run is gone (a SIGKILLed pytest).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.bench.rgw import ACCESS_KEY, SECRET_KEY, RgwCluster, missing_commands, sweep
from tests.requirements import require_or_skip
from tests.s3server import ENDPOINT_ENV, S3Endpoint

RGW_DIR_ENV = "KVGW_TEST_RGW_DIR"
S3_SERVERS = ["s3"] if os.environ.get(ENDPOINT_ENV) else ["s3", "rgw"]
STOPPABLE_S3 = ["moto"] if os.environ.get(ENDPOINT_ENV) else ["moto", "rgw"]
PRIVATE_BUCKET = "kvgw-private"


def rgw_base() -> Path:
    return Path(os.environ.get(RGW_DIR_ENV) or Path(tempfile.gettempdir()) / "kvgw-rgw")


def s3_endpoint_of(request: pytest.FixtureRequest, server: str) -> S3Endpoint:
    """The endpoint of an ``S3_SERVERS`` id."""
    endpoint: S3Endpoint = request.getfixturevalue("rgw_endpoint" if server == "rgw" else "s3_endpoint")
    return endpoint


def stoppable_s3_of(request: pytest.FixtureRequest, server: str) -> S3Endpoint:
    """The endpoint of a ``STOPPABLE_S3`` id; ``.server`` stops, starts, pauses and resumes it."""
    endpoint: S3Endpoint = request.getfixturevalue("rgw_outage" if server == "rgw" else "moto_server")
    return endpoint


@pytest.fixture(scope="session")
def rgw_cluster() -> Iterator[RgwCluster]:
    missing = missing_commands()
    if missing:
        require_or_skip(f"Ceph RGW not installed ({', '.join(missing)} missing; run .ci/install-rgw.sh)")
    base = rgw_base()
    base.mkdir(parents=True, exist_ok=True)
    sweep(base)
    cluster = RgwCluster(base / f"run-{os.getpid()}", owner=os.getpid(), die_with_parent=True).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def rgw_endpoint(rgw_cluster: RgwCluster) -> S3Endpoint:
    return S3Endpoint(rgw_cluster.url, ACCESS_KEY, SECRET_KEY)


@dataclass
class RgwProcess:
    """``MotoServer``'s stop / start / restart / pause / resume, acting on the cluster's radosgw only
    (objects survive a stop, unlike moto's)."""

    cluster: RgwCluster

    def start(self) -> RgwProcess:
        self.cluster.start_gateway()
        return self

    def stop(self) -> None:
        self.cluster.stop_gateway()

    def restart(self) -> RgwProcess:
        self.stop()
        return self.start()

    def pause(self) -> None:
        self.cluster.pause()

    def resume(self) -> None:
        self.cluster.resume()


@pytest.fixture
def rgw_outage(rgw_cluster: RgwCluster) -> Iterator[S3Endpoint]:
    process = RgwProcess(rgw_cluster)
    endpoint = S3Endpoint(rgw_cluster.url, ACCESS_KEY, SECRET_KEY, server=process)  # type: ignore[arg-type]
    endpoint.drop_bucket(PRIVATE_BUCKET)  # left by an earlier test whose teardown could not reach RGW
    endpoint.admin().create_bucket(Bucket=PRIVATE_BUCKET)
    try:
        yield endpoint
    finally:
        process.resume()
        if not rgw_cluster.gateway_running:
            process.start()
        endpoint.drop_bucket(PRIVATE_BUCKET)
