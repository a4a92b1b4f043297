"""The lifecycle lease on a real catalog, SQLite and PostgreSQL: one holder at a time, renewal, take-over
when it expires, exactly one winner among racing challengers, release; and the holder's fencing: its
term runs out by its own clock before anyone can take the row (injected clocks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from backends.catalog.store import Catalog
from gateway.cluster.leader import LIFECYCLE_LEASE, Leadership, LeaseStore


class Clock:
    def __init__(self, now: float = 5000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'catalog.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    catalog = Catalog(url, None)
    catalog.upgrade()
    yield catalog.engine
    catalog.close()


def test_one_holder_renewal_expiry_and_take_over(engine: Engine) -> None:
    wall = Clock()
    store = LeaseStore(engine, wall=wall)
    a = store.acquire(LIFECYCLE_LEASE, "a", None, 5.0)
    assert a is not None and (a.holder, a.epoch, a.expires_at) == ("a", 1, 5005.0)
    assert store.acquire(LIFECYCLE_LEASE, "b", None, 5.0) is None  # held
    wall.now += 3
    renewed = store.acquire(LIFECYCLE_LEASE, "a", 1, 5.0)
    assert renewed is not None and (renewed.epoch, renewed.expires_at) == (1, 5008.0)  # same term
    wall.now += 4.9
    assert store.acquire(LIFECYCLE_LEASE, "b", None, 5.0) is None  # 0.1 s left
    wall.now += 0.1
    b = store.acquire(LIFECYCLE_LEASE, "b", None, 5.0)  # expired: taken over, a new term
    assert b is not None and (b.holder, b.epoch) == ("b", 2)
    assert store.acquire(LIFECYCLE_LEASE, "a", 1, 5.0) is None  # a's renewal of term 1 fails
    lease, now = store.read(LIFECYCLE_LEASE)
    assert lease == b and now == wall.now


def test_release_lets_another_take_over_at_once(engine: Engine) -> None:
    wall = Clock()
    store = LeaseStore(engine, wall=wall)
    a = store.acquire(LIFECYCLE_LEASE, "a", None, 60.0)
    assert a is not None
    assert not store.release(LIFECYCLE_LEASE, "a", a.epoch + 1)  # not the term it holds
    assert store.release(LIFECYCLE_LEASE, "a", a.epoch)
    b = store.acquire(LIFECYCLE_LEASE, "b", None, 60.0)
    assert b is not None and b.epoch == 2


def test_the_database_clock_times_the_lease(engine: Engine) -> None:
    store = LeaseStore(engine)  # no injected clock: expires_at is the database's now + lease
    a = store.acquire(LIFECYCLE_LEASE, "a", None, 30.0)
    lease, db_now = store.read(LIFECYCLE_LEASE)
    assert a is not None and lease == a
    assert 29.0 < a.expires_at - db_now <= 30.0
    assert store.acquire(LIFECYCLE_LEASE, "b", None, 30.0) is None
    renewed = store.acquire(LIFECYCLE_LEASE, "a", a.epoch, 30.0)
    assert renewed is not None and renewed.epoch == a.epoch and renewed.expires_at >= a.expires_at


def test_racing_challengers_of_an_expired_lease_elect_exactly_one(engine: Engine) -> None:
    wall = Clock()
    store = LeaseStore(engine, wall=wall)
    assert store.acquire(LIFECYCLE_LEASE, "dead", None, 5.0) is not None
    wall.now += 10  # the holder died: its lease expired
    results: dict[str, object] = {}
    start = threading.Barrier(8)

    def challenge(name: str) -> None:
        start.wait()
        try:
            results[name] = store.acquire(LIFECYCLE_LEASE, name, None, 5.0)
        except Exception as exc:  # SQLite: a writer that waited past busy_timeout
            results[name] = exc

    threads = [threading.Thread(target=challenge, args=(f"c{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [name for name, got in results.items() if got is not None and not isinstance(got, Exception)]
    assert len(results) == 8 and len(winners) == 1
    lease, _ = store.read(LIFECYCLE_LEASE)
    assert lease is not None and lease.holder == winners[0] and lease.epoch == 2


class FailingStore(LeaseStore):
    """A catalog that stops answering (a network partition, PostgreSQL down)."""

    down = False

    def acquire(self, name: str, holder: str, epoch: int | None, seconds: float):  # type: ignore[no-untyped-def]
        if self.down:
            raise ConnectionError("catalog unreachable")
        return super().acquire(name, holder, epoch, seconds)


async def test_a_cut_off_leader_stops_before_its_lease_can_be_taken(engine: Engine) -> None:
    """Fencing: the holder counts its term from when it *sent* the renewal, by its own clock. Cut off
    from the catalog, it stops leading no later than the row expires; only then can another take it."""
    wall, mono_a, mono_b = Clock(), Clock(100.0), Clock(900.0)
    store_a = FailingStore(engine, wall=wall)
    store_b = LeaseStore(engine, wall=wall)
    a = Leadership(store_a, "a", lease_seconds=5.0, clock=mono_a)
    b = Leadership(store_b, "b", lease_seconds=5.0, clock=mono_b)
    assert await a.attempt() and a.valid_for() == 5.0
    assert not await b.attempt() and not b.is_leader()

    def tick(seconds: float) -> None:  # real time passes for everyone alike
        for clock in (wall, mono_a, mono_b):
            clock.now += seconds

    tick(1.7)
    assert await a.attempt() and a.valid_for() == 5.0  # renewed
    store_a.down = True
    for n in (1, 2):
        tick(1.7)
        assert await a.attempt()  # fails to renew, still leads: the term is not extended
        assert not await b.attempt()  # the row is still a's
        assert a.valid_for() == pytest.approx(5.0 - 1.7 * n)
    tick(1.7)  # 5.1 s since a's last renewal was sent: the row expired at 5.0 s
    assert a.valid_for() <= 0 and not a.is_leader()
    assert not await a.attempt()
    assert await b.attempt() and b.epoch == 2  # b takes over only now
    store_a.down = False
    assert not await a.attempt() and a.epoch is None  # a learns it lost the term
    await b.stop()  # a clean stop releases the lease
    assert await a.attempt() and a.epoch == 3


async def test_leadership_runs_in_the_background_and_releases_on_stop(engine: Engine) -> None:
    store = LeaseStore(engine)
    a = Leadership(store, "a", lease_seconds=0.6)
    b = Leadership(store, "b", lease_seconds=0.6)
    await a.start()
    await b.start()
    try:
        assert a.is_leader() and not b.is_leader()
        await asyncio.sleep(1.5)  # a renews every 0.2 s
        assert a.is_leader() and a.epoch == 1 and not b.is_leader()
        await a.stop()
        for _ in range(100):
            if b.is_leader():
                break
            await asyncio.sleep(0.05)
        assert b.is_leader() and b.epoch == 2
    finally:
        await a.stop()
        await b.stop()
