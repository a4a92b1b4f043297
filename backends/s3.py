"""The S3 tier: chunks as objects in one bucket of any S3-compatible store, through aiobotocore.

Layout in the bucket::

    <prefix><32 hex digest>                chunk: data + chunkfile footer, byte-identical to the file
                                           the POSIX tier stores (so self-describing here too)
    <quarantine_prefix><digest>.<unix s>   chunks that failed verification
    (multipart uploads under <prefix>)     in-progress writes; never visible as objects

A chunk written in one PutObject (at most ``part_size`` bytes) also carries ``x-amz-meta-kvgw-size`` /
``-checksum`` (data size and xxh3); a multipart one cannot, because user metadata is fixed when the
upload starts, before the checksum is known. The footer is authoritative either way. ``stat`` costs
one request, a suffix-range GET of the last 4 KiB: the footer plus the metadata headers, which must
agree with it (a second GET only for footers over 4 KiB). ``head(key)`` is the one-HEAD answer for
size and metadata only.

Every operation goes through ``_call``: the circuit breaker, an overall deadline
(``operation_timeout``) around all of botocore's attempts and the body read, and translation of foreign
errors at one boundary (``backends.s3_guard``). The client is created lazily on first use, inside the
running loop (about 0.1 s of service-model loading on that loop, once), and belongs to that loop;
``close`` releases its connection pool. Note botocore's ``retries["max_attempts"]`` counts *retries*;
``S3TierSettings.max_attempts`` counts attempts and is passed as ``total_max_attempts``.

Create-if-absent relies on ``If-None-Match: *`` on PutObject and CompleteMultipartUpload (AWS since
August 2024, MinIO; moto 5.2.1 honours both, but checks-then-writes without a lock, so concurrent
multipart completes from different clients can all succeed there). Within one tier instance the
conditional step of a key is serialised (``publish_lock``), whatever the store. With
``conditional_writes=False`` the tier checks with a HEAD first instead: two gateways racing between
that HEAD and their write can then both report a win, and the later write's bytes stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from backends import chunkfile
from backends.base import ChunkMeta
from backends.errors import BackendError, ChunkCorrupt, ChunkNotFound, TierUnavailable
from backends.s3_guard import CircuitBreaker, RangeNotSatisfiable, UploadGone, ensure_bucket, translate
from backends.s3_settings import S3TierSettings
from backends.s3_staged import CHECKSUM_META, SIZE_META, WRITER_META, S3StagedChunk

__all__ = ["S3StagedChunk", "S3Tier", "S3TierSettings"]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)

_TAIL_GUESS = 4096  # bytes fetched from a chunk's end by stat: covers every footer but huge attrs
_DIGEST_HEX = 32


class S3Tier:
    """Chunks as objects in one bucket; shareable by many gateways (see module docstring)."""

    name = "s3"

    def __init__(self, settings: S3TierSettings) -> None:
        self.settings = settings
        self._bucket = settings.bucket
        self._prefix = settings.prefix
        self._breaker = CircuitBreaker(settings.breaker_threshold, settings.breaker_cooldown)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._bucket_ready = not settings.create_bucket
        self._closed = False
        self._live_uploads: set[str] = set()  # this instance's writes in progress: never cleaned
        self._publish_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    # -- the boundary ---------------------------------------------------------------------------

    async def _get_client(self) -> Any:
        if self._closed:
            raise BackendError("S3 tier is closed")
        if self._client is None or not self._bucket_ready:
            async with self._client_lock:
                if self._client is None:
                    self._client = await self._open_client()
                if not self._bucket_ready:
                    await ensure_bucket(self._client, self._bucket, self.settings.region)
                    self._bucket_ready = True
        return self._client

    async def _open_client(self) -> Any:
        s = self.settings
        config = AioConfig(
            connect_timeout=s.connect_timeout,
            read_timeout=s.read_timeout,
            retries={"mode": "standard", "total_max_attempts": s.max_attempts},  # first try included
            max_pool_connections=s.pool_size,
            s3={"addressing_style": s.addressing_style},
            # The footer's xxh3 is verified on every read; skip botocore's CRC32 trailers, which older
            # S3-compatible stores reject and which ranged reads cannot check anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        stack = contextlib.AsyncExitStack()
        client = await stack.enter_async_context(
            get_session().create_client(
                "s3",
                region_name=s.region,
                endpoint_url=s.endpoint_url,
                aws_access_key_id=s.access_key,
                aws_secret_access_key=s.secret_key.get_secret_value() if s.secret_key else None,
                verify=s.verify_tls,
                config=config,
            )
        )
        self._stack = stack
        return client

    async def _call(self, what: str, op: Callable[[Any], Awaitable[T]], *, guarded: bool = True) -> T:
        """Run one operation under the breaker and the deadline; foreign errors leave translated.

        ``guarded=False`` skips the breaker's admission (reads of a body already being streamed).
        """
        probe = self._breaker.admit(what) if guarded else False
        try:
            async with asyncio.timeout(self.settings.operation_timeout):
                result = await op(await self._get_client())
        except asyncio.CancelledError:
            if probe:
                self._breaker.abandon_probe()
            raise
        except Exception as exc:
            error = translate(exc, what)
            self._breaker.record(probe=probe, unavailable=isinstance(error, TierUnavailable))
            if error is exc:
                raise
            raise error from exc
        self._breaker.record(probe=probe, unavailable=False)
        return result

    async def api(self, what: str, method: str, **params: Any) -> dict[str, Any]:
        """One S3 API call through ``_call``; returns botocore's response dict."""

        async def op(client: Any) -> dict[str, Any]:
            response: dict[str, Any] = await getattr(client, method)(Bucket=self._bucket, **params)
            return response

        return await self._call(what, op)

    # -- names ----------------------------------------------------------------------------------

    def key_for(self, digest: bytes) -> str:
        return f"{self._prefix}{digest.hex()}"

    def _digest_of(self, key: str) -> bytes | None:
        """The digest a listed key names, or None for anything ``key_for`` would not have produced."""
        name = key[len(self._prefix) :]
        if len(name) != _DIGEST_HEX:
            return None
        try:
            digest = bytes.fromhex(name)
        except ValueError:
            return None
        return digest if digest.hex() == name else None

    # -- writes (used by S3StagedChunk) ---------------------------------------------------------

    async def stage(self, digest: bytes) -> S3StagedChunk:
        self._breaker.check("stage chunk")  # a dead endpoint fails the PUT before its body is read
        return S3StagedChunk(self, self.key_for(digest))

    async def create_upload(self, key: str, metadata: dict[str, str]) -> str:
        response = await self.api("start multipart upload", "create_multipart_upload", Key=key, Metadata=metadata)
        upload_id = str(response["UploadId"])
        self._live_uploads.add(upload_id)
        return upload_id

    async def upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        response = await self.api(
            "upload chunk part", "upload_part", Key=key, UploadId=upload_id, PartNumber=number, Body=body
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    async def complete_upload(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], *, if_none_match: bool
    ) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        await self.api(
            "publish chunk", "complete_multipart_upload",
            Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **extra,
        )

    async def abort_upload(self, key: str, upload_id: str) -> None:
        await self.api("abort multipart upload", "abort_multipart_upload", Key=key, UploadId=upload_id)

    def forget_upload(self, upload_id: str) -> None:
        self._live_uploads.discard(upload_id)

    def publish_lock(self, key: str) -> asyncio.Lock:
        """Serialises the conditional writes of one key within this instance, so that create-if-absent
        holds between local writers even on a store whose If-None-Match check is not atomic (moto's
        CompleteMultipartUpload); across gateways only the store can guarantee it."""
        lock = self._publish_locks.get(key)
        if lock is None:
            lock = self._publish_locks[key] = asyncio.Lock()
        return lock

    async def put_object(self, key: str, body: bytes, metadata: dict[str, str], *, if_none_match: bool) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        await self.api("publish chunk", "put_object", Key=key, Body=body, Metadata=metadata, **extra)

    async def head(self, key: str) -> dict[str, Any] | None:
        """HeadObject's answer (``ContentLength``, ``Metadata``, ``ETag``), or None if absent."""
        try:
            return await self.api("head chunk", "head_object", Key=key)
        except ChunkNotFound:
            return None

    async def exists(self, key: str) -> bool:
        return await self.head(key) is not None

    async def writer_of(self, key: str) -> str | None:
        """The writer token of the object's write, or None if absent or untagged."""
        answer = await self.head(key)
        return None if answer is None else answer.get("Metadata", {}).get(WRITER_META)

    # -- reads ----------------------------------------------------------------------------------

    async def _get_range(self, what: str, key: str, byte_range: str) -> tuple[bytes, int, dict[str, str]]:
        """(bytes, total object size, user metadata) of one ranged GetObject, body read in the deadline."""

        async def op(client: Any) -> tuple[bytes, int, dict[str, str]]:
            response = await client.get_object(Bucket=self._bucket, Key=key, Range=byte_range)
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data, _total_size(response.get("ContentRange"), len(data)), response.get("Metadata", {})

        return await self._call(what, op)

    async def read(self, digest: bytes, offset: int, length: int) -> bytes | memoryview:
        key = self.key_for(digest)
        if length <= 0:
            if not await self.exists(key):
                raise ChunkNotFound(f"read chunk: {key}")
            return b""
        try:
            data, _, _ = await self._get_range("read chunk", key, f"bytes={offset}-{offset + length - 1}")
        except RangeNotSatisfiable:
            return b""  # starts past the end: a short read, as on a truncated file
        return data

    async def stream(self, digest: bytes, offset: int, length: int, window: int) -> AsyncIterator[bytes]:
        key = self.key_for(digest)
        if length <= 0:
            if not await self.exists(key):
                raise ChunkNotFound(f"stream chunk: {key}")
            return
        byte_range = f"bytes={offset}-{offset + length - 1}"

        async def open_body(client: Any) -> Any:
            return (await client.get_object(Bucket=self._bucket, Key=key, Range=byte_range))["Body"]

        try:
            body = await self._call("stream chunk", open_body)
        except RangeNotSatisfiable:
            return
        try:
            while True:
                piece = await self._call("stream chunk", lambda _: _read_window(body, window), guarded=False)
                if not piece:
                    return
                yield piece
        finally:
            body.close()

    async def stat(self, digest: bytes) -> ChunkMeta:
        return await self._stat_key(self.key_for(digest))

    async def _stat_key(self, key: str) -> ChunkMeta:
        try:
            tail, total, metadata = await self._get_range("stat chunk", key, f"bytes=-{_TAIL_GUESS}")
        except RangeNotSatisfiable as exc:
            raise ChunkCorrupt("chunk object is empty", location=key) from exc
        n = chunkfile.footer_length(tail[-chunkfile.TAIL.size :])
        end = len(tail) - chunkfile.TAIL.size
        if n <= end:
            body = tail[end - n : end]
        else:
            start = total - chunkfile.TAIL.size - n
            if start < 0:
                raise ChunkCorrupt("chunk footer is longer than the chunk", location=key)
            body, _, _ = await self._get_range("stat chunk", key, f"bytes={start}-{start + n - 1}")
        meta = chunkfile.decode_meta(body, total)
        size, checksum = metadata.get(SIZE_META), metadata.get(CHECKSUM_META)
        if (size is not None and size != str(meta.size)) or (
            checksum is not None and checksum != f"{meta.checksum:016x}"
        ):
            raise ChunkCorrupt("chunk footer disagrees with the object's metadata", location=key)
        return meta

    async def _stat_or_none(self, key: str) -> ChunkMeta | None:
        try:
            return await self._stat_key(key)
        except (ChunkNotFound, ChunkCorrupt):
            return None

    async def stat_many(self, digests: list[bytes]) -> list[ChunkMeta | None]:
        keys = [self.key_for(d) for d in digests]
        return await _bounded_map(self._stat_or_none, keys, self.settings.stat_concurrency)

    # -- removal --------------------------------------------------------------------------------

    async def delete(self, digest: bytes) -> bool:
        key = self.key_for(digest)
        if not await self.exists(key):
            return False
        await self.api("delete chunk", "delete_object", Key=key)
        return True

    async def quarantine(self, digest: bytes) -> bool:
        """Copy under the quarantine prefix, then delete; if the copy fails (for a reason other than an
        unreachable endpoint) the chunk is deleted anyway: a damaged chunk must stop being served."""
        key = self.key_for(digest)
        target = f"{self.settings.quarantine_prefix}{digest.hex()}.{time.time():.0f}"
        try:
            await self.api(
                "quarantine chunk", "copy_object", Key=target, CopySource={"Bucket": self._bucket, "Key": key}
            )
        except ChunkNotFound:
            return False
        except TierUnavailable:
            raise
        except BackendError as exc:
            log.warning("could not copy %s to quarantine, deleting it: %s", key, exc)
            return await self.delete(digest)
        await self.api("delete chunk", "delete_object", Key=key)
        return True

    # -- listing --------------------------------------------------------------------------------

    async def _list_pages(self, what: str, method: str, **params: Any) -> AsyncIterator[dict[str, Any]]:
        """Pages of a listing, one deadline each. ListObjectsV2 continues with a token, the multipart
        listing with key and upload-id markers."""
        more: dict[str, Any] = {}
        while True:
            page = await self.api(what, method, **params, **more)
            yield page
            if not page.get("IsTruncated"):
                return
            if "NextContinuationToken" in page:
                more = {"ContinuationToken": page["NextContinuationToken"]}
            else:
                more = {"KeyMarker": page.get("NextKeyMarker", ""),
                        "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    async def scan(self) -> AsyncIterator[tuple[bytes, ChunkMeta | None]]:
        """Listing order (ascending digest); footers read ``stat_concurrency`` at a time per page.
        Chunks deleted between listing and footer read are skipped."""

        async def meta_of(key: str) -> tuple[bool, ChunkMeta | None]:
            try:
                return True, await self._stat_key(key)
            except ChunkNotFound:
                return False, None
            except ChunkCorrupt:
                return True, None

        async for page in self._list_pages("list chunks", "list_objects_v2", Prefix=self._prefix):
            found = [(d, o["Key"]) for o in page.get("Contents", []) if (d := self._digest_of(o["Key"]))]
            metas = await _bounded_map(meta_of, [k for _, k in found], self.settings.stat_concurrency)
            for (digest, _), (present, meta) in zip(found, metas, strict=True):
                if present:
                    yield digest, meta

    async def cleanup_staging(self, older_than: float) -> int:
        """Abort multipart uploads under the prefix started more than ``older_than`` seconds ago (by
        the store's clock), except this instance's own writes in progress. Other gateways' writes are
        protected only by age, so keep ``older_than`` well above the longest upload."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
        removed = 0
        async for page in self._list_pages("list staged uploads", "list_multipart_uploads", Prefix=self._prefix):
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if upload["UploadId"] in self._live_uploads or (
                    isinstance(initiated, datetime) and initiated > cutoff
                ):
                    continue
                try:
                    await self.abort_upload(upload["Key"], upload["UploadId"])
                except (UploadGone, ChunkNotFound):
                    continue  # completed or aborted meanwhile
                removed += 1
        return removed

    async def usage(self) -> int:
        total = 0
        async for page in self._list_pages("measure tier usage", "list_objects_v2", Prefix=self._prefix):
            total += sum(int(o.get("Size", 0)) for o in page.get("Contents", []))
        return total

    async def close(self) -> None:
        self._closed = True
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()


def _total_size(content_range: str | None, fallback: int) -> int:
    """The object's size from ``Content-Range: bytes a-b/total`` (a 200 answer has none)."""
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return fallback


async def _read_window(body: Any, window: int) -> bytes:
    """Up to ``window`` bytes of a streaming body; short only at its end."""
    pieces: list[bytes] = []
    have = 0
    while have < window:
        piece: bytes = await body.read(window - have)
        if not piece:
            break
        pieces.append(piece)
        have += len(piece)
    return b"".join(pieces)


async def _bounded_map(fn: Callable[[T], Awaitable[R]], items: Iterable[T], limit: int) -> list[R]:
    """``[await fn(x) for x in items]`` with at most ``limit`` running; the first error cancels the rest
    and is raised as itself (not as an ExceptionGroup)."""
    work = list(enumerate(items))
    results: dict[int, R] = {}
    queue = iter(work)

    async def worker() -> None:
        for index, item in queue:
            results[index] = await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(limit, len(work))):
                group.create_task(worker())
    except BaseExceptionGroup as grouped:
        first = _first_leaf(grouped)
        raise first from first.__cause__
    return [results[index] for index in range(len(work))]


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
