"""``/readyz`` checks what it claims and names the part that failed; control-plane errors carry a request id."""

from __future__ import annotations

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


def test_a_full_tier_is_not_ready(server_factory: type[ServerProcess], tmp_path: Path, small_fs: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", env={"KVGW_FS_ROOT": str(small_fs)}).start()
    assert readyz(server).status_code == 200
    ballast = small_fs / "ballast"
    with open(ballast, "wb") as out:
        try:
            while True:
                out.write(b"\0" * (64 << 10))
                out.flush()
        except OSError:
            pass
    try:
        wait_for(lambda: readyz(server).status_code == 503, "readyz turns 503 on a full tier")
        assert readyz(server).json()["checks"]["fs"].startswith("error:")
    finally:
        ballast.unlink()
    wait_for(lambda: readyz(server).status_code == 200, "readyz recovers once there is room again")


def test_control_plane_errors_have_request_ids(server: ServerProcess) -> None:
    for r, status, code in (
        (httpx.get(f"{server.url}/v1/admin/nope"), 404, "NotFound"),
        (httpx.get(f"{server.url}/v1/admin/stats"), 401, "Unauthorized"),
        (httpx.delete(f"{server.url}/healthz"), 405, "MethodNotAllowed"),
    ):
        assert r.status_code == status
        error = r.json()["error"]
        assert error["code"] == code and error["request_id"] == r.headers["x-kvgw-request-id"]
