"""``HeldLeases``: which lookups may skip asking for a read lease because an earlier one still covers
every key (pure logic, an injected clock)."""

from __future__ import annotations

from kvgw_client.direct import Location
from kvgw_client.leases import HeldLeases
from tests.unit.client.fakes import Clock


def test_a_lease_covers_its_keys_for_half_its_length_counted_from_the_send() -> None:
    clock = Clock()
    held = HeldLeases(clock)
    held.granted(["a", "b"], sent_at=100.0, granted_ms=5000)  # held until 105.0
    assert held.covers(["a", "b"], 5000) and held.covers(["b"], 5000)
    clock.now = 102.5  # exactly half the lease left
    assert held.covers(["a"], 5000)
    clock.now = 102.6
    assert not held.covers(["a"], 5000)
    assert held.covers(["a"], 4000)  # a shorter lease asked for needs less left


def test_every_key_must_be_covered_and_no_keys_cover_nothing() -> None:
    held = HeldLeases(Clock())
    held.granted(["a"], sent_at=100.0, granted_ms=5000)
    assert not held.covers(["a", "b"], 5000)
    assert not held.covers([], 5000)
    assert not held.covers(["a"], 0)


def test_a_refused_lease_holds_nothing_and_a_shorter_grant_never_shortens_one() -> None:
    clock = Clock()
    held = HeldLeases(clock)
    held.granted(["a"], sent_at=100.0, granted_ms=0)
    assert not held.covers(["a"], 5000) and len(held) == 0
    held.granted(["a"], sent_at=100.0, granted_ms=10_000)  # until 110
    held.granted(["a"], sent_at=101.0, granted_ms=1000)  # until 102: the longer lease still runs
    clock.now = 104.0
    assert held.covers(["a"], 10_000)


def test_a_load_through_the_gateway_forgets_the_lease_it_ends() -> None:
    held = HeldLeases(Clock())
    held.granted(["a", "b"], sent_at=100.0, granted_ms=5000)
    held.forget(["a", "zzz"])
    assert not held.covers(["a"], 5000) and held.covers(["b"], 5000)


def test_the_oldest_grants_are_forgotten_past_the_bound() -> None:
    held = HeldLeases(Clock(), remembered=3)
    held.granted(["a", "b", "c"], sent_at=100.0, granted_ms=5000)
    held.granted(["d"], sent_at=100.5, granted_ms=5000)
    assert len(held) == 3
    assert not held.covers(["a"], 5000) and held.covers(["b", "c", "d"], 5000)


def test_locations_are_known_only_for_leased_keys_with_a_file_and_go_with_the_lease() -> None:
    clock = Clock()
    held = HeldLeases(clock)
    file_a, file_b = Location(10, 1, "chunks/a"), Location(20, 2, "chunks/b")
    held.remember_locations(["a"], [file_a])  # not leased: not kept
    assert held.located(["a"], 5000) is None
    held.granted(["a", "b", "s3"], sent_at=100.0, granted_ms=5000)
    held.remember_locations(["a", "b", "s3", "gone"], [file_a, file_b, Location(5, 3, None), None])
    assert held.located(["b", "a"], 5000) == [file_b, file_a]
    assert held.located(["a", "s3"], 5000) is None  # only S3 holds it: batch-get reads it
    clock.now = 103.0  # the lease no longer covers a read
    assert held.located(["a"], 5000) is None
    clock.now = 100.0
    held.forget(["a"])
    assert held.located(["a"], 5000) is None and held.located(["b"], 5000) == [file_b]
