"""KvgwClient logic that needs no gateway: key encoding, local key checks, the thread rules.

Everything that talks to a gateway is tested against a real ``kvgw serve`` in
``tests/integration/client/test_http_client.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvgw_client import wire
from kvgw_client.config import ClientSettings
from kvgw_client.errors import Rejected
from kvgw_client.http import KvgwClient, encode_key


@pytest.fixture
def offline_client() -> Iterator[KvgwClient]:
    """A client of a port nothing listens on; these tests never reach the network."""
    client = KvgwClient(ClientSettings(url="http://127.0.0.1:9", bucket="kvcache"))
    yield client
    client.close()


def test_key_encoding_escapes_every_reserved_byte() -> None:
    assert encode_key("a/b@c d%") == "a%2Fb%40c%20d%25"
    assert encode_key("a/b@c d%") == wire.encode_key("a/b@c d%")


def test_invalid_keys_are_rejected_before_any_request(offline_client: KvgwClient) -> None:
    with pytest.raises(Rejected) as info:
        offline_client.blocking.put("bad\nkey", b"x")
    assert info.value.code == wire.ErrorCode.INVALID_KEY
    assert offline_client.blocking.exists(["x" * 2000], quiet=True) == [False]
    assert offline_client.stats()["failures"] == {}  # nothing was sent, so nothing failed


def test_blocking_calls_are_refused_on_an_event_loop(offline_client: KvgwClient) -> None:
    async def misuse() -> None:
        offline_client.blocking.exists(["k"])

    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(misuse())
