"""The leases one process holds in memory (``gateway.leases.local``), pure logic with injected clocks: what
a grant needs before it can be made without waiting, and the ordering the lifecycle leader relies on
(every grant made before this process knew of a claim goes out in a batch that reports ``seen`` at least
that claim's number)."""

from __future__ import annotations

from gateway.leases.local import (
    HORIZON_KEEP_SECONDS,
    QUOTA_RETRY_SECONDS,
    REFUSED_UNREACHABLE,
    RELEASED,
    REMOVED,
    REMOVING,
    LeaseGrant,
    LocalLeases,
    SyncResult,
    Wait,
)

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


class Clocks:
    def __init__(self) -> None:
        self.wall = 1_000_000.0
        self.mono = 100.0


def book(clocks: Clocks) -> LocalLeases:
    return LocalLeases(clock=lambda: clocks.wall, monotonic=lambda: clocks.mono, fresh_seconds=2.0, horizon_ms=10_000)


def synced(leases: LocalLeases, *, log: list[tuple[int, bytes, int, float]] | None = None, head: int = 0,
           quotas: dict[str, int | None] | None = None) -> SyncResult:
    """One sync: take a batch, apply what the table answered."""
    batch = leases.take()
    result = SyncResult(head=head, log=log or [], view=[] if batch.seen < 0 else None, released=set(),
                        quotas=quotas or {})
    leases.apply(batch, result)
    return result


def grant(leases: LocalLeases, *digests: bytes, ms: int = 5_000, cap: int | None = None,
          recheck: bool = False) -> LeaseGrant | Wait:
    return leases.grant("bkt", list(digests), [100] * len(digests), ms, cap, recheck=recheck)


def test_nothing_is_granted_before_the_first_sync() -> None:
    clocks = Clocks()
    leases = book(clocks)
    assert isinstance(grant(leases, A), Wait)
    synced(leases)
    out = grant(leases, A, B)
    assert isinstance(out, LeaseGrant) and (out.granted_ms, out.leased, out.leased_bytes) == (5_000, 2, 200)
    assert leases.leased_here(A, clocks.wall + 4.9) and not leases.leased_here(A, clocks.wall + 5.0)


def test_grants_stop_once_the_last_sync_is_older_than_the_freshness_bound() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    clocks.mono += 1.9
    assert isinstance(grant(leases, A), LeaseGrant) and grant(leases, A).granted_ms  # type: ignore[union-attr]
    clocks.mono += 0.2  # 2.1 s after the sync was taken
    assert grant(leases, B) == LeaseGrant(refused=REFUSED_UNREACHABLE)
    synced(leases)
    assert isinstance(grant(leases, B), LeaseGrant)


def test_a_lease_longer_than_the_announced_horizon_waits_for_a_sync_announcing_it() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    wait = grant(leases, A, ms=60_000)
    assert isinstance(wait, Wait) and wait.horizon_ms == 60_000
    leases.want(wait)
    batch = leases.take()
    assert batch.horizon_ms == 60_000  # the catalog's quiet_at then covers it
    leases.apply(batch, SyncResult(0, [], None, set(), {}))
    assert isinstance(grant(leases, A, ms=60_000), LeaseGrant)
    clocks.mono += HORIZON_KEEP_SECONDS + 1  # no long lease asked for since: the next sync announces 10 s
    synced(leases)
    assert leases.horizon_ms == 10_000 and isinstance(grant(leases, A, ms=60_000), Wait)


def test_a_grant_made_before_a_claim_was_known_goes_out_with_a_seen_at_least_that_claim() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    first = leases.take()  # a sync is taken (seen 0) and sent...
    assert first.seen == 0
    assert isinstance(grant(leases, A), LeaseGrant)  # ...a lookup leases A, not knowing the claim below...
    leases.apply(first, SyncResult(1, [(1, A, REMOVING, clocks.wall + 120)], None, set(), {}))  # ...claim 1 learnt
    second = leases.take()
    assert second.seen == 1 and A in second.grants  # the acknowledgement of claim 1 carries the grant on A
    out = grant(leases, A, B)  # from now on A is answered absent, never leased
    assert isinstance(out, LeaseGrant) and out.gone == {A} and out.leased == 1


def test_claims_removed_lately_need_a_recheck_and_let_go_claims_are_forgotten() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    log = [(1, A, REMOVING, clocks.wall + 120), (1, B, REMOVING, clocks.wall + 120),
           (2, A, REMOVED, clocks.wall + 60), (3, B, RELEASED, clocks.wall)]
    synced(leases, log=log, head=3)
    assert isinstance(grant(leases, A), Wait)  # removed lately: only the async path, which re-checks
    out = grant(leases, A, B, recheck=True)
    assert isinstance(out, LeaseGrant) and out.recheck == {A} and not out.gone and out.leased == 2
    clocks.wall += 61  # the removal is no longer remembered
    synced(leases, head=3)
    out = grant(leases, A)
    assert isinstance(out, LeaseGrant) and not out.recheck


def test_a_capped_bucket_grants_within_this_processs_share() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    wait = grant(leases, A, cap=1_000)
    assert isinstance(wait, Wait) and (wait.bucket, wait.demand, wait.cap) == ("bkt", 100, 1_000)  # no share yet
    leases.want(wait)
    batch = leases.take()
    assert batch.quotas["bkt"].demand == 100 and batch.quotas["bkt"].cap == 1_000
    leases.apply(batch, SyncResult(0, [], None, set(), {"bkt": 250}))
    assert isinstance(grant(leases, A, B, cap=1_000), LeaseGrant)  # 200 of 250
    assert isinstance(grant(leases, A, cap=1_000), LeaseGrant)  # leased already: costs nothing
    assert isinstance(grant(leases, C, cap=1_000), Wait)  # 300 > 250: ask for more
    leases.want(Wait("", bucket="bkt", demand=100, cap=1_000))
    batch = leases.take()
    leases.apply(batch, SyncResult(0, [], None, set(), {"bkt": 250}))  # the cap is spoken for: no more
    refused = grant(leases, C, cap=1_000)
    assert isinstance(refused, LeaseGrant) and refused.refused is not None and "cap" in refused.refused
    clocks.mono += 2 * QUOTA_RETRY_SECONDS
    assert isinstance(grant(leases, C, cap=1_000), Wait)  # a while later: ask again


def test_expired_and_loaded_leases_free_the_share_and_a_load_ends_the_lease_in_the_next_batch() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases, quotas={})
    leases.apply(leases.take(), SyncResult(0, [], None, set(), {}))
    leases.want(Wait("", bucket="bkt", demand=200, cap=200))
    batch = leases.take()
    leases.apply(batch, SyncResult(0, [], None, set(), {"bkt": 200}))
    assert isinstance(grant(leases, A, B, cap=200), LeaseGrant)
    leases.loaded("bkt", [(A, 100)])  # loaded before the grant was written: it is cancelled, not written
    batch = leases.take()
    assert set(batch.grants) == {B} and batch.cancelled == {A}
    assert isinstance(grant(leases, C, cap=200), LeaseGrant)  # A's bytes are free again
    clocks.wall += 5.0  # B and C run out
    assert isinstance(grant(leases, A, B, cap=200), LeaseGrant)


def test_a_failed_sync_sends_its_grants_and_releases_again() -> None:
    clocks = Clocks()
    leases = book(clocks)
    synced(leases)
    grant(leases, A, B)
    leases.loaded("bkt", [(B, 100)])
    failed = leases.take()
    leases.requeue(failed)
    again = leases.take()
    assert set(again.grants) == {A} and again.cancelled == {B}
