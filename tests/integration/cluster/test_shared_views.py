"""A chunk one gateway looked up just before another wrote it (issue 30, item 7), with real gateways on
one directory: on their own FUSE views (``fs_view`` ``fuse``: each view caches the missing name for
3 s, as an NFS client's negative lookup cache does) the chunk is served, deleted and rewritten through
the gateway that cached its absence, within the revalidating retry, and never lost; on the directory
itself (``shared``) the same steps simply work.

Gateway B runs one worker, so the stats document that counts the hidden chunks is the one that met them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, wait_for
from tests.integration.cluster.conftest import Launch


@pytest.fixture
def pair(launch: Launch) -> Iterator[tuple[ServerProcess, ServerProcess, httpx.Client, httpx.Client]]:
    a, b = launch("a"), launch("b", KVGW_WORKERS="1")
    with httpx.Client(headers=a.auth, timeout=60) as ca, httpx.Client(headers=b.auth, timeout=60) as cb:
        yield a, b, ca, cb


def _hidden(client: httpx.Client, server: ServerProcess) -> dict[str, int]:
    seen: dict[str, int] = client.get(f"{server.url}/v1/admin/stats").json()["fs_hidden"]
    return seen


def _exists(client: httpx.Client, server: ServerProcess, keys: list[str]) -> list[bool]:
    found: list[bool] = client.post(f"{server.url}/v1/buckets/kvcache/exists", json={"keys": keys}).json()["exists"]
    return found


def _looked_up_on_b_then_written_by_a(pair: Any, key: str) -> bytes:
    """B answers "absent" (a lookup that reaches the directory: B's view now caches the missing name),
    then A writes the chunk and the feed tells B's index."""
    a, b, ca, cb = pair
    assert cb.head(b.chunk_url(key)).status_code == 404
    data = os.urandom(300_000)
    assert ca.put(a.chunk_url(key), content=data).status_code == 201
    wait_for(lambda: _exists(cb, b, [key]) == [True], "the feed told B's index about A's write")
    return data


def _expect_hidden(request: pytest.FixtureRequest, client: httpx.Client, server: ServerProcess, count: int) -> None:
    """On FUSE views the step above met the cached missing name ``count`` times and never gave up."""
    fuse = request.node.callspec.params["fs_view"] == "fuse"
    assert _hidden(client, server) == {"seen": count if fuse else 0, "refused": 0}


def test_a_chunk_looked_up_on_b_just_before_a_wrote_it_is_served_by_b(pair: Any,
                                                                      request: pytest.FixtureRequest) -> None:
    _a, b, _ca, cb = pair
    data = _looked_up_on_b_then_written_by_a(pair, "late")
    got = cb.get(b.chunk_url("late"))
    assert got.status_code == 200 and got.content == data
    _expect_hidden(request, cb, b, 1)
    # never lost: B's index still has it, its listing shows it, a rewrite through B is "existed"
    assert _exists(cb, b, ["late"]) == [True]
    listed = cb.post(f"{b.url}/v1/buckets/kvcache/list", json={"prefix": "late"}).json()["keys"]
    assert listed == ["late"]
    again = cb.put(b.chunk_url("late"), content=os.urandom(10))
    assert again.status_code == 200 and again.headers["x-kvgw-existed"] == "true"
    assert cb.get(b.chunk_url("late")).content == data


def test_a_rewrite_through_b_keeps_a_s_chunk(pair: Any, request: pytest.FixtureRequest) -> None:
    """The write-once check on B meets the hidden chunk first: it waits for it, never takes the key."""
    a, b, ca, cb = pair
    data = _looked_up_on_b_then_written_by_a(pair, "rewrite")
    again = cb.put(b.chunk_url("rewrite"), content=os.urandom(10))
    assert again.status_code == 200 and again.headers["x-kvgw-existed"] == "true"
    assert _exists(cb, b, ["rewrite"]) == [True]  # B's index kept the entry it could not confirm at once
    for client, server in ((ca, a), (cb, b)):
        assert client.get(server.chunk_url("rewrite")).content == data
    _expect_hidden(request, cb, b, 1)


def test_a_delete_through_b_removes_the_chunk_everywhere(pair: Any, request: pytest.FixtureRequest) -> None:
    a, b, ca, cb = pair
    _looked_up_on_b_then_written_by_a(pair, "doomed")
    assert cb.delete(b.chunk_url("doomed")).status_code == 204
    wait_for(lambda: _exists(ca, a, ["doomed"]) == [False], "the delete reached A's index")
    assert ca.get(a.chunk_url("doomed")).status_code == 404
    assert cb.get(b.chunk_url("doomed")).status_code == 404
    _expect_hidden(request, cb, b, 1)
