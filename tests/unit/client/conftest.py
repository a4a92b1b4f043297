"""Fixtures of the client's unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvgw_client.config import ClientSettings, RetryPolicy, Timeouts
from kvgw_client.http import KvgwClient
from tests.unit.client.scripted import Respond, ScriptedServer


@pytest.fixture
def serve() -> Iterator[Callable[..., KvgwClient]]:
    """``serve(respond, **settings)``: a client of a new ``ScriptedServer`` answering with ``respond``;
    one attempt per call and a 10 s read timeout unless ``settings`` (``ClientSettings`` fields) say
    otherwise."""
    opened: list[tuple[ScriptedServer, KvgwClient]] = []

    def start(respond: Respond, *, read_timeout: float = 10.0, pool_size: int = 32, **settings: Any) -> KvgwClient:
        server = ScriptedServer(respond)
        settings.setdefault("timeouts", Timeouts(read=read_timeout))
        settings.setdefault("retry", RetryPolicy(attempts=1))
        client = KvgwClient(ClientSettings(url=f"http://127.0.0.1:{server.port}", bucket="kvcache",
                                           pool_size=pool_size, **settings))
        opened.append((server, client))
        return client

    yield start
    for server, client in opened:
        client.close()
        server.close()
