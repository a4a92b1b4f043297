"""SGLang's built-in S3 backend (``seaweedfs``: boto3, path-style, signed payloads with CRC32 checksums)
against kvgw's S3 API, through SGLang's factory and the cache controller's loops, as
``--hicache-storage-backend seaweedfs --hicache-storage-backend-extra-config '{"endpoint": ...}'``
runs it. Its pages and kvgw's own backend's are the same chunks: each reads what the other wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gateway.bench import sglang_engine as harness
from gateway.bench.sglang_engine import MHA_LAYOUTS, MHAHostPool, fill_pages
from tests.conftest import ServerProcess
from tests.integration.sglang.conftest import new_credential, tokens

harness.load()

from botocore.exceptions import ClientError  # noqa: E402

PAGE = 16


def written(pool: Any, pages: int, seed: int) -> tuple[list[str], torch.Tensor, list[torch.Tensor]]:
    hashes = harness.page_hashes(tokens(pages * PAGE, seed), PAGE)
    indices = pool.alloc(pages * PAGE)
    return hashes, indices, fill_pages(pool, indices, seed)


def loaded(pool: Any, indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
    return [pool.page_tensor(int(indices[i * PAGE])) for i in range(pages)]


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_sglangs_s3_backend_round_trips_through_kvgw(
    make_seaweedfs: Callable[..., Any], seed: int, layout: str
) -> None:
    pool = MHAHostPool(layout, page_size=PAGE)
    hashes, indices, pages = written(pool, 130, seed)
    writer = make_seaweedfs(pool)
    assert harness.backup(writer, pool, hashes, indices) == 130
    other = MHAHostPool(layout, page_size=PAGE)
    reader = make_seaweedfs(other)
    assert harness.hit_query(reader, hashes) == 130
    target = other.alloc(130 * PAGE)
    assert harness.transfer(reader, other, hashes, target) == 130
    assert all(torch.equal(g, w) for g, w in zip(loaded(other, target, 130), pages, strict=True))


def test_the_two_backends_read_each_others_pages(
    make_seaweedfs: Callable[..., Any], make_kvgw: Callable[..., Any], seed: int
) -> None:
    """Same names (``<model>/tp<r>of<n>/<hash>``), same bytes (a page's buffers back to back)."""
    pool = MHAHostPool("page_first_direct", page_size=PAGE)
    s3_hashes, s3_indices, s3_pages = written(pool, 20, seed)
    kv_hashes, kv_indices, kv_pages = written(pool, 20, seed + 1)
    s3 = make_seaweedfs(pool)
    kvgw = make_kvgw(pool)
    assert harness.backup(s3, pool, s3_hashes, s3_indices) == 20
    assert harness.backup(kvgw, pool, kv_hashes, kv_indices) == 20
    assert s3.key_prefix == kvgw.key_prefix

    other = MHAHostPool("page_first_direct", page_size=PAGE)
    s3_reader, kvgw_reader = make_seaweedfs(other), make_kvgw(other)
    target = other.alloc(40 * PAGE)
    assert harness.transfer(kvgw_reader, other, s3_hashes, target[: 20 * PAGE]) == 20
    assert harness.transfer(s3_reader, other, kv_hashes, target[20 * PAGE :]) == 20
    assert all(torch.equal(g, w) for g, w in zip(loaded(other, target, 40), s3_pages + kv_pages, strict=True))


def test_clear_with_a_bucket_credential_needs_the_delete_grant(
    make_seaweedfs: Callable[..., Any], gateway: ServerProcess, seed: int
) -> None:
    """With ``--write`` alone, attach works (the bucket exists) but ``clear()``'s DeleteObjects is 403;
    with ``--write --delete`` it empties this rank's prefix and nothing else."""
    model = f"s3-clear/{seed}"
    pool = MHAHostPool("page_first", page_size=PAGE, pages=1100)
    hashes, indices, _ = written(pool, 1050, seed)  # two ListObjectsV2 pages
    assert harness.backup(make_seaweedfs(pool, model=model), pool, hashes, indices) == 1050
    keep = make_seaweedfs(pool, model=model + "-other")
    assert harness.backup(keep, pool, hashes[:3], indices[: 3 * PAGE]) == 3

    ak, sk = new_credential(gateway, "--write")
    writer_only = make_seaweedfs(pool, model=model, access_key=ak, secret_key=sk)
    with pytest.raises(ClientError) as denied:
        writer_only.clear()
    assert denied.value.response["Error"]["Code"] == "AccessDenied"
    assert writer_only.batch_exists(hashes[:128]) == 128

    ak, sk = new_credential(gateway, "--write", "--delete")
    deleter = make_seaweedfs(pool, model=model, access_key=ak, secret_key=sk)
    deleter.clear()
    assert deleter.batch_exists(hashes[:128]) == 0
    assert harness.hit_query(deleter, hashes) == 0
    assert keep.batch_exists(hashes[:3]) == 3
