"""Engine hints (``POST /v1/buckets/{bucket}/hints``, ``X-Kvgw-Retention``) through ``KvgwClient`` to a
real ``kvgw serve``: what each hint leaves in the index, which keys count, and the errors."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from backends.index import MARK_ENDED, MARK_ONE_OFF, MARK_PINNED, MARK_SESSION_ENDED, MARK_SHARED
from kvgw_client import wire
from kvgw_client.http import KvgwClient, PutOutcome
from kvgw_client.wire import Hint, Retention
from tests.conftest import ServerProcess, wait_for
from tests.index_view import IndexView


@pytest.fixture
def index(shared_server: ServerProcess) -> IndexView:
    view = IndexView(shared_server.data_dir)
    yield view  # type: ignore[misc]
    view.close()


def marks(index: IndexView, key: str) -> int:
    entry = index.entry(key)
    assert entry is not None, key
    return entry.marks


def test_retention_class_on_put_is_recorded(
    kvgw_client: KvgwClient, index: IndexView, names: Callable[[str], str]
) -> None:
    c = kvgw_client.blocking
    assert c.put(names("s"), b"system prompt", retention=Retention.SHARED) is PutOutcome.STORED
    assert c.put(names("o"), b"a document", retention=Retention.ONE_OFF) is PutOutcome.STORED
    assert c.put(names("n"), b"plain") is PutOutcome.STORED
    assert marks(index, names("s")) == MARK_SHARED
    assert marks(index, names("o")) == MARK_ONE_OFF
    assert marks(index, names("n")) == 0


def test_hints_set_and_clear_marks_and_count_only_stored_keys(
    kvgw_client: KvgwClient, index: IndexView, names: Callable[[str], str]
) -> None:
    c = kvgw_client.blocking
    keys = [names(f"k{i}") for i in range(3)]
    for key in keys:
        c.put(key, key.encode())
    assert c.hint(Hint.PIN, [*keys, names("never-stored")]) == 3
    assert all(marks(index, key) == MARK_PINNED for key in keys)
    assert c.hint(Hint.SHARED, keys[:1]) == 1
    assert c.hint(Hint.ONE_OFF, keys[:1]) == 1  # one retention class at a time
    assert marks(index, keys[0]) == MARK_PINNED | MARK_ONE_OFF
    assert c.hint("normal", keys[:1]) == 1
    assert c.hint(Hint.UNPIN, keys) == 3
    assert [marks(index, key) for key in keys] == [0, 0, 0]
    assert c.hint(Hint.PIN, []) == 0


def test_a_read_after_an_ended_hint_clears_it_a_read_before_it_does_not(
    kvgw_client: KvgwClient, index: IndexView, names: Callable[[str], str]
) -> None:
    c = kvgw_client.blocking
    key = names("turn")
    c.put(key, b"history")
    assert c.get(key) == b"history"  # its read is recorded in the index up to a second later
    assert c.hint(Hint.SESSION_ENDED, [key]) == 1
    wait_for(lambda: (e := index.entry(key)) is not None and e.hits == 1, "the read before the hint recorded")
    assert marks(index, key) == MARK_ENDED | MARK_SESSION_ENDED
    assert c.get(key) == b"history"  # the session went on after all
    wait_for(lambda: (e := index.entry(key)) is not None and e.hits == 2, "the read after the hint recorded")
    assert marks(index, key) == 0


def test_a_chunk_offered_again_counts_as_used(
    kvgw_client: KvgwClient, index: IndexView, names: Callable[[str], str]
) -> None:
    """A PUT of a stored chunk keeps the stored bytes (write-once) and counts as a use, as the trace
    simulator counts a stored block a request brings again: recorded, and an ended session's mark gone
    (another conversation has just computed that prefix)."""
    c = kvgw_client.blocking
    key = names("shared-prefix")
    assert c.put(key, b"prefix") is PutOutcome.STORED
    assert c.hint(Hint.SESSION_ENDED, [key]) == 1
    assert marks(index, key) == MARK_ENDED | MARK_SESSION_ENDED
    assert c.put(key, b"prefix") is PutOutcome.EXISTED
    wait_for(lambda: (e := index.entry(key)) is not None and e.hits == 1, "the offer recorded as a use")
    assert marks(index, key) == 0
    assert c.get(key) == b"prefix"


def test_bad_hints_are_refused_with_one_clear_error(
    shared_server: ServerProcess, kvgw_client: KvgwClient, names: Callable[[str], str]
) -> None:
    with pytest.raises(ValueError, match="forget"):
        kvgw_client.blocking.hint("forget", [names("a")])
    url = f"{shared_server.url}/v1/buckets/kvcache/hints"
    with httpx.Client(headers=shared_server.auth, timeout=10.0) as http:
        for body in ({"hint": "forget", "keys": ["a"]}, {"keys": ["a"]}, {"hint": "pin"}, {"hint": "pin", "keys": [1]},
                     ["pin"]):
            r = http.post(url, json=body)
            assert r.status_code == 400, body
            assert r.json()["error"]["code"] == "InvalidRequest"
            assert r.json()["error"]["request_id"] == r.headers[wire.H_REQUEST_ID]
        r = http.put(shared_server.chunk_url(names("r")), content=b"x", headers={wire.H_RETENTION: "forever"})
        assert r.status_code == 400 and "X-Kvgw-Retention" in r.json()["error"]["message"]
        assert http.post(f"{shared_server.url}/v1/buckets/kvcache/hints",
                         json={"hint": "pin", "keys": ["a"]}, headers={"Authorization": "Bearer nobody:wrong"}
                         ).status_code == 401
