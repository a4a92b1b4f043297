"""Issue 11, section 1: a PUT answered "existed" leaves a readable chunk, whatever another gateway did
to the key meanwhile; GET never serves the bytes of a deleted chunk.

Gateway A publishes its events late (``KVGW_CLUSTER_FLUSH_SECONDS=5``), so B's index is certainly stale
when B takes the request: what is tested is the confirmation with the tier, not the feed's speed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess
from tests.integration.cluster.conftest import Launch
from tests.integration.s3api.conftest import MIN_PART, boto3_client


@pytest.fixture
def pair(launch: Launch) -> Iterator[tuple[ServerProcess, ServerProcess, httpx.Client, httpx.Client]]:
    a = launch("a", KVGW_CLUSTER_FLUSH_SECONDS="5")
    b = launch("b")
    with httpx.Client(headers=a.auth, timeout=30) as ca, httpx.Client(headers=b.auth, timeout=30) as cb:
        yield a, b, ca, cb


def _stale_on_b(pair: tuple[ServerProcess, ServerProcess, httpx.Client, httpx.Client], key: str) -> bytes:
    """Write ``key`` through A, let B index it, delete it through A: B's index still says present."""
    a, b, ca, cb = pair
    data = os.urandom(100_000)
    assert ca.put(a.chunk_url(key), content=data).status_code == 201
    assert cb.head(b.chunk_url(key)).status_code == 200  # B indexes it (fall-through)
    assert ca.delete(a.chunk_url(key)).status_code == 204
    assert cb.head(b.chunk_url(key)).status_code == 200  # stale: HEAD is index-only on a hit
    return data


def test_re_put_after_a_delete_elsewhere_stores_the_chunk(pair: Any) -> None:
    a, b, ca, cb = pair
    data = _stale_on_b(pair, "k")
    again = cb.put(b.chunk_url("k"), content=data)
    assert again.status_code == 201, again.headers
    assert "x-kvgw-existed" not in again.headers
    for server, c in ((a, ca), (b, cb)):
        got = c.get(server.chunk_url("k"))
        assert got.status_code == 200 and got.content == data


def test_if_none_match_after_a_delete_elsewhere_stores_the_chunk(pair: Any) -> None:
    a, b, ca, cb = pair
    data = _stale_on_b(pair, "k")
    again = cb.put(b.chunk_url("k"), content=data, headers={"If-None-Match": "*"})
    assert again.status_code == 201
    assert ca.get(a.chunk_url("k")).content == data


def test_get_never_serves_a_chunk_deleted_elsewhere(pair: Any) -> None:
    _, b, _, cb = pair
    _stale_on_b(pair, "k")
    assert cb.get(b.chunk_url("k")).status_code == 404
    assert cb.head(b.chunk_url("k")).status_code == 404  # the GET corrected B's index


def test_s3_put_object_after_a_delete_elsewhere_stores_the_object(pair: Any) -> None:
    a, b, ca, _ = pair
    s3 = boto3_client(b.url)
    data = _stale_on_b(pair, "obj")
    s3.put_object(Bucket="kvcache", Key="obj", Body=data)
    assert ca.get(a.chunk_url("obj")).content == data
    # the same with If-None-Match: * (a conditional create)
    _stale_on_b(pair, "cond")
    s3.put_object(Bucket="kvcache", Key="cond", Body=data, IfNoneMatch="*")
    assert ca.get(a.chunk_url("cond")).content == data
    with pytest.raises(ClientError) as refused:  # and a real existing object still refuses it
        s3.put_object(Bucket="kvcache", Key="cond", Body=b"other", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"


def test_s3_complete_multipart_after_a_delete_elsewhere_stores_the_object(pair: Any) -> None:
    a, b, ca, _ = pair
    s3 = boto3_client(b.url)
    _stale_on_b(pair, "mp")
    parts = [os.urandom(MIN_PART), os.urandom(1000)]
    upload = s3.create_multipart_upload(Bucket="kvcache", Key="mp")["UploadId"]
    etags = [s3.upload_part(Bucket="kvcache", Key="mp", UploadId=upload, PartNumber=i + 1, Body=p)["ETag"]
             for i, p in enumerate(parts)]
    s3.complete_multipart_upload(
        Bucket="kvcache", Key="mp", UploadId=upload,
        MultipartUpload={"Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]},
    )
    got = ca.get(a.chunk_url("mp"))
    assert got.status_code == 200 and got.content == b"".join(parts)
