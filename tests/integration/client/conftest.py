"""Fixtures for the client against a real ``kvgw serve``: clients with fast failure settings, a fault
proxy in front of the server, and a read-only view of the server's index."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from kvgw_client.config import ClientSettings, HealthPolicy, RetryPolicy, Timeouts
from kvgw_client.http import KvgwClient
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess
from tests.http_faults import HttpFaultProxy


def fast_settings(url: str, **overrides: object) -> ClientSettings:
    """Root credentials, short timeouts and cooldowns: failure tests finish in well under a second."""
    values: dict[str, object] = {
        "url": url,
        "bucket": "kvcache",
        "access_key": ROOT_AK,
        "secret_key": ROOT_SK,
        "timeouts": Timeouts(connect=1.0, read=2.0, control=2.0),
        "retry": RetryPolicy(attempts=3, backoff=0.005, backoff_max=0.02),
        "health": HealthPolicy(failure_threshold=3, cooldown=0.1, cooldown_max=0.4),
    }
    values.update(overrides)
    return ClientSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def make_client() -> Iterator[Callable[..., KvgwClient]]:
    clients: list[KvgwClient] = []

    def make(url: str, **overrides: object) -> KvgwClient:
        client = KvgwClient(fast_settings(url, **overrides))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway for a module's tests (tests that stop a server use ``server``); keys come from
    ``names`` so tests never collide on write-once keys."""
    server = ServerProcess(data_dir=tmp_path_factory.mktemp("kvgw") / "data").start()
    yield server
    server.stop()


@pytest.fixture
def names() -> Callable[[str], str]:
    """Unique keys for one test: ``names("a")`` -> ``org/model@1@0@<test id>a@bfloat16``."""
    tag = uuid.uuid4().hex[:12]
    return lambda name: f"org/model@1@0@{tag}{name}@bfloat16"


@pytest.fixture
def proxy(shared_server: ServerProcess) -> Iterator[HttpFaultProxy]:
    p = HttpFaultProxy(shared_server.url).start()
    yield p
    p.close()


@pytest.fixture
def kvgw_client(proxy: HttpFaultProxy, make_client: Callable[..., KvgwClient]) -> KvgwClient:
    """A client of the real server, through the fault proxy (which passes everything until told)."""
    return make_client(proxy.url)
