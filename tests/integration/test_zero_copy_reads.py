"""Reads verified once, at the end that consumes them: a client that says it verifies
(``x-kvgw-verify: xxh3``) gets chunk bytes sent from the chunk file by ``sendfile``, unverified by the
server; a mismatch it reports gets the copy checked and quarantined; other readers keep server-side
verification. On a real ``kvgw serve`` and real files."""

from __future__ import annotations

import os

import httpx
import pytest

from kvgw_client import wire
from kvgw_client.config import ClientSettings
from kvgw_client.errors import ProtocolError
from kvgw_client.framing import ItemStatus
from kvgw_client.http import KvgwClient
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess, wait_for
from tests.integration.test_integrity import chunk_path, flip_byte

VERIFYING = {wire.H_VERIFY: wire.VERIFY_XXH3}
SIZE = 3 << 20  # above the inline-send limit: sent by the sender threads


def exists(client: httpx.Client, server: ServerProcess, key: str) -> bool:
    answer = client.post(f"{server.url}/v1/buckets/kvcache/exists", json={"keys": [key]}).json()
    return bool(answer["exists"][0])


@pytest.mark.parametrize("size", [SIZE, 1000])  # sendfile in a thread / one pread on the event loop
def test_a_verifying_reader_gets_the_file_as_it_is_and_others_get_verified_bytes(
        client: httpx.Client, server: ServerProcess, size: int) -> None:
    data = os.urandom(size)
    assert client.put(server.chunk_url("z"), content=data).status_code == 201
    whole = client.get(server.chunk_url("z"), headers=VERIFYING)
    ranged = client.get(server.chunk_url("z"), headers={**VERIFYING, "Range": "bytes=100-199"})
    assert (whole.status_code, whole.content) == (200, data)
    assert (ranged.status_code, ranged.content) == (206, data[100:200])
    assert whole.headers[wire.H_CHECKSUM] == wire.checksum(data)

    flip_byte(chunk_path(server, "z"), size // 2)  # bitrot behind the gateway's back
    unverified = client.get(server.chunk_url("z"), headers=VERIFYING)
    assert unverified.status_code == 200 and unverified.content != data  # sent as it is: the reader checks
    assert wire.checksum_int(unverified.content) != int(unverified.headers[wire.H_CHECKSUM], 16)
    assert exists(client, server, "z")  # the server read nothing, so it knows nothing yet

    plain = client.get(server.chunk_url("z"))  # a reader that does not verify: the server does
    assert plain.status_code == 404
    assert not chunk_path(server, "z").exists()


def test_kvgw_client_reports_a_damaged_chunk_and_the_gateway_quarantines_it(
        client: httpx.Client, server: ServerProcess) -> None:
    blobs = {key: os.urandom(SIZE) for key in ("d0", "d1", "d2")}
    for key, value in blobs.items():
        assert client.put(server.chunk_url(key), content=value).status_code == 201
    flip_byte(chunk_path(server, "d1"), 12345)
    flip_byte(chunk_path(server, "d2"), 54321)
    kvgw = KvgwClient(ClientSettings(url=server.url, bucket="kvcache", access_key=ROOT_AK, secret_key=ROOT_SK))
    try:
        c = kvgw.blocking
        assert c.get("d0") == blobs["d0"]
        with pytest.raises(ProtocolError, match="checksum mismatch"):
            c.get("d1")
        got: dict[int, bytes] = {}
        buffers = [bytearray(SIZE), bytearray(SIZE)]
        statuses = c.batch_get_into(["d0", "d2"], lambda i, n: memoryview(buffers[i])[:n],
                                    on_item=lambda item: got.setdefault(item.index, b""))
        assert statuses == [ItemStatus.OK, ItemStatus.CORRUPT]  # the damaged frame: never served as data
        assert buffers[0] == blobs["d0"]
        wait_for(lambda: not chunk_path(server, "d1").exists() and not chunk_path(server, "d2").exists(),
                 "both reported copies quarantined")
        assert c.get("d1") is None and c.get("d0") == blobs["d0"]
    finally:
        kvgw.close()
    quarantine = server.data_dir / "fs" / "quarantine"
    assert len(list(quarantine.iterdir())) == 2
    assert exists(client, server, "d0") and not exists(client, server, "d1") and not exists(client, server, "d2")


def test_a_report_about_a_sound_chunk_destroys_nothing(client: httpx.Client, server: ServerProcess) -> None:
    data = os.urandom(SIZE)
    assert client.put(server.chunk_url("sound"), content=data).status_code == 201
    answer = client.post(f"{server.url}/v1/buckets/kvcache/damaged", json={"keys": ["sound", "never-stored"]})
    assert answer.status_code == 200 and answer.json() == {"quarantined": 0}
    assert client.get(server.chunk_url("sound"), headers=VERIFYING).content == data
    assert client.post(f"{server.url}/v1/buckets/kvcache/damaged", json={"keys": "sound"}).status_code == 400
    unauthorized = httpx.post(f"{server.url}/v1/buckets/kvcache/damaged", json={"keys": ["sound"]})
    assert unauthorized.status_code == 401


def test_a_torn_chunk_file_is_never_sent_even_to_a_verifying_reader(client: httpx.Client,
                                                                    server: ServerProcess) -> None:
    """What a power loss can leave behind with fsync off (a published name, the tail of the data never
    written): the file is refused when opened (its footer is gone), quarantined, and answered 404, so a
    reader that would verify gets no partial chunk to verify either."""
    data = os.urandom(SIZE)
    assert client.put(server.chunk_url("torn"), content=data).status_code == 201
    path = chunk_path(server, "torn")
    os.truncate(path, SIZE // 2)
    reply = client.get(server.chunk_url("torn"), headers=VERIFYING)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "NoSuchChunk"
    assert not path.exists() and not exists(client, server, "torn")
