"""Read leases granted in memory (issue 31, item 5) against the lifecycle leader on another gateway: real
``kvgw serve`` processes on one directory and one PostgreSQL catalog.

- A grant racing an eviction pass: gateway B (two worker processes, each granting on its own) leases the
  chunks the leader's FIFO eviction on gateway A takes next, while writes through B keep the bucket over
  its watermark; every chunk a lookup answered present and leased loads (no 404) while its lease runs,
  and the leader's stats show claims that a grant not yet written overrode (the window was exercised).
- A gateway SIGKILLed right after granting, before writing its grants: the leader removes none of the
  leased chunks while the dead process's ``quiet_at`` has not passed (the database's clock), then
  evicts them.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from backends.posix import PosixTier
from kvgw_client.keys import chunk_digest
from tests.conftest import ServerProcess, wait_for
from tests.integration.cluster.conftest import Launch
from tests.integration.cluster.test_lifecycle_leader import FAST, _make_bucket, _stats

KiB = 1 << 10
MiB = 1 << 20


def _leases(server: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = _stats(server)["leases"]
    return doc


def test_a_grant_racing_an_eviction_pass_on_another_gateway_holds(launch: Launch, cluster_env: dict[str, str]) -> None:
    a = launch("a", **FAST, KVGW_WORKERS="1")
    wait_for(lambda: _stats(a)["lifecycle_leader"]["leader"], "gateway a leads the lifecycle")
    b = launch("b", **FAST, KVGW_WORKERS="2")  # started second: never the leader while a renews
    chunk = 256 * KiB
    _make_bucket(cluster_env, b, "race", "--capacity-bytes", str(8 * MiB), "--eviction-policy", "fifo",
                 "--max-lease-ms", "10000", "--max-leased-bytes", str(8 * MiB))
    written = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        body = os.urandom(chunk)
        try:
            with httpx.Client(headers=b.auth, timeout=60) as c:
                while not stop.is_set():
                    r = c.put(b.chunk_url(f"w-{written[0]}", bucket="race"), content=body)
                    assert r.status_code == 201, r.text
                    written[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    leased: collections.deque[tuple[float, list[str]]] = collections.deque()  # (looked up at, keys leased)
    loaded: dict[str, float] = {}  # key -> when it was last loaded
    loads = failed = 0
    failures: list[str] = []
    try:
        with httpx.Client(headers=b.auth, timeout=30) as c:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not errors:
                n = written[0]
                window = [f"w-{i}" for i in range(max(0, n - 34), max(0, n - 18))]  # FIFO's next victims
                sent = time.monotonic()
                r = c.post(f"{b.url}/v1/buckets/race/exists", json={"keys": window, "lease_ms": 5000})
                assert r.status_code == 200, r.text
                doc = r.json()
                if doc["lease"]["granted_ms"]:
                    leased.append((sent, [k for k, hit in zip(window, doc["exists"], strict=True) if hit]))
                # load what was leased a second ago (well inside its 5 s): the lease must have held, unless
                # a load since that lookup ended it (a load ends a chunk's lease, whoever leased it)
                while leased and time.monotonic() - leased[0][0] >= 1.0:
                    looked_up, keys = leased.popleft()
                    for key in keys:
                        if loaded.get(key, -1.0) >= looked_up:
                            continue
                        loaded[key] = time.monotonic()
                        loads += 1
                        got = c.get(b.chunk_url(key, bucket="race"))
                        if got.status_code != 200:
                            failed += 1
                            failures.append(f"{key}: {got.status_code} {got.text[:200]}")
                if loads >= 300:
                    stats = _leases(a)
                    if stats["claims_contested"] >= 3 and _stats(a)["lifecycle"]["evicted"] >= 200:
                        break
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors
    assert failed == 0, f"{failed} of {loads} leased chunks did not load: {failures[:10]}"
    stats, lifecycle = _leases(a), _stats(a)["lifecycle"]
    # the race happened: the leader claimed chunks B had leased and not yet written, and gave them up
    assert stats["claims_contested"] >= 3, stats
    assert lifecycle["evicted"] >= 200, lifecycle  # and eviction went on around the leases
    assert loads >= 300


def test_a_gateway_killed_right_after_granting_holds_its_leases_until_its_quiet_time(
        launch: Launch, cluster_env: dict[str, str]) -> None:
    a = launch("a", **FAST, KVGW_WORKERS="1")
    wait_for(lambda: _stats(a)["lifecycle_leader"]["leader"], "gateway a leads the lifecycle")
    b = launch("b", **FAST, KVGW_WORKERS="1", KVGW_LEASE_SYNC_SECONDS="1.0")  # grants unwritten for up to 1 s
    chunk = 512 * KiB
    _make_bucket(cluster_env, b, "crash", "--capacity-bytes", str(8 * MiB), "--eviction-policy", "fifo",
                 "--max-lease-ms", "10000", "--max-leased-bytes", str(8 * MiB))
    keys = [f"c-{i}" for i in range(12)]  # 6 MiB: under the high watermark (7.2 MiB): no claims yet
    with httpx.Client(headers=b.auth, timeout=30) as c:
        for key in keys:
            assert c.put(b.chunk_url(key, bucket="crash"), content=os.urandom(chunk)).status_code == 201
    with httpx.Client(headers=a.auth, timeout=30) as c:
        wait_for(lambda: all(c.head(a.chunk_url(k, bucket="crash")).status_code == 200 for k in keys),
                 "a's index holds b's chunks (the feed)")
    oldest = keys[:4]  # FIFO's first victims
    member = _stats(b)["cluster"]["member"]  # one worker: the process that grants
    wait_for(lambda: (_leases(b)["synced_s_ago"] or 9.0) < 0.2, "b synced a moment ago", interval=0.01)
    with httpx.Client(headers=b.auth, timeout=30) as c:
        r = c.post(f"{b.url}/v1/buckets/crash/exists", json={"keys": oldest, "lease_ms": 5000})
    assert b.proc is not None
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait(10)
    assert r.json() == {"exists": [True] * 4, "lease": {"granted_ms": 5000, "chunks": 4, "bytes": 4 * chunk}}
    engine = create_engine(cluster_env["KVGW_CATALOG_URL"])
    digests = [chunk_digest("crash", k) for k in oldest]
    paths = [PosixTier(Path(cluster_env["KVGW_FS_ROOT"]), fsync=False).path_for(d) for d in digests]

    def db_now() -> float:
        with engine.connect() as conn:
            return float(conn.execute(text("SELECT extract(epoch from statement_timestamp())")).scalar_one())

    try:
        with engine.connect() as conn:
            written = conn.execute(text("SELECT count(*) FROM chunk_leases WHERE digest = ANY(:d) AND kind = 0"),
                                   {"d": digests}).scalar_one()
            quiet_at = float(conn.execute(text("SELECT quiet_at FROM lease_members WHERE member = :m"),
                                          {"m": member}).scalar_one())
        assert written == 0, "b wrote its grants before it was killed: the test did not reach the crash path"
        with httpx.Client(headers=a.auth, timeout=30) as c:  # over the watermark: the leader must evict
            for i in range(6):
                assert c.put(a.chunk_url(f"more-{i}", bucket="crash"), content=os.urandom(chunk)).status_code == 201
        checks = [0]

        def held_until_quiet() -> bool:  # all four stay until b's unwritten leases may have ended
            assert all(os.path.exists(p) for p in paths), "the leader removed a chunk b had leased"
            checks[0] += 1
            return db_now() >= quiet_at - 0.2

        wait_for(held_until_quiet, "b's quiet_at", timeout=60)
        assert checks[0] > 1
        assert _leases(a)["claim_timeouts"] >= 1  # the leader did try to remove them meanwhile
        wait_for(lambda: not any(os.path.exists(p) for p in paths), "then the leader evicts them", timeout=60)
    finally:
        engine.dispose()
