"""A batch-get's chunks are opened ahead by one worker-thread pass (``backends.read_ahead``) while the
first frame is sent, and each later frame takes its chunk from there: on a real ``kvgw serve``, for
every form a read takes (a mapping for a verifying reader on loopback, a mapping verified against the
checksum for a reader that does not verify, an open file for ``sendfile``). A chunk deleted while it
waits opened is not served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgw_client import wire
from tests.conftest import ServerProcess, wait_for

VERIFYING = {wire.H_VERIFY: wire.VERIFY_XXH3}
SIZE = 8 << 20
COUNT = 6  # more than the sockets between the gateway and a reader that waits hold: the batch waits too


@pytest.fixture(params=["always", "auto"], ids=["sendfile", "mapped"])
def server(request: pytest.FixtureRequest, server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    return server_factory(data_dir=tmp_path / "data", env={"KVGW_SEND_FILES": request.param}).start()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30.0) as c:
        yield c


def read_ahead(client: httpx.Client) -> dict[str, int]:
    report: dict[str, int] = client.get("/v1/admin/stats").json()["fs_read_ahead"]
    return report


def opened_ahead(client: httpx.Client) -> int:
    """Once the batch waits for its reader (every chunk claimed by its frame or opened by the pass),
    how many wait opened ahead (0 until then)."""
    report = read_ahead(client)
    settled = report["ready"] + report["missed"] + report["taken"] == COUNT
    return report["ready"] if settled else 0


def frames(body: bytes) -> list[tuple[int, bytes]]:
    parser = wire.BatchParser()
    got = [(frame.status, frame.payload) for frame in parser.feed(body)]
    assert parser.complete
    return got


@pytest.mark.parametrize("verifying", [True, False], ids=["reader-verifies", "server-verifies"])
def test_later_frames_are_served_from_chunks_opened_ahead(client: httpx.Client, server: ServerProcess,
                                                         verifying: bool) -> None:
    chunks = [os.urandom(SIZE) for _ in range(COUNT)]
    for i, data in enumerate(chunks):
        assert client.put(server.chunk_url(f"c{i}"), content=data).status_code == 201
    keys = [f"c{i}" for i in range(COUNT)]
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30.0) as reader, reader.stream(
            "POST", "/v1/buckets/kvcache/batch-get", json={"keys": keys},
            headers=VERIFYING if verifying else {}) as answer:
        assert answer.status_code == 200
        # the batch waits for this reader on an early frame; the pass opens the later ones meanwhile
        wait_for(lambda: opened_ahead(client) >= 1, "the later chunks opened ahead")
        ready = read_ahead(client)["ready"]
        body = answer.read()
    assert frames(body) == [(wire.FRAME_OK, data) for data in chunks]
    report = read_ahead(client)
    assert report["taken"] >= ready
    assert (report["ready"], report["bytes"]) == (0, 0)  # nothing left open
    metrics = client.get("/metrics").text
    assert f'kvgw_fs_read_ahead_frames_total{{outcome="taken"}} {float(report["taken"])}' in metrics
    assert "kvgw_fs_read_ahead_bytes 0.0" in metrics


def test_a_chunk_deleted_while_opened_ahead_is_not_served(client: httpx.Client, server: ServerProcess) -> None:
    chunks = [os.urandom(SIZE) for _ in range(COUNT)]
    for i, data in enumerate(chunks):
        assert client.put(server.chunk_url(f"d{i}"), content=data).status_code == 201
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30.0) as reader, reader.stream(
            "POST", "/v1/buckets/kvcache/batch-get", json={"keys": [f"d{i}" for i in range(COUNT)]},
            headers=VERIFYING) as answer:
        wait_for(lambda: opened_ahead(client) >= 1, "the later chunks opened ahead")
        before = read_ahead(client)
        assert client.delete(server.chunk_url(f"d{COUNT - 1}")).status_code == 204  # the last: opened ahead
        after = read_ahead(client)
        # the deleted chunk is let go; the sender may meanwhile have taken a few more for its frames
        # (on a slow machine it can still be filling the socket's buffers when the pass has settled)
        assert after["ready"] == before["ready"] - 1 - (after["taken"] - before["taken"])
        body = answer.read()
    got = frames(body)
    assert got[: COUNT - 1] == [(wire.FRAME_OK, data) for data in chunks[: COUNT - 1]]
    assert got[COUNT - 1] == (wire.FRAME_MISSING, b"")
