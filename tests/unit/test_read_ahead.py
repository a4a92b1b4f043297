"""``backends.read_ahead.OpenedAhead``: the store a batch read's read-ahead pass fills and its reads take
from. Pure bookkeeping (who owns an opened chunk, the byte limit, expiry), with an injected clock; the
pass itself runs through a real gateway in ``tests/integration/test_read_ahead.py``."""

from __future__ import annotations

from backends.read_ahead import OpenedAhead


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def store(limit: int = 100, max_age: float = 30.0) -> tuple[OpenedAhead, Clock, list[str]]:
    clock = Clock()
    return OpenedAhead(limit_bytes=limit, max_age=max_age, clock=clock), clock, []


def key(name: str) -> tuple[bytes, tuple[str, int]]:
    return (name.encode(), ("map", 0))


def test_a_read_takes_what_the_pass_opened_and_owns_it() -> None:
    ahead, _, closed = store()
    ahead.plan([(key("a"), 10), (key("b"), 10)])
    assert ahead.begin(key("a"))
    ahead.offer(key("a"), "opened-a", lambda: closed.append("a"))
    assert ahead.claim(key("a")) == "opened-a"
    assert ahead.claim(key("a")) is None  # taken once
    assert closed == []  # the taker owns it now
    assert ahead.report() == {"taken": 1, "missed": 0, "ready": 0, "bytes": 0}


def test_a_read_that_comes_first_opens_its_own_and_the_pass_leaves_it() -> None:
    ahead, _, _ = store()
    ahead.plan([(key("a"), 10)])
    assert ahead.claim(key("a")) is None  # not opened yet: the read opens it itself
    assert not ahead.begin(key("a"))  # so the pass does not
    assert len(ahead) == 0
    assert ahead.report()["missed"] == 1


def test_a_read_that_comes_while_the_pass_opens_it_gets_none_and_the_passs_copy_is_closed() -> None:
    ahead, _, closed = store()
    ahead.plan([(key("a"), 10)])
    assert ahead.begin(key("a"))
    assert ahead.claim(key("a")) is None
    ahead.offer(key("a"), "late", lambda: closed.append("a"))
    assert closed == ["a"]
    assert len(ahead) == 0 and ahead.report()["bytes"] == 0


def test_only_the_exact_call_takes_an_entry() -> None:
    ahead, _, _ = store()
    ahead.plan([(key("a"), 10)])
    assert ahead.begin(key("a"))
    ahead.offer(key("a"), "opened", lambda: None)
    assert ahead.claim((b"a", ("map", 1))) is None  # another range or form: not this entry
    assert ahead.claim((b"b", ("map", 0))) is None
    assert ahead.claim(key("a")) == "opened"


def test_the_pass_stops_at_the_byte_limit_and_the_rest_is_read_the_ordinary_way() -> None:
    ahead, _, _ = store(limit=25)
    ahead.plan([(key("a"), 10), (key("b"), 10), (key("c"), 10)])
    assert ahead.begin(key("a")) and ahead.begin(key("b"))
    assert not ahead.begin(key("c"))  # 30 > 25
    assert ahead.claim(key("c")) is None and ahead.report()["missed"] == 0  # dropped, not missed
    ahead.offer(key("a"), "a", lambda: None)
    assert ahead.report()["bytes"] == 20
    assert ahead.claim(key("a")) == "a"
    assert ahead.report()["bytes"] == 10  # room again once taken


def test_what_nobody_takes_is_closed_at_the_next_plan_after_max_age() -> None:
    ahead, clock, closed = store(max_age=30)
    ahead.plan([(key("a"), 10), (key("b"), 10)])
    assert ahead.begin(key("a"))
    ahead.offer(key("a"), "a", lambda: closed.append("a"))
    clock.now += 31
    ahead.plan([(key("c"), 10)])
    assert closed == ["a"]
    assert ahead.report() == {"taken": 0, "missed": 0, "ready": 0, "bytes": 0}
    assert len(ahead) == 1  # c


def test_drop_closes_a_digests_entries_at_once() -> None:
    ahead, _, closed = store()
    ahead.plan([(key("a"), 10), (key("b"), 10)])
    for name in ("a", "b"):
        assert ahead.begin(key(name))
        ahead.offer(key(name), name, lambda name=name: closed.append(name))  # type: ignore[misc]
    ahead.drop(b"a")
    assert closed == ["a"]
    assert ahead.claim(key("a")) is None and ahead.claim(key("b")) == "b"
    ahead.clear()
    assert closed == ["a"]  # b was taken: its owner closes it


def test_a_failed_open_is_left_to_its_read() -> None:
    ahead, _, _ = store()
    ahead.plan([(key("a"), 10)])
    assert ahead.begin(key("a"))
    ahead.abandon(key("a"))
    assert ahead.claim(key("a")) is None
    assert ahead.report() == {"taken": 0, "missed": 0, "ready": 0, "bytes": 0}
