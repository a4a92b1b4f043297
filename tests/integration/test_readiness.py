"""``/readyz`` checks what it claims, names the part that failed, and takes a gateway out of service only for
its own faults (``gateway.readiness``); control-plane errors carry a request id."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx

from tests.conftest import ServerProcess, wait_for


def readyz(server: ServerProcess) -> httpx.Response:
    return httpx.get(f"{server.url}/readyz", timeout=10)


def test_ready_when_every_part_works(server: ServerProcess) -> None:
    r = readyz(server)
    assert r.status_code == 200
    checks = r.json()["checks"]
    assert r.json()["ready"] is True
    assert {k: checks[k] for k in ("index", "fs", "catalog")} == {"index": "ok", "fs": "ok", "catalog": "ok"}


def test_a_lost_index_is_rebuilt_and_readiness_says_so(server: ServerProcess) -> None:
    with httpx.Client(headers=server.auth, timeout=30) as client:
        for i in range(5):
            assert client.put(server.chunk_url(f"kept-{i}"), content=b"x" * 1000).status_code == 201
    server.stop()
    shutil.rmtree(server.data_dir / "index")
    server.start()
    wait_for(lambda: readyz(server).json()["checks"].get("rebuild", "").startswith("done: "),
             "readyz reports the finished rebuild")
    rebuilt = readyz(server).json()["checks"]["rebuild"]
    assert int(rebuilt.split()[1]) >= 5  # every chunk of the tier found again
    with httpx.Client(headers=server.auth, timeout=30) as client:
        listed = client.post(f"{server.url}/v1/buckets/kvcache/exists",
                             json={"keys": [f"kept-{i}" for i in range(5)]}).json()
    assert listed == {"exists": [True] * 5}


def test_a_removed_index_directory_is_not_ready(server: ServerProcess) -> None:
    shutil.rmtree(server.data_dir / "index")
    wait_for(lambda: readyz(server).status_code == 503, "readyz turns 503 once the index directory is gone")
    checks = readyz(server).json()["checks"]
    assert checks["index"].startswith("error: the index directory") and checks["fs"] == "ok"


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem refuses more; the file."""
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * (64 << 10))
        except OSError:
            pass
    return ballast


def readiness_metric(server: ServerProcess) -> dict[tuple[str, str], float]:
    """``kvgw_readiness{check, state}`` as /metrics reports it now."""
    text = httpx.get(f"{server.url}/metrics", headers=server.auth, timeout=30).text
    return {(check, state): float(value) for check, state, value in
            re.findall(r'^kvgw_readiness\{check="(\w+)",state="(\w+)"\} (\S+)$', text, re.M)}


def test_a_full_tier_stays_ready_reads_go_on_writes_are_507(
    server_factory: type[ServerProcess], tmp_path: Path, small_fs: Path
) -> None:
    """A full filesystem tier (a real 8 MiB tmpfs filled to the last block) is every gateway's on a shared
    NFS tier: taking them out of service would stop the reads that still work. Ready, and it says so."""
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_FS_ROOT": str(small_fs),
                                                          "KVGW_DEFAULT_CAPACITY_FRACTION": "0"}).start()
    stored = os.urandom(1 << 20)
    with httpx.Client(headers=server.auth, timeout=30) as client:
        assert client.put(server.chunk_url("stored"), content=stored).status_code == 201
        assert readyz(server).status_code == 200
        ballast = fill(small_fs)
        try:
            wait_for(lambda: readyz(server).json()["checks"]["fs"].startswith("full: "), "readyz says fs: full")
            r = readyz(server)
            assert r.status_code == 200 and r.json()["ready"] is True
            assert "writes answer 507" in r.json()["checks"]["fs"]
            assert client.get(server.chunk_url("stored")).content == stored  # reads go on
            put = client.put(server.chunk_url("new"), content=os.urandom(1 << 20))
            assert put.status_code == 507 and put.json()["error"]["code"] == "InsufficientStorage"
            assert client.head(server.chunk_url("new")).status_code == 404
            metric = readiness_metric(server)
            assert metric[("fs", "full")] == 1.0 and metric[("fs", "ok")] == 0.0 and metric[("fs", "error")] == 0.0
        finally:
            ballast.unlink()
        wait_for(lambda: readyz(server).json()["checks"]["fs"] == "ok", "readyz says fs: ok once there is room")
        assert client.put(server.chunk_url("new"), content=os.urandom(1 << 20)).status_code == 201
        assert readiness_metric(server)[("fs", "ok")] == 1.0


def test_a_tier_that_cannot_be_written_is_not_ready(server: ServerProcess) -> None:
    """The gateway's own fault (here its staging directory is gone, as when a mount disappears): out."""
    shutil.rmtree(server.data_dir / "fs" / "staging")
    wait_for(lambda: readyz(server).status_code == 503, "readyz turns 503")
    assert readyz(server).json()["checks"]["fs"].startswith("error: cannot write in")
    assert readiness_metric(server)[("fs", "error")] == 1.0


def test_control_plane_errors_have_request_ids(server: ServerProcess) -> None:
    for r, status, code in (
        (httpx.get(f"{server.url}/v1/admin/nope"), 404, "NotFound"),
        (httpx.get(f"{server.url}/v1/admin/stats"), 401, "Unauthorized"),
        (httpx.delete(f"{server.url}/healthz"), 405, "MethodNotAllowed"),
    ):
        assert r.status_code == status
        error = r.json()["error"]
        assert error["code"] == code and error["request_id"] == r.headers["x-kvgw-request-id"]
