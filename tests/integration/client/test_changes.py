"""The change stream (``POST /v1/buckets/{bucket}/changes``, ``KvgwClient.changes``) against a real
``kvgw serve`` on its embedded SQLite catalog: stores and removals per prefix, in feed order, resumable
from a cursor; a removal only when no tier holds the chunk; a trimmed cursor says ``reset``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from kvgw_client.changes import Change, ChangeFollower, ChangePage
from kvgw_client.http import KvgwClient, PutOutcome
from tests.conftest import ServerProcess, wait_for


def follow(client: KvgwClient, prefix: str, after: int | None, until: Callable[[list[Change]], bool],
           timeout: float = 30.0) -> tuple[list[Change], int]:
    """Page through the stream from ``after`` until ``until(changes so far)``; (changes, last cursor)."""
    seen: list[Change] = []
    cursor = after
    deadline = time.monotonic() + timeout
    while True:
        page = client.blocking.changes(prefix, after=cursor, limit=3)
        assert page is not None
        assert not page.reset
        seen.extend(page.changes)
        cursor = page.cursor
        if until(seen):
            return seen, cursor
        assert time.monotonic() < deadline, f"the stream gave only {seen}"
        time.sleep(0.05)


def test_stores_and_removals_under_a_prefix_resumable(
    shared_server: ServerProcess, make_client: Callable[..., KvgwClient]
) -> None:
    client = make_client(shared_server.url)
    tag = uuid.uuid4().hex[:8]
    mine, other = f"vllm/m_{tag}_r0", f"vllm/m_{tag}_r1"
    start = client.blocking.changes(mine)  # from now on: an empty page at the head
    assert start is not None and start.changes == [] and start.cursor == start.head
    keys = [f"{mine}/{i:03x}/{i:02x}_g0/{i:064x}.bin" for i in range(5)]
    for key in keys:
        assert client.blocking.put(key, key.encode()) is PutOutcome.STORED
    assert client.blocking.put(f"{other}/x.bin", b"not under the prefix") is PutOutcome.STORED
    seen, cursor = follow(client, mine, start.cursor, lambda got: len(got) >= 5)
    assert [(c.op, c.key, c.size) for c in seen] == [("stored", k, len(k)) for k in keys]
    assert [c.seq for c in seen] == sorted(c.seq for c in seen)

    # resuming from a cursor repeats nothing; a delete is a removal (nothing holds the chunk)
    assert client.blocking.delete(keys[1])
    removed, cursor = follow(client, mine, cursor, lambda got: bool(got))
    assert [(c.op, c.key) for c in removed] == [("removed", keys[1])]
    # an older cursor reads the same changes again, in the same order
    again, _ = follow(client, mine, start.cursor, lambda got: len(got) >= 6)
    assert [(c.op, c.key) for c in again] == [("stored", k) for k in keys] + [("removed", keys[1])]

    # removed then stored again before the page is read: the removal is not reported (a tier holds the
    # key again), the new store is
    assert client.blocking.delete(keys[2])
    assert client.blocking.put(keys[2], b"second incarnation") is PutOutcome.STORED
    wait_for(lambda: client.blocking.changes(mine, after=cursor).head > cursor + 1, "the feed to take both")
    later, _ = follow(client, mine, cursor, lambda got: any(c.op == "stored" for c in got))
    assert [(c.op, c.key) for c in later] == [("stored", keys[2])]


def test_the_follower_hands_every_page_on(
    shared_server: ServerProcess, make_client: Callable[..., KvgwClient]
) -> None:
    client = make_client(shared_server.url)
    prefix = f"follow/{uuid.uuid4().hex[:8]}/"
    pages: list[ChangePage] = []
    follower = ChangeFollower(lambda after: client.changes(prefix, after=after, limit=2), pages.append,
                              poll_seconds=0.05)
    task = client.spawn(follower.run())
    try:
        wait_for(lambda: follower.pages > 0, "the follower's first page")
        for i in range(5):
            client.blocking.put(f"{prefix}{i}", b"x")
        wait_for(lambda: sum(len(p.changes) for p in pages) >= 5, "five changes")
        assert [c.key for p in pages for c in p.changes] == [f"{prefix}{i}" for i in range(5)]
        assert max(len(p.changes) for p in pages) <= 2
    finally:
        task.cancel()


def test_bad_requests_get_one_clear_answer(shared_server: ServerProcess) -> None:
    url = f"{shared_server.url}/v1/buckets/kvcache/changes"
    for body in ({"after": -1}, {"after": "1"}, {"limit": 0}, {"prefix": 3}, [1]):
        got = httpx.post(url, json=body, headers=shared_server.auth, timeout=30)
        assert got.status_code == 400, body
        err = got.json()["error"]
        assert err["code"] == "InvalidRequest" and err["request_id"]
    assert httpx.post(url, json={}, timeout=30).status_code in (401, 403)


def test_a_trimmed_cursor_says_reset(server_factory: type[ServerProcess], tmp_path: Path,
                                    make_client: Callable[..., KvgwClient]) -> None:
    """Retention of one event: an old cursor is behind the feed; the page says so and goes on from the
    oldest event kept."""
    server = server_factory(data_dir=tmp_path / "data", env={
        "KVGW_CLUSTER_FEED_RETENTION_EVENTS": "1", "KVGW_CLUSTER_TRIM_SECONDS": "0.2",
        "KVGW_CLUSTER_HEARTBEAT_SECONDS": "0.2"}).start()
    client = make_client(server.url)
    start = client.blocking.changes("t/")
    assert start is not None
    for i in range(4):
        client.blocking.put(f"t/{i}", b"x")

    def trimmed() -> bool:
        page = client.blocking.changes("t/", after=start.cursor)
        return page is not None and page.reset and [c.key for c in page.changes][-1:] == ["t/3"]

    wait_for(trimmed, "the feed to be trimmed past the first cursor")
    page = client.blocking.changes("t/", after=start.cursor)
    assert page is not None and page.reset
    keys = [c.key for c in page.changes]  # what the feed still keeps: the last stores, never the first
    assert keys[0] != "t/0" and keys == [f"t/{i}" for i in range(int(keys[0][2:]), 4)]
