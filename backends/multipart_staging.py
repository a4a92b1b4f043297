"""The files of the multipart staging area: parts, upload records, assembling and reclaiming.

Layout under ``<fs_root>/multipart/`` (a shared NFS root lets an upload started on one gateway get
parts and its completion on another)::

    <upload-id>/upload.json          bucket, key, initiation time, the object's attrs
    <upload-id>/part-00001           part bytes + chunkfile footer (size, xxh3, part checksums, MD5 if wanted)
    <upload-id>/.tmp-00001-<token>   a part being received (renamed to part-NNNNN when verified)
    <upload-id>/complete.json        written once the object is published (answers a retried Complete)

Upload ids are 32 lower-case hex digits (a nanosecond timestamp then randomness, so they sort by
initiation) and are checked against that form before they name a directory: paths never come from
client text. Keys never become paths either; they live inside ``upload.json``.

Blocking calls run in worker threads. Every ``OSError`` is translated once, by
``backends.fileio.run_io``: a missing upload (or part) is ``UploadNotFound``, no space
``StorageFull``, a dead mount ``TierUnavailable``. What an upload means (who may see it, which parts
a Complete takes) is ``gateway.multipart``'s business.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from backends import chunkfile
from backends.base import ChunkMeta
from backends.errors import ChunkCorrupt, UploadNotFound
from backends.fileio import run_io, write_all

T = TypeVar("T")

COMPLETED_KEEP_SECONDS = 3600.0
TMP_MAX_AGE_SECONDS = 3600.0
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_PART_NAME = re.compile(r"part-(\d{5})")


@dataclass(frozen=True, slots=True)
class CompletedRecord:
    """``complete.json``: the chunk a Complete published."""

    size: int
    checksum: int
    created: float
    md5_etag: str | None = None  # the object's S3 ETag in an MD5-mode bucket


@dataclass(frozen=True, slots=True)
class UploadRecord:
    """``upload.json``, and ``complete.json`` once the upload is completed."""

    upload_id: str
    bucket: str
    key: str
    initiated: float
    attrs: dict[str, str]
    completed: CompletedRecord | None = None


@dataclass(frozen=True, slots=True)
class StagedPart:
    number: int
    meta: ChunkMeta  # from the part's footer: size, xxh3-64, the checksums the client sent
    modified: float


def _write_json_atomic(path: str, doc: Mapping[str, object], fsync: bool) -> None:
    tmp = f"{path}.{secrets.token_hex(4)}.new"
    data = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, [data])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full disk must not leave the temporary record behind
        raise


async def _run(fn: Callable[..., T], *args: object, what: str) -> T:
    return await run_io(fn, *args, what=what, not_found=UploadNotFound)


class PartWriter:
    """A part being received into a private temporary file, renamed into place by ``publish``.
    ``discard`` (on any failure) removes the temporary file; ``close`` releases the descriptor."""

    def __init__(self, upload_dir: str, number: int, fd: int, tmp: str, *, fsync: bool) -> None:
        self._dir = upload_dir
        self._final = f"{upload_dir}/part-{number:05d}"
        self._fd: int | None = fd
        self._tmp = tmp
        self._fsync = fsync

    async def write(self, pieces: list[bytes | memoryview]) -> None:
        assert self._fd is not None
        await _run(write_all, self._fd, pieces, what="write part")

    async def publish(self, pieces: list[bytes | memoryview]) -> None:
        """Write the last pieces (the footer among them), make them durable and rename the part over
        any earlier upload of its number; UploadNotFound if the upload was aborted meanwhile."""

        def finish() -> None:
            assert self._fd is not None
            write_all(self._fd, pieces)
            if self._fsync:
                os.fsync(self._fd)
            if not os.path.exists(f"{self._dir}/upload.json"):
                raise UploadNotFound("the upload was aborted")
            os.rename(self._tmp, self._final)

        await _run(finish, what="publish part")

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class MultipartStaging:
    """The staging directory of multipart uploads (see the module docstring)."""

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)

    def _dir(self, upload_id: str) -> str:
        if not _UPLOAD_ID.fullmatch(upload_id):
            raise UploadNotFound("not an upload id")
        return f"{self.root}/{upload_id}"

    # -- upload records ------------------------------------------------------------------------

    async def create(self, bucket: str, key: str, initiated: float, attrs: Mapping[str, str]) -> str:
        """A new upload's directory and record; its id."""
        upload_id = f"{time.time_ns():016x}"[-16:] + secrets.token_hex(8)
        doc = {"bucket": bucket, "key": key, "initiated": initiated, "attrs": dict(attrs)}

        def make() -> None:
            path = self._dir(upload_id)
            os.mkdir(path, 0o755)
            try:
                _write_json_atomic(f"{path}/upload.json", doc, self.fsync)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)  # no upload directory without its record
                raise

        await _run(make, what="create multipart upload")
        return upload_id

    def _load(self, upload_id: str) -> UploadRecord:
        path = self._dir(upload_id)
        try:
            with open(f"{path}/upload.json", "rb") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise UploadNotFound("no upload record") from None
        except ValueError:
            raise UploadNotFound("the upload's record is damaged") from None
        completed = None
        with contextlib.suppress(FileNotFoundError, ValueError), open(f"{path}/complete.json", "rb") as f:
            done = json.load(f)
            completed = CompletedRecord(int(done["size"]), int(done["checksum"], 16), float(done["created"]),
                                        None if done.get("md5") is None else str(done["md5"]))
        return UploadRecord(upload_id, str(doc["bucket"]), str(doc["key"]), float(doc["initiated"]),
                            {str(k): str(v) for k, v in doc.get("attrs", {}).items()}, completed)

    async def load(self, upload_id: str) -> UploadRecord:
        return await _run(self._load, upload_id, what="read multipart upload")

    async def remove(self, upload_id: str) -> None:
        await _run(shutil.rmtree, self._dir(upload_id), True, what="abort multipart upload")

    async def uploads(self) -> list[UploadRecord]:
        """Every readable upload record (completed ones too), in directory order."""

        def scan() -> list[UploadRecord]:
            found: list[UploadRecord] = []
            for name in os.listdir(self.root):
                if not _UPLOAD_ID.fullmatch(name):
                    continue
                try:
                    found.append(self._load(name))
                except UploadNotFound:
                    continue
            return found

        return await _run(scan, what="list multipart uploads")

    async def retire(self, upload_id: str, completed: CompletedRecord) -> None:
        """Record the published chunk (``complete.json``) and drop the part files."""
        path = self._dir(upload_id)
        doc: dict[str, object] = {"size": completed.size, "checksum": f"{completed.checksum:016x}",
                                  "created": completed.created}
        if completed.md5_etag is not None:
            doc["md5"] = completed.md5_etag

        def retire() -> None:
            _write_json_atomic(f"{path}/complete.json", doc, self.fsync)
            for name in os.listdir(path):
                if _PART_NAME.fullmatch(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{path}/{name}")

        await _run(retire, what="retire multipart upload")

    # -- parts ---------------------------------------------------------------------------------

    async def open_part(self, upload_id: str, number: int) -> PartWriter:
        path = self._dir(upload_id)
        tmp = f"{path}/.tmp-{number:05d}-{secrets.token_hex(6)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = await _run(os.open, tmp, flags, 0o644, what="create part file")
        return PartWriter(path, number, fd, tmp, fsync=self.fsync)

    async def parts(self, upload_id: str) -> list[StagedPart]:
        """The complete parts, by number (a part whose footer is unreadable is not listed)."""
        path = self._dir(upload_id)

        def scan() -> list[StagedPart]:
            parts: list[StagedPart] = []
            for name in os.listdir(path):
                match = _PART_NAME.fullmatch(name)
                if match is None:
                    continue
                try:
                    meta = chunkfile.read_meta(f"{path}/{name}")
                    modified = os.stat(f"{path}/{name}").st_mtime
                except (FileNotFoundError, ChunkCorrupt):
                    continue
                parts.append(StagedPart(int(match.group(1)), meta, modified))
            parts.sort(key=lambda p: p.number)
            return parts

        return await _run(scan, what="list parts")

    async def map_part(self, upload_id: str, number: int, size: int) -> mmap.mmap:
        """The part's first ``size`` bytes as a read-only mapping, populated in the worker thread (so
        hashing and writing them never fault on the event loop). ChunkCorrupt if the file is shorter."""
        path = f"{self._dir(upload_id)}/part-{number:05d}"

        def open_map() -> mmap.mmap:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if os.fstat(fd).st_size < size:
                    raise ChunkCorrupt(f"part {number} is shorter than recorded")
                return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            finally:
                os.close(fd)

        return await _run(open_map, what="read part")

    # -- reclaiming ----------------------------------------------------------------------------

    async def sweep(self, *, max_age: float, now: float, limit: int) -> int:
        """Remove uploads idle for ``max_age`` seconds, completed uploads older than
        ``COMPLETED_KEEP_SECONDS`` and part files of dead writers; at most ``limit`` uploads a pass."""
        return await _run(self._sweep_sync, max_age, now, limit, what="sweep multipart uploads")

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
