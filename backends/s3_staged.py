"""A staged write to the S3 tier: buffer, switch to a multipart upload past one part, publish if absent.

Bytes collect in memory until they exceed ``part_size``; from then on they go out as parts of exactly
``part_size`` bytes (S3's 5 MiB minimum holds for all but the last), at most ``parts_in_flight`` at a
time, so a write holds about ``(parts_in_flight + 1) * part_size`` bytes however large the chunk.

``publish`` appends the chunkfile footer and makes the chunk visible only if absent, always by one
conditional PutObject (``If-None-Match: *``) of the chunk object ``<prefix><digest>``:

- a chunk of at most ``part_size`` bytes is that PutObject, with its data and footer;
- a larger one first completes its multipart upload under a key of its own, the *data object*
  ``<prefix><digest>.<writer token>`` (data + footer; no other writer ever uses that key, so the
  complete needs no condition), then publishes a *manifest* as the chunk object: the footer alone,
  with ``x-amz-meta-kvgw-data: <writer token>`` naming the data object. Readers follow it
  (``backends.s3``). The writer that loses deletes its data object.

Why not ``If-None-Match: *`` on CompleteMultipartUpload: Ceph RGW (16.2) ignores it there (and on
CopyObject) and overwrites, and moto checks it without a lock; every S3 server kvgw targets (AWS since
August 2024, MinIO, RGW, moto) honours it on PutObject. So "first write wins, readers never see partial
data" holds wherever PutObject's condition does: the data object is complete before any manifest names
it, the manifest appears atomically and never changes, and a crash at any step leaves only an upload or
an unnamed data object, invisible to readers, that ``cleanup_staging`` removes once old enough.

Every write carries a random writer token in its user metadata: when a conditional write answers
"exists" (or the upload is gone) the token tells whether the object is in fact ours, written by an
earlier attempt whose reply was lost and which botocore (or aiohttp, which resends an idempotent PUT
once on a dropped keep-alive connection) then retried. The conditional step holds the tier's per-key
publish lock, so writers within one gateway never race each other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from backends import chunkfile
from backends.base import ChunkMeta
from backends.errors import BackendError, ChunkExists, ChunkNotFound, TierUnavailable
from backends.s3_guard import UploadGone, WriteConflict

if TYPE_CHECKING:
    from backends.s3 import S3Tier

log = logging.getLogger(__name__)

WRITER_META = "kvgw-writer"
SIZE_META = "kvgw-size"
CHECKSUM_META = "kvgw-checksum"
DATA_META = "kvgw-data"  # on a manifest: the writer token that names its data object
_CONFLICT_RETRIES = 4


class S3StagedChunk:
    """One in-progress write of one chunk object. Exactly one of ``publish`` / ``discard``."""

    def __init__(self, tier: S3Tier, key: str) -> None:
        self._tier = tier
        self._key = key
        self._part_size = tier.settings.part_size
        self._max_in_flight = tier.settings.parts_in_flight
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._in_flight: deque[asyncio.Task[dict[str, Any]]] = deque()
        self._token = uuid.uuid4().hex
        self._data_key = tier.data_key(key, self._token)
        self._finished = False
        self.peak_parts_in_flight = 0  # diagnostics: the memory bound, observable by tests

    @property
    def upload_id(self) -> str | None:
        """The multipart upload's id once the chunk outgrew one part, else None."""
        return self._upload_id

    @property
    def data_key(self) -> str:
        """Where the multipart upload (if the chunk needs one) writes: the data object's key."""
        return self._data_key

    async def write(self, data: bytes | memoryview) -> None:
        if self._finished:
            raise BackendError("write to a staged chunk that was already published or discarded")
        self._buffer += data
        while len(self._buffer) > self._part_size:
            with memoryview(self._buffer) as view:
                part = bytes(view[: self._part_size])
            del self._buffer[: self._part_size]
            await self._send_part(part)

    async def _send_part(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = await self._tier.create_upload(self._data_key, {WRITER_META: self._token})
        while len(self._in_flight) >= self._max_in_flight:
            self._parts.append(await self._in_flight.popleft())
        number = len(self._parts) + len(self._in_flight) + 1
        task = asyncio.create_task(self._tier.upload_part(self._data_key, self._upload_id, number, body))
        self._in_flight.append(task)
        self.peak_parts_in_flight = max(self.peak_parts_in_flight, len(self._in_flight))

    async def publish(self, meta: ChunkMeta) -> bool:
        if self._finished:
            raise BackendError("publish of a staged chunk that was already published or discarded")
        try:
            footer = chunkfile.encode_footer(meta)
            metadata = {WRITER_META: self._token, SIZE_META: str(meta.size), CHECKSUM_META: f"{meta.checksum:016x}"}
            self._buffer += footer
            body, self._buffer = bytes(self._buffer), bytearray()
            if self._upload_id is None:
                async with self._tier.publish_lock(self._key):
                    return await self._put_if_absent(body, metadata)
            await self._send_part(body)  # the last part may be small; it is never empty (footer)
            while self._in_flight:
                self._parts.append(await self._in_flight.popleft())
            if not self._tier.settings.conditional_writes and await self._tier.exists(self._key):
                return False  # no data object made just to be deleted again
            self._tier.data_in_progress(self._data_key, True)  # not an orphan for our own cleanup_staging
            try:
                await self._complete_data()
                async with self._tier.publish_lock(self._key):
                    created = await self._put_if_absent(footer, {**metadata, DATA_META: self._token})
                if not created:  # lost for certain: nothing will ever name our data object
                    await self._tier.delete_quietly(self._data_key)
            finally:
                self._tier.data_in_progress(self._data_key, False)
            # On an error the manifest may or may not exist (a lost reply): the data object stays, and
            # cleanup_staging deletes it later unless a manifest names it.
            return created
        finally:
            await self.discard()

    async def _complete_data(self) -> None:
        """Complete the multipart upload as the data object (a key only this write uses)."""
        assert self._upload_id is not None
        upload_id = self._upload_id
        try:
            await self._tier.complete_upload(self._data_key, upload_id, self._parts, if_none_match=False)
        except UploadGone as exc:
            if await self._tier.writer_of(self._data_key) != self._token:
                raise BackendError(
                    f"publish chunk {self._key}: the multipart upload was aborted before completion "
                    "(another gateway's cleanup_staging with a too short max age?)"
                ) from exc
            # completed by an attempt whose reply was lost
        self._tier.forget_upload(upload_id)
        self._upload_id = None  # completed: nothing left to abort

    async def _put_if_absent(self, body: bytes, metadata: dict[str, str]) -> bool:
        tier = self._tier
        if not tier.settings.conditional_writes:
            if await tier.exists(self._key):
                return False
            await tier.put_object(self._key, body, metadata, if_none_match=False)
            return True
        for attempt in range(_CONFLICT_RETRIES):
            try:
                await tier.put_object(self._key, body, metadata, if_none_match=True)
                return True
            except WriteConflict:
                await asyncio.sleep(0.05 * 2**attempt)
            except ChunkExists:
                return await self._ours()
        return await self._settle_conflict()

    async def _ours(self) -> bool:
        """After "exists": True only if the object carries this write's token (our reply was lost)."""
        return await self._tier.writer_of(self._key) == self._token

    async def _settle_conflict(self) -> bool:
        """Conflicts did not settle: the other write either landed (we lost) or failed (nobody won)."""
        if await self._tier.exists(self._key):
            return await self._ours()
        raise TierUnavailable(f"publish chunk {self._key}: concurrent conditional writes did not settle")

    async def discard(self) -> None:
        """Cancel parts in flight and abort the upload. Best effort: a failed abort is only logged,
        the upload stays invisible and ``cleanup_staging`` removes it later."""
        self._finished = True
        self._buffer = bytearray()
        tasks, self._in_flight = list(self._in_flight), deque()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        try:
            await self._tier.abort_upload(self._data_key, upload_id)
        except (UploadGone, ChunkNotFound):
            pass
        except BackendError as exc:
            log.warning("could not abort multipart upload of %s (left for cleanup_staging): %s", self._key, exc)
        finally:
            self._tier.forget_upload(upload_id)
