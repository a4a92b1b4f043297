"""The multipart staging area translates OSError once, in backends; the gateway sees domain errors."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.errors import StorageFull, TierUnavailable, UploadNotFound
from backends.multipart_staging import MultipartStaging
from gateway.errors import InsufficientStorage, NoSuchUpload, ServiceUnavailable
from gateway.multipart import MultipartStore


async def _body(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_unknown_and_malformed_upload_ids_are_upload_not_found(tmp_path: Path) -> None:
    staging = MultipartStaging(str(tmp_path / "multipart"), fsync=False)
    with pytest.raises(UploadNotFound):
        await staging.load("../../etc")
    with pytest.raises(UploadNotFound):
        await staging.load("0" * 32)
    store = MultipartStore(tmp_path, fsync=False)
    with pytest.raises(NoSuchUpload):
        await store.get("0" * 32, "b", "k")


@pytest.mark.parametrize(("code", "backend_error", "domain_error"), [
    (errno.ENOSPC, StorageFull, InsufficientStorage),
    (errno.EDQUOT, StorageFull, InsufficientStorage),
    (errno.ESTALE, TierUnavailable, ServiceUnavailable),
])
async def test_write_errors_become_backend_then_domain_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, backend_error: type[Exception],
    domain_error: type[Exception],
) -> None:
    store = MultipartStore(tmp_path, fsync=False)
    upload = await store.create("b", "k", {})

    def failing_writev(fd: int, buffers: object) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "writev", failing_writev)
    with pytest.raises(domain_error) as caught:
        await store.put_part(upload, 1, _body(b"x" * 100), max_bytes=1 << 20)
    assert isinstance(caught.value.__cause__, backend_error)
    monkeypatch.undo()
    assert await store.list_parts(upload) == []  # nothing half-written is visible
    assert not [n for n in os.listdir(tmp_path / "multipart" / upload.upload_id) if n.startswith(".tmp-")]


async def test_a_part_round_trips_and_an_abort_removes_the_upload(tmp_path: Path) -> None:
    store = MultipartStore(tmp_path, fsync=False)
    upload = await store.create("b", "k", {"content-type": "x/y"})
    part = await store.put_part(upload, 1, _body(b"ab", b"cd"), max_bytes=10)
    assert part.size == 4 and part.etag.startswith('"') and part.etag.endswith('"')
    assert [p.number for p in await store.list_parts(upload)] == [1]
    assert [u.upload_id for u in await store.list_uploads("b")] == [upload.upload_id]
    await store.abort(upload)
    with pytest.raises(NoSuchUpload):
        await store.get(upload.upload_id, "b", "k")
