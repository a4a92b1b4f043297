"""The lease table's shares of a bucket's leased-bytes cap (``gateway.leases.table``), on real SQLite and
PostgreSQL catalogs, driven through two processes' in-memory books (``gateway.leases.local``): the
shares of live processes never add up past the cap, a newcomer gets what nobody holds, a process that
stops holding gives its share back, and a silent process's share counts until its ``quiet_at``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from backends.catalog.store import Catalog
from gateway.leases.local import QUOTA_RETRY_SECONDS, LeaseGrant, LocalLeases, Wait
from gateway.leases.table import QUOTAS, LeaseTable

CAP = 1_000
QUIET = 12.0  # seconds a process's unwritten leases may outlive its last sync (as the syncer announces)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'catalog.sqlite'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    catalog = Catalog(url, None)
    catalog.upgrade()
    yield catalog.engine
    catalog.close()


class Process:
    """One gateway process's book and its view of the table (what its syncer does, one sync at a time)."""

    def __init__(self, engine: Engine, member: str) -> None:
        self.table = LeaseTable(engine, member=member, channel="kvgw_feed_leases")
        self.mono = 100.0
        self.book = LocalLeases(monotonic=lambda: self.mono)
        self.sync()

    def sync(self, quiet: float = QUIET) -> None:
        batch = self.book.take()
        self.book.apply(batch, self.table.sync(batch, quiet))

    def lease(self, digests: list[bytes], size: int) -> LeaseGrant:
        """What the async grant does: the in-memory grant, or a sync asking for what it lacks, then again
        (a while after the last: a share the cap left no room to grow is not asked again at once)."""
        self.mono += 2 * QUOTA_RETRY_SECONDS
        for _ in range(2):
            out = self.book.grant("bkt", digests, [size] * len(digests), 5_000, CAP, recheck=True)
            if isinstance(out, LeaseGrant):
                return out
            self.book.want(out)
            self.sync()
        out = self.book.grant("bkt", digests, [size] * len(digests), 5_000, CAP, recheck=True)
        return self.book.wait_refusal(out) if isinstance(out, Wait) else out


def shares(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {m: int(b) for m, b in conn.execute(select(QUOTAS.c.member, QUOTAS.c.bytes))}


def digests(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + bytes([i]) * 15 for i in range(n)]


def test_the_shares_of_live_processes_never_pass_the_cap(engine: Engine) -> None:
    a, b = Process(engine, "a"), Process(engine, "b")
    first = a.lease(digests(b"a", 6), 100)  # 600 of 1000: a's share grows to what it asked
    assert first.granted_ms and shares(engine)["a"] >= 600
    refused = b.lease(digests(b"b", 6), 100)  # 600 more would pass the cap: b gets what is left, no more
    assert refused.granted_ms == 0 and refused.refused is not None and "cap" in refused.refused
    assert sum(shares(engine).values()) <= CAP
    fits = b.lease(digests(b"b", 4), 100)  # what a does not hold fits
    assert fits.granted_ms and sum(shares(engine).values()) <= CAP
    a.book.loaded("bkt", [(d, 100) for d in digests(b"a", 6)])  # a's leases end: its next rebalance gives back
    a.book.want(Wait("", bucket="bkt", demand=0, cap=CAP))
    a.sync()
    assert "a" not in shares(engine)
    again = b.lease(digests(b"c", 6), 100)  # now b can hold 1000
    assert again.granted_ms and sum(shares(engine).values()) <= CAP


def test_a_silent_processs_share_counts_until_its_quiet_time(engine: Engine) -> None:
    a, b = Process(engine, "a"), Process(engine, "b")
    assert a.lease(digests(b"a", 9), 100).granted_ms  # 900 of 1000
    assert b.lease(digests(b"b", 2), 100).granted_ms == 0  # a may still hold its 900 unwritten: refused
    a.sync(quiet=0.0)  # a's last word: nothing of it is in force past now (as after its quiet_at)
    assert b.lease(digests(b"b", 2), 100).granted_ms
