"""Issue 11: a gateway that joins starts from the index snapshot the lifecycle leader shares in the
directory, not by reading every chunk's footer; it then catches up from the feed (changes made after the
snapshot, deletes too). A damaged snapshot is never used (the joiner resyncs from the tiers instead).
Real gateway processes, one shared directory, the real PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from gateway.cluster.snapshot import snapshot_path
from tests.conftest import ServerProcess, wait_for
from tests.integration.cluster.conftest import Launch
from tests.integration.cluster.test_lifecycle_leader import _stats, _write

ONE = {"KVGW_WORKERS": "1", "KVGW_CLUSTER_SNAPSHOT_SECONDS": "0.5"}
KiB = 1 << 10


def _feed(server: ServerProcess) -> dict[str, Any]:
    feed: dict[str, Any] = _stats(server)["cluster"]["feed"]
    return feed


def test_a_joining_gateway_starts_from_the_shared_snapshot(launch: Launch, cluster_env: dict[str, str]) -> None:
    first = launch("a", **ONE)
    _write(first, "kvcache", "before-", 40, 16 * KiB)
    fs_root = Path(cluster_env["KVGW_FS_ROOT"])
    wait_for(lambda: (_feed(first)["last_snapshot"] or {}).get("records", 0) >= 40, "a snapshot of 40 chunks")
    # after the snapshot: new chunks and a delete, which the joiner learns from the feed
    _write(first, "kvcache", "after-", 5, 16 * KiB)
    with httpx.Client(headers=first.auth, timeout=30) as c:
        assert c.delete(first.chunk_url("before-0")).status_code == 204
    assert snapshot_path(fs_root).is_file()

    joiner = launch("b", **ONE)
    wait_for(lambda: _feed(joiner)["seeded_from"] is not None or _feed(joiner)["last_resync"] is not None,
             "the joiner found its place in the feed")
    feed = _feed(joiner)
    assert feed["last_resync"] is None  # no tier scan
    assert feed["seeded_from"]["records"] >= 40
    wait_for(lambda: _stats(joiner)["chunks_indexed"] == _stats(first)["chunks_indexed"], "the joiner caught up")
    with httpx.Client(headers=joiner.auth, timeout=30) as c:
        keys = [f"before-{i}" for i in range(40)] + [f"after-{i}" for i in range(5)]
        found = c.post(f"{joiner.url}/v1/buckets/kvcache/exists", json={"keys": keys}).json()["exists"]
        assert found == [False] + [True] * 44
        assert c.get(joiner.chunk_url("before-7")).status_code == 200


def test_a_damaged_snapshot_is_not_used(launch: Launch, cluster_env: dict[str, str]) -> None:
    first = launch("a", **ONE)
    _write(first, "kvcache", "c-", 10, 16 * KiB)
    fs_root = Path(cluster_env["KVGW_FS_ROOT"])
    wait_for(lambda: (_feed(first)["last_snapshot"] or {}).get("records", 0) >= 10, "a snapshot")
    first.stop()  # no new snapshot replaces the damaged one below
    path = snapshot_path(fs_root)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    joiner = launch("b", **ONE)
    wait_for(lambda: _feed(joiner)["last_resync"] is not None, "the joiner resynced from the tiers")
    assert _feed(joiner)["seeded_from"] is None
    assert _stats(joiner)["chunks_indexed"] >= 10
