"""The vLLM tier's parts that need no vLLM (``kvgw_client.tiering``): settings, block names, the per-step
lookup batch (with an injected clock and futures completed by hand), the bounded event queue."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from kvgw_client.changes import Change, ChangePage
from kvgw_client.health import Counters
from kvgw_client.tiering import BlockNames, EventQueue, OwnStores, StepLookups, TierSettings, changes_to_events

NS = "Qwen_Qwen3-8B_0123456789ab_r0"


def test_names_round_trip_and_refuse_other_names() -> None:
    names = BlockNames("/" + NS)  # vLLM's FileMapper path with an empty root starts with "/"
    h = bytes(range(32))
    name = names.name(h, 2)
    assert name == f"{NS}/000/10_g2/{h.hex()}.bin"
    assert names.parse(name) == (h, 2)
    assert BlockNames(f"team//{NS}").namespace == f"team/{NS}"
    for other in (f"{NS}x/000/10_g2/{h.hex()}.bin", f"{NS}/001/10_g2/{h.hex()}.bin", f"{NS}/000/10_g2/zz.bin",
                  f"{NS}/000/10_gx/{h.hex()}.bin", f"{NS}/000/10_g2/{h.hex()}", "elsewhere"):
        assert names.parse(other) is None, other


def test_settings_read_every_key_and_refuse_unknown_ones() -> None:
    s = TierSettings.from_options({"url": "http://gw:8080", "bucket": "vllm-kv", "prefix": "/team/", "ttl_s": 60,
                                   "locality": "local", "enable_kv_events": True, "kv_events": "own"}, {})
    assert (s.prefix, s.ttl, s.locality, s.enable_kv_events, s.kv_events) == ("team", 60, "LOCAL", True, "own")
    assert s.answer_seconds == 2.5  # half the engines' 5 s lease
    with pytest.raises(ValueError, match="unknown kvgw tier settings: ttl"):
        TierSettings.from_options({"url": "http://gw:8080", "ttl": 5}, {})
    with pytest.raises(ValueError, match="kv_events"):
        TierSettings.from_options({"url": "http://gw:8080", "kv_events": "some"}, {})
    with pytest.raises(ValueError, match="locality"):
        TierSettings.from_options({"url": "http://gw:8080", "locality": "NEAR"}, {})


class Asker:
    def __init__(self) -> None:
        self.batches: list[tuple[list[str], cf.Future[list[bool]]]] = []

    def __call__(self, names: list[str]) -> cf.Future[list[bool]]:
        future: cf.Future[list[bool]] = cf.Future()
        self.batches.append((names, future))
        return future


def test_one_batch_per_step_retry_until_answered_then_reused() -> None:
    now = [0.0]
    ask = Asker()
    lookups = StepLookups(ask, 2.0, clock=lambda: now[0])
    assert [lookups.lookup(n) for n in ("a", "b", "a")] == [None, None, None]
    assert ask.batches == []  # nothing goes out before the step ends
    assert lookups.flush() == 2
    names, future = ask.batches[0]
    assert names == ["a", "b"]
    assert lookups.lookup("a") is None and lookups.flush() == 0  # in flight: retry, not asked again
    future.set_result([True, False])
    assert (lookups.lookup("a"), lookups.lookup("b")) == (True, False)
    now[0] = 1.9
    assert lookups.lookup("a") is True and lookups.flush() == 0
    now[0] = 2.1  # past the answer's time: asked again
    assert lookups.lookup("a") is None and lookups.flush() == 1


def test_a_failed_batch_misses_and_learned_answers_stand() -> None:
    ask = Asker()
    lookups = StepLookups(ask, 5.0, clock=lambda: 0.0)
    lookups.lookup("a")
    lookups.flush()
    ask.batches[0][1].set_exception(RuntimeError("client closed"))
    assert lookups.lookup("a") is False
    lookups.learn("a", True)  # stored by this tier meanwhile
    assert lookups.lookup("a") is True
    lookups.lookup("b")
    lookups.learn("b", True)  # asked already: the batch's answer decides
    lookups.flush()
    ask.batches[1][1].set_result([False])
    assert lookups.lookup("b") is False


def test_events_are_bounded_per_step_and_in_total() -> None:
    counters = Counters()
    events = EventQueue(per_step=3, limit=5, counters=counters)
    events.add([("a", False), ("b", False), ("c", True), ("d", False)])
    first = events.take()
    assert [(e.names, e.removed) for e in first] == [(["a", "b"], False), (["c"], True)]
    events.add((n, False) for n in "efgh")  # 5 waiting: d e f g h; one more drops the oldest
    events.add([("i", True)])
    assert counters.get("events.dropped") == 1
    assert [n for e in events.take() for n in e.names] == ["e", "f", "g"]
    assert [n for e in events.take() for n in e.names] == ["h", "i"]
    assert events.take() == []


def test_change_pages_become_events_of_this_namespace_without_own_stores() -> None:
    names = BlockNames(NS)
    mine, theirs, gone = (names.name(bytes([i]) * 32, 0) for i in range(3))
    own = OwnStores()
    own.add([mine])
    page = ChangePage([Change(1, "stored", mine, 0.0, 1), Change(2, "stored", theirs, 0.0, 1),
                       Change(3, "stored", "other/model/x.bin", 0.0, 1), Change(4, "removed", gone, 0.0, 1),
                       Change(5, "removed", mine, 0.0, 1), Change(6, "stored", mine, 0.0, 1)], 6, 6, False)
    assert changes_to_events(page, names, own) == [(theirs, False), (gone, True), (mine, True), (mine, False)]
