"""``Request.drain``: whether a connection may be reused after an answer given before the app read the
whole body (an error). The rule: only when every byte of the body has been read, by the app or by the
drain itself; otherwise the response must close the connection (the rest would be parsed as the next
request, and the protocol closes such a connection anyway, so a keep-alive answer would be a lie)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.api.http import Message, Request
from gateway.errors import IncompleteBody

MiB = 1 << 20


def request(pieces: Sequence[bytes], *, length: int | None = None, expect: str | None = None,
            ends: bool = True) -> Request:
    """A request whose body arrives as ``pieces``; unless ``ends``, the client disconnects after them."""
    messages: list[Message] = [{"type": "http.request", "body": p, "more_body": not ends or i < len(pieces) - 1}
                               for i, p in enumerate(pieces)]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    headers = [(b"content-length", str(sum(map(len, pieces)) if length is None else length).encode())]
    if expect:
        headers.append((b"expect", expect.encode()))
    scope = {"method": "PUT", "path": "/x", "raw_path": b"/x", "query_string": b"", "headers": headers}
    return Request(scope, receive)


async def test_a_body_read_to_its_end_needs_no_drain() -> None:
    req = request([b"a" * 10, b"b" * 10])
    assert await req.read_body(100) == b"a" * 10 + b"b" * 10
    assert await req.drain(0)


async def test_a_body_abandoned_part_way_is_drained_from_where_it_stopped() -> None:
    req = request([b"a" * MiB, b"b" * MiB, b"c" * MiB])
    body = req.body(idle_timeout=5.0)
    assert await anext(body) == b"a" * MiB  # the app stops here (a staging write failed)
    await body.aclose()
    assert not req.body_ended and req.body_received == MiB
    assert not await req.drain(2 * MiB - 1)  # the rest (2 MiB) is over the limit: close
    assert await req.drain(2 * MiB)  # within it: read to the end, keep-alive is honest
    assert req.body_ended and req.body_received == 3 * MiB


async def test_a_rest_within_the_limit_that_never_comes_closes() -> None:
    req = request([b"a" * 10, b"b" * 10], length=1000, ends=False)  # the client goes away part-way
    with pytest.raises(IncompleteBody):  # the app sees the body break
        async for _ in req.body(idle_timeout=5.0):
            pass
    assert not await req.drain(MiB)  # and the answer closes, without waiting for the rest again


@pytest.mark.parametrize("consumed", [False, True])
async def test_a_client_waiting_for_continue(consumed: bool) -> None:
    req = request([b"a" * 10], expect="100-continue")
    if consumed:
        assert await req.read_body(100) == b"a" * 10
    assert await req.drain(MiB) is consumed  # never sent unless asked for: nothing to drain, close
