"""Fixtures for the client tests: an in-process fake of the native API and clients pointed at it.

Phase 2 runs the same kinds of checks against a real ``kvgw serve`` (``tests/conftest.py`` ``server``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gateway.client.config import ClientSettings, HealthPolicy, RetryPolicy, Timeouts
from gateway.client.http import KvgwClient
from tests.unit.client.fake_gateway import FakeGateway


@pytest.fixture
def fake_gateway() -> Iterator[FakeGateway]:
    gateway = FakeGateway()
    gateway.start()
    yield gateway
    gateway.stop()


def fast_settings(url: str, **overrides: object) -> ClientSettings:
    """Settings with short timeouts and cooldowns so failure tests finish in well under a second."""
    values: dict[str, object] = {
        "url": url,
        "bucket": "kvcache",
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


@pytest.fixture
def kvgw_client(fake_gateway: FakeGateway, make_client: Callable[..., KvgwClient]) -> KvgwClient:
    return make_client(fake_gateway.url)
