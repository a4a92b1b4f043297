"""Multipart uploads: a staging area for parts on the filesystem tier, completed into one chunk.

Layout under ``<fs_root>/multipart/`` (a shared NFS root lets an upload started on one gateway get
parts and its completion on another)::

    <upload-id>/upload.json          bucket, key, initiation time, the object's attrs
    <upload-id>/part-00001           part bytes + chunkfile footer (size, xxh3, part checksums)
    <upload-id>/.tmp-00001-<token>   a part being received (renamed to part-NNNNN when verified)
    <upload-id>/complete.json        written once the object is published (answers a retried Complete)

Upload ids are 32 lower-case hex digits (a nanosecond timestamp then randomness, so they sort by
initiation) and are checked against that form before they name a directory: paths never come from
client text. Keys never become paths either; they live inside ``upload.json``.

Rules:

- A part is visible (ListParts, Complete) only once its whole body arrived and verified: it is
  written to a private temporary file, then renamed over any earlier upload of the same number.
- An upload is invisible to readers until Complete. Complete streams the chosen parts in order into
  ``ChunkService.put``, so the object is published atomically (the tier's create-if-absent) and
  write-once holds: if the key already exists its chunk is kept and its ETag returned.
- Abort removes the directory; ``sweep`` removes uploads idle longer than a maximum age, completed
  uploads after ``COMPLETED_KEEP_SECONDS`` and temporary files of dead writers.

Blocking filesystem calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from backends import chunkfile
from backends.base import ChunkMeta
from backends.catalog.store import BucketPolicy
from backends.errors import ChunkCorrupt
from backends.fileio import write_all
from gateway.errors import (
    ChunkTooLarge,
    IncompleteBody,
    InsufficientStorage,
    InternalError,
    InvalidRequest,
    KvgwError,
    ServiceUnavailable,
)
from gateway.service import ChunkInfo, ChunkService, PutResult

MAX_PART_NUMBER = 10_000
COMPLETED_KEEP_SECONDS = 3600.0
TMP_MAX_AGE_SECONDS = 3600.0
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_PART_NAME = re.compile(r"part-(\d{5})")
_WRITE_BATCH = 1 << 20
_COMPLETE_WINDOW = 8 << 20

__all__ = [
    "EntityTooSmall",
    "InvalidPart",
    "MultipartStore",
    "NoSuchUpload",
    "PartInfo",
    "Upload",
]


class NoSuchUpload(KvgwError):
    code = "NoSuchUpload"
    default_message = "the multipart upload does not exist (aborted, completed or never started)"


class InvalidPart(KvgwError):
    code = "InvalidPart"
    default_message = "a listed part was not uploaded or its ETag does not match"


class EntityTooSmall(KvgwError):
    code = "EntityTooSmall"
    default_message = "a part other than the last is smaller than the minimum part size"


@dataclass(frozen=True, slots=True)
class Upload:
    upload_id: str
    bucket: str
    key: str
    initiated: float
    attrs: dict[str, str]
    completed: ChunkInfo | None = None  # set when a Complete already published the object


@dataclass(frozen=True, slots=True)
class PartInfo:
    number: int
    size: int
    checksum: int  # xxh3-64 of the part
    modified: float
    attrs: dict[str, str]  # checksums the client sent with the part (x-amz-checksum-<alg> -> base64)

    @property
    def etag(self) -> str:
        """Unquoted; clients send it back quoted or not (LMCache: not)."""
        return f"{self.checksum:016x}"


def _translate(exc: OSError, what: str) -> KvgwError:
    if exc.errno in (28, 122, 27):  # ENOSPC, EDQUOT, EFBIG
        return InsufficientStorage(f"{what}: {exc.strerror}")
    if exc.errno in (5, 116, 110, 107, 112):  # EIO, ESTALE, ETIMEDOUT, ENOTCONN, EHOSTDOWN
        return ServiceUnavailable(f"{what}: {exc.strerror}")
    return InternalError(f"{what}: {exc.strerror or exc}")


def _write_json_atomic(path: str, doc: Mapping[str, object], fsync: bool) -> None:
    tmp = f"{path}.{secrets.token_hex(4)}.new"
    data = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, [data])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


class MultipartStore:
    """The staging area for multipart uploads (see the module docstring)."""

    def __init__(self, fs_root: Path, *, fsync: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.root = str(fs_root / "multipart")
        self.fsync = fsync
        self.clock = clock
        os.makedirs(self.root, exist_ok=True)

    def _dir(self, upload_id: str) -> str:
        if not _UPLOAD_ID.fullmatch(upload_id):
            raise NoSuchUpload()
        return f"{self.root}/{upload_id}"

    async def _run(self, fn: Callable[..., object], *args: object, what: str) -> object:
        try:
            return await asyncio.to_thread(fn, *args)
        except KvgwError:
            raise
        except FileNotFoundError as exc:
            raise NoSuchUpload() from exc
        except OSError as exc:
            raise _translate(exc, what) from exc

    # -- uploads -------------------------------------------------------------------------------

    async def create(self, bucket: str, key: str, attrs: Mapping[str, str]) -> Upload:
        now = self.clock()
        upload_id = f"{time.time_ns():016x}"[-16:] + secrets.token_hex(8)
        doc = {"bucket": bucket, "key": key, "initiated": now, "attrs": dict(attrs)}

        def make() -> None:
            path = self._dir(upload_id)
            os.mkdir(path, 0o755)
            _write_json_atomic(f"{path}/upload.json", doc, self.fsync)

        await self._run(make, what="create multipart upload")
        return Upload(upload_id, bucket, key, now, dict(attrs))

    def _load(self, upload_id: str) -> Upload:
        path = self._dir(upload_id)
        try:
            with open(f"{path}/upload.json", "rb") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise NoSuchUpload() from None
        except ValueError:
            raise NoSuchUpload("the upload's record is damaged") from None
        completed = None
        with contextlib.suppress(FileNotFoundError, ValueError), open(f"{path}/complete.json", "rb") as f:
            done = json.load(f)
            completed = ChunkInfo(doc["bucket"], doc["key"], int(done["size"]), int(done["checksum"], 16),
                                  float(done["created"]), 0.0)
        return Upload(upload_id, str(doc["bucket"]), str(doc["key"]), float(doc["initiated"]),
                      {str(k): str(v) for k, v in doc.get("attrs", {}).items()}, completed)

    async def get(self, upload_id: str, bucket: str, key: str, *, allow_completed: bool = False) -> Upload:
        """The upload, if it belongs to (bucket, key); NoSuchUpload otherwise (also once completed,
        unless ``allow_completed``)."""
        upload = await self._run(self._load, upload_id, what="read multipart upload")
        assert isinstance(upload, Upload)
        if upload.bucket != bucket or upload.key != key:
            raise NoSuchUpload()
        if upload.completed is not None and not allow_completed:
            raise NoSuchUpload()
        return upload

    async def abort(self, upload: Upload) -> None:
        path = self._dir(upload.upload_id)
        await self._run(shutil.rmtree, path, True, what="abort multipart upload")

    async def list_uploads(self, bucket: str) -> list[Upload]:
        """In-progress uploads of ``bucket``, by key then initiation (upload id)."""

        def scan() -> list[Upload]:
            found: list[Upload] = []
            for name in os.listdir(self.root):
                if not _UPLOAD_ID.fullmatch(name):
                    continue
                try:
                    upload = self._load(name)
                except NoSuchUpload:
                    continue
                if upload.bucket == bucket and upload.completed is None:
                    found.append(upload)
            found.sort(key=lambda u: (u.key.encode(), u.upload_id))
            return found

        result = await self._run(scan, what="list multipart uploads")
        assert isinstance(result, list)
        return result

    # -- parts ---------------------------------------------------------------------------------

    async def put_part(
        self,
        upload: Upload,
        number: int,
        body: AsyncIterable[bytes | memoryview],
        *,
        max_bytes: int,
        attrs: Callable[[], Mapping[str, str]] = dict,
    ) -> PartInfo:
        """Receive one part. ``body`` must raise if it is not complete and verified; only then is the
        part renamed into place (replacing an earlier upload of the same number). ``attrs`` is called
        after the body ended (checksums computed on the way)."""
        if not 1 <= number <= MAX_PART_NUMBER:
            raise InvalidRequest(f"part numbers are 1 to {MAX_PART_NUMBER}")
        path = self._dir(upload.upload_id)
        tmp = f"{path}/.tmp-{number:05d}-{secrets.token_hex(6)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd_obj = await self._run(os.open, tmp, flags, 0o644, what="create part file")
        assert isinstance(fd_obj, int)
        fd: int | None = fd_obj
        hasher = xxhash.xxh3_64()
        size = 0
        pending: list[bytes | memoryview] = []
        pending_bytes = 0
        try:
            async for piece in body:
                size += len(piece)
                if size > max_bytes:
                    raise ChunkTooLarge(f"the part exceeds {max_bytes} bytes")
                hasher.update(piece)
                pending.append(piece)
                pending_bytes += len(piece)
                if pending_bytes >= _WRITE_BATCH:
                    batch, pending, pending_bytes = pending, [], 0
                    await self._run(write_all, fd, batch, what="write part")
            now = self.clock()
            meta = ChunkMeta(upload.bucket, upload.key, size, hasher.intdigest(), now,
                             attrs=tuple(sorted(attrs().items())))
            pending.append(chunkfile.encode_footer(meta))
            final = f"{path}/part-{number:05d}"

            def finish() -> None:
                assert fd is not None
                write_all(fd, pending)
                if self.fsync:
                    os.fsync(fd)
                if not os.path.exists(f"{path}/upload.json"):
                    raise NoSuchUpload()  # aborted meanwhile
                os.rename(tmp, final)

            await self._run(finish, what="publish part")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            if fd is not None:
                os.close(fd)
                fd = None
        return PartInfo(number, size, meta.checksum, now, dict(meta.attrs))

    async def list_parts(self, upload: Upload) -> list[PartInfo]:
        path = self._dir(upload.upload_id)

        def scan() -> list[PartInfo]:
            parts: list[PartInfo] = []
            for name in os.listdir(path):
                match = _PART_NAME.fullmatch(name)
                if match is None:
                    continue
                try:
                    meta = chunkfile.read_meta(f"{path}/{name}")
                    modified = os.stat(f"{path}/{name}").st_mtime
                except (FileNotFoundError, ChunkCorrupt):
                    continue
                parts.append(PartInfo(int(match.group(1)), meta.size, meta.checksum, modified, dict(meta.attrs)))
            parts.sort(key=lambda p: p.number)
            return parts

        result = await self._run(scan, what="list parts")
        assert isinstance(result, list)
        return result

    async def resolve_parts(self, upload: Upload, chosen: Sequence[tuple[int, str]], *, min_part_bytes: int
                            ) -> list[PartInfo]:
        """The parts a Complete names, as (number, unquoted ETag) in ascending order: InvalidPart if
        one is missing or has another ETag, EntityTooSmall if one but the last is too small."""
        available = {p.number: p for p in await self.list_parts(upload)}
        parts: list[PartInfo] = []
        for number, etag in chosen:
            part = available.get(number)
            if part is None or part.etag != etag.strip().strip('"').lower():
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
        """Publish the parts, in order, as one chunk (atomic, write-once), then retire the upload."""
        total = sum(p.size for p in parts)
        if total > bucket.max_chunk_bytes:
            raise ChunkTooLarge(f"{total} bytes exceeds the bucket limit of {bucket.max_chunk_bytes}")
        existing = await service.lookup(bucket, upload.key)
        if existing is not None:
            result = PutResult(False, existing)
        else:
            result = await service.put(bucket, upload.key, self._stream(upload, parts), length=total,
                                       attrs=dict(attrs))
        await self._retire(upload, result.info)
        return result

    async def _stream(self, upload: Upload, parts: Sequence[PartInfo]) -> AsyncIterator[bytes]:
        """The parts' bytes from read-only mappings (populated in a worker thread, so hashing and
        writing on the way never fault on the event loop)."""
        path = self._dir(upload.upload_id)
        for part in parts:
            if part.size == 0:
                continue

            def open_map(number: int = part.number, size: int = part.size) -> mmap.mmap:
                fd = os.open(f"{path}/part-{number:05d}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.fstat(fd).st_size < size:
                        raise IncompleteBody(f"part {number} is shorter than recorded")
                    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)

            mapped = await self._run(open_map, what="read part")
            assert isinstance(mapped, mmap.mmap)
            view = memoryview(mapped)
            for offset in range(0, part.size, _COMPLETE_WINDOW):
                yield view[offset : offset + _COMPLETE_WINDOW]  # type: ignore[misc]

    async def _retire(self, upload: Upload, info: ChunkInfo) -> None:
        path = self._dir(upload.upload_id)
        doc = {"size": info.size, "checksum": info.checksum_hex, "created": info.created}

        def retire() -> None:
            _write_json_atomic(f"{path}/complete.json", doc, self.fsync)
            for name in os.listdir(path):
                if _PART_NAME.fullmatch(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{path}/{name}")

        await self._run(retire, what="retire multipart upload")

    # -- reclaiming ----------------------------------------------------------------------------

    async def sweep(self, *, max_age: float, now: float | None = None, limit: int = 1000) -> int:
        """Remove uploads idle for ``max_age`` seconds, completed uploads older than
        ``COMPLETED_KEEP_SECONDS`` and part files of dead writers; at most ``limit`` uploads a pass."""
        when = self.clock() if now is None else now
        result = await self._run(self._sweep_sync, max_age, when, limit, what="sweep multipart uploads")
        assert isinstance(result, int)
        return result

    def _sweep_sync(self, max_age: float, now: float, limit: int) -> int:
        removed = 0
        for name in os.listdir(self.root):
            if removed >= limit:
                break
            if not _UPLOAD_ID.fullmatch(name):
                continue
            path = f"{self.root}/{name}"
            try:
                done = os.stat(f"{path}/complete.json").st_mtime
            except FileNotFoundError:
                done = None
            try:
                last = os.stat(path).st_mtime
                for entry in os.scandir(path):
                    with contextlib.suppress(FileNotFoundError):
                        last = max(last, entry.stat().st_mtime)
            except FileNotFoundError:
                continue
            idle = now - last
            if (done is not None and now - done > COMPLETED_KEEP_SECONDS) or (done is None and idle > max_age):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
                continue
            for entry in os.scandir(path):
                if entry.name.startswith(".tmp-"):
                    with contextlib.suppress(FileNotFoundError):
                        if now - entry.stat().st_mtime > max(TMP_MAX_AGE_SECONDS, max_age / 24):
                            os.unlink(entry.path)
        return removed
