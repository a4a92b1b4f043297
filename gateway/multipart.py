"""Multipart uploads: parts staged on the filesystem tier, completed into one chunk.

The files (layout, upload ids, atomic renames, reclaiming) are ``backends.multipart_staging``'s; this
module decides what they mean. Rules:

- A part is visible (ListParts, Complete) only once its whole body arrived and verified: it is
  written to a private temporary file, then renamed over any earlier upload of the same number.
- An upload is invisible to readers until Complete. Complete streams the chosen parts in order into
  ``ChunkService.put``, so the object is published atomically (the tier's create-if-absent) and
  write-once holds: if the key already exists its chunk is kept and its ETag returned.
- Abort removes the upload; ``sweep`` removes uploads idle longer than a maximum age, completed
  uploads after ``COMPLETED_KEEP_SECONDS`` and temporary files of dead writers.

Backend errors become domain errors through ``translate_backend_error`` (a missing upload is
``NoSuchUpload``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import xxhash

from backends import chunkfile
from backends.base import ChunkMeta
from backends.catalog.store import BucketPolicy
from backends.errors import BackendError, ChunkCorrupt
from backends.multipart_staging import COMPLETED_KEEP_SECONDS, CompletedRecord, MultipartStaging, UploadRecord
from gateway.buckets import check_chunk_size
from gateway.chunks import ChunkInfo, PutResult
from gateway.errors import (
    ChunkTooLarge,
    EmptyChunk,
    EntityTooSmall,
    IncompleteBody,
    InvalidPart,
    InvalidRequest,
    NoSuchUpload,
    translate_backend_error,
)
from gateway.service import ChunkService
from kvgw_client import wire

T = TypeVar("T")

MAX_PART_NUMBER = 10_000
_WRITE_BATCH = 1 << 20
_COMPLETE_WINDOW = 8 << 20

__all__ = [
    "COMPLETED_KEEP_SECONDS",
    "MultipartStore",
    "PartInfo",
    "Upload",
]


@dataclass(frozen=True, slots=True)
class Upload:
    upload_id: str
    bucket: str
    key: str
    initiated: float
    attrs: dict[str, str]
    completed: ChunkInfo | None = None  # set when a Complete already published the object

    @classmethod
    def from_record(cls, record: UploadRecord) -> Upload:
        done = record.completed
        completed = None if done is None else ChunkInfo(record.bucket, record.key, done.size, done.checksum,
                                                        done.created, 0.0, md5_etag=done.md5_etag)
        return cls(record.upload_id, record.bucket, record.key, record.initiated, record.attrs, completed)


@dataclass(frozen=True, slots=True)
class PartInfo:
    number: int
    size: int
    checksum: int  # xxh3-64 of the part
    modified: float
    attrs: dict[str, str]  # checksums the client sent with the part (x-amz-checksum-<alg> -> base64)
    md5: str | None = None  # hex MD5 of the part, received while its bucket's ETags were MD5s

    @property
    def etag(self) -> str:
        """The part's MD5 (S3's part ETag) where it has one, else its xxh3-64; quoted."""
        return f'"{self.md5}"' if self.md5 is not None else wire.etag(self.checksum)


def multipart_md5_etag(parts: Sequence[PartInfo]) -> str | None:
    """S3's ETag of a multipart object: the hex MD5 of the parts' binary MD5s concatenated in part order,
    then ``-`` and the number of parts. None unless every part has an MD5."""
    if not parts or any(p.md5 is None for p in parts):
        return None
    combined = hashlib.md5(b"".join(bytes.fromhex(p.md5) for p in parts if p.md5 is not None))
    return f"{combined.hexdigest()}-{len(parts)}"


async def _io(call: Awaitable[T]) -> T:
    """Await a staging-area call; its backend errors become domain errors."""
    try:
        return await call
    except BackendError as exc:
        raise translate_backend_error(exc) from exc


class MultipartStore:
    """Multipart uploads over the staging area (see the module docstring)."""

    def __init__(self, fs_root: Path, *, fsync: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.staging = MultipartStaging(str(fs_root / "multipart"), fsync=fsync)
        self.clock = clock

    # -- uploads -------------------------------------------------------------------------------

    async def create(self, bucket: str, key: str, attrs: Mapping[str, str]) -> Upload:
        now = self.clock()
        upload_id = await _io(self.staging.create(bucket, key, now, attrs))
        return Upload(upload_id, bucket, key, now, dict(attrs))

    async def get(self, upload_id: str, bucket: str, key: str, *, allow_completed: bool = False) -> Upload:
        """The upload, if it belongs to (bucket, key); NoSuchUpload otherwise (also once completed,
        unless ``allow_completed``)."""
        upload = Upload.from_record(await _io(self.staging.load(upload_id)))
        if upload.bucket != bucket or upload.key != key:
            raise NoSuchUpload()
        if upload.completed is not None and not allow_completed:
            raise NoSuchUpload()
        return upload

    async def abort(self, upload: Upload) -> None:
        await _io(self.staging.remove(upload.upload_id))

    async def list_uploads(self, bucket: str) -> list[Upload]:
        """In-progress uploads of ``bucket``, by key then initiation (upload id)."""
        found = [Upload.from_record(r) for r in await _io(self.staging.uploads())
                 if r.bucket == bucket and r.completed is None]
        found.sort(key=lambda u: (u.key.encode(), u.upload_id))
        return found

    # -- parts ---------------------------------------------------------------------------------

    async def put_part(
        self,
        upload: Upload,
        number: int,
        body: AsyncIterable[bytes | memoryview],
        *,
        max_bytes: int,
        allow_empty: bool = False,
        attrs: Callable[[], Mapping[str, str]] = dict,
        md5: bool = False,
    ) -> PartInfo:
        """Receive one part. ``body`` must raise if it is not complete and verified; only then is the
        part renamed into place (replacing an earlier upload of the same number). ``attrs`` is called
        after the body ended (checksums computed on the way). An empty part is refused (EmptyChunk)
        unless ``allow_empty`` (the bucket's ``allow_empty_objects``). ``md5``: the bucket's ETags are
        MD5s; the part's MD5 is computed in the same pass as its xxh3 and becomes its ETag."""
        if not 1 <= number <= MAX_PART_NUMBER:
            raise InvalidRequest(f"part numbers are 1 to {MAX_PART_NUMBER}")
        writer = await _io(self.staging.open_part(upload.upload_id, number))
        hasher = xxhash.xxh3_64()
        md5_hasher = hashlib.md5() if md5 else None
        size = 0
        pending: list[bytes | memoryview] = []
        pending_bytes = 0
        try:
            async for piece in body:
                size += len(piece)
                if size > max_bytes:
                    raise ChunkTooLarge(f"the part exceeds {max_bytes} bytes")
                hasher.update(piece)
                if md5_hasher is not None:
                    md5_hasher.update(piece)
                pending.append(piece)
                pending_bytes += len(piece)
                if pending_bytes >= _WRITE_BATCH:
                    batch, pending, pending_bytes = pending, [], 0
                    await _io(writer.write(batch))
            if size == 0 and not allow_empty:
                raise EmptyChunk.in_bucket(upload.bucket)
            now = self.clock()
            meta = ChunkMeta(upload.bucket, upload.key, size, hasher.intdigest(), now,
                             attrs=tuple(sorted(attrs().items())),
                             md5_etag=None if md5_hasher is None else md5_hasher.hexdigest())
            pending.append(chunkfile.encode_footer(meta))
            await _io(writer.publish(pending))
        except BaseException:
            writer.discard()
            raise
        finally:
            writer.close()
        return PartInfo(number, size, meta.checksum, now, dict(meta.attrs), meta.md5_etag)

    async def list_parts(self, upload: Upload) -> list[PartInfo]:
        return [PartInfo(p.number, p.meta.size, p.meta.checksum, p.modified, dict(p.meta.attrs), p.meta.md5_etag)
                for p in await _io(self.staging.parts(upload.upload_id))]

    async def resolve_parts(self, upload: Upload, chosen: Sequence[tuple[int, str]], *, min_part_bytes: int
                            ) -> list[PartInfo]:
        """The parts a Complete names, as (number, ETag quoted or not) in ascending order: InvalidPart
        if one is missing or has another ETag, EntityTooSmall if one but the last is too small."""
        available = {p.number: p for p in await self.list_parts(upload)}
        parts: list[PartInfo] = []
        for number, etag in chosen:
            part = available.get(number)
            if part is None or part.etag.strip('"') != etag.strip().strip('"').lower():
                raise InvalidPart(f"part {number} was not uploaded or has another ETag")
            parts.append(part)
        for part in parts[:-1]:
            if part.size < min_part_bytes:
                raise EntityTooSmall(f"part {part.number} is {part.size} bytes; the minimum is {min_part_bytes}")
        return parts

    async def complete(
        self,
        service: ChunkService,
        bucket: BucketPolicy,
        upload: Upload,
        parts: Sequence[PartInfo],
        attrs: Mapping[str, str],
    ) -> PutResult:
        """Publish the parts, in order, as one chunk (atomic, write-once), then retire the upload. In an
        MD5-mode bucket the object's ETag is S3's multipart form (``multipart_md5_etag``) when every part
        has an MD5 (one uploaded before the bucket became MD5-mode has none: the MD5 of the whole body
        is computed as the parts stream in, instead)."""
        total = sum(p.size for p in parts)
        check_chunk_size(bucket, total)
        existing = await service.lookup_for_write(bucket, upload.key)
        if existing is not None:
            result = PutResult(False, existing)
        else:
            result = await service.put(bucket, upload.key, self._stream(upload, parts), length=total,
                                       attrs=dict(attrs), md5_etag=multipart_md5_etag(parts))
        info = result.info
        await _io(self.staging.retire(upload.upload_id, CompletedRecord(info.size, info.checksum, info.created,
                                                                        info.md5_etag)))
        return result

    async def _stream(self, upload: Upload, parts: Sequence[PartInfo]) -> AsyncIterator[bytes]:
        """The parts' bytes, in windows of read-only mappings of the part files."""
        for part in parts:
            if part.size == 0:
                continue
            try:
                mapped = await self.staging.map_part(upload.upload_id, part.number, part.size)
            except ChunkCorrupt as exc:  # shorter than its footer said
                raise IncompleteBody(str(exc)) from exc
            except BackendError as exc:
                raise translate_backend_error(exc) from exc
            view = memoryview(mapped)
            for offset in range(0, part.size, _COMPLETE_WINDOW):
                yield view[offset : offset + _COMPLETE_WINDOW]  # type: ignore[misc]

    # -- reclaiming ----------------------------------------------------------------------------

    async def sweep(self, *, max_age: float, now: float | None = None, limit: int = 1000) -> int:
        """Remove uploads idle for ``max_age`` seconds, completed uploads older than
        ``COMPLETED_KEEP_SECONDS`` and part files of dead writers; at most ``limit`` uploads a pass."""
        when = self.clock() if now is None else now
        return await _io(self.staging.sweep(max_age=max_age, now=when, limit=limit))
