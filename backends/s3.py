"""The S3 tier: chunks as objects in one bucket of any S3-compatible store, through aiobotocore.

Layout in the bucket::

    <prefix><32 hex digest>                the chunk object. A chunk of at most ``part_size`` bytes:
                                           data + chunkfile footer, byte-identical to the file the
                                           POSIX tier stores (so self-describing here too). A larger
                                           one: a *manifest*, the footer alone, whose
                                           ``x-amz-meta-kvgw-data: <token>`` names its data object
    <prefix><digest>.<32 hex token>        a larger chunk's data object: data + footer, written by one
                                           multipart upload under a key only that writer uses
    <quarantine_prefix><digest>.<unix s>   chunks that failed verification (data + footer)
    (multipart uploads under <prefix>)     in-progress writes; never visible as objects

Every chunk object carries ``x-amz-meta-kvgw-size`` / ``-checksum`` (data size and xxh3), which must
agree with the footer; the footer is authoritative. ``stat`` costs one request, a suffix-range GET of
the chunk object's last 4 KiB: the footer plus the metadata headers (a second GET only for footers over
4 KiB). Reads and streams GET the chunk object and, when it is a manifest, the same range of its data
object (a second request, for chunks of more than one part only). ``head(key)`` is the one-HEAD answer
for size and metadata only. Chunks written by earlier versions as one multipart object at
``<prefix><digest>`` (no ``kvgw-data``) read as before.

Every operation goes through ``_call``: the circuit breaker, the attempts and their back-off, an overall
deadline (``operation_timeout``) around all attempts and the body read, and translation of foreign errors
at one boundary (``backends.s3_guard``). Retries are the tier's, not botocore's (its client makes one
attempt per call), so that their number and back-off can depend on who waits: background work gets
``max_attempts`` attempts ``retry_backoff`` apart (doubling), a call on the request path
(``backends.request_path``: a client is waiting) ``request_max_attempts`` attempts
``request_retry_backoff`` apart, all within its budget, which bounds the time to the call's first answer
(a GET's headers; its body then has the operation deadline; until the endpoint has answered once, the
budget also allows ``connect_timeout`` for connecting). A call that runs out of its budget, or
whose caller's deadline cancels it after its budget has run out, counts for the breaker as an
unavailability failure, like a refused connection. The client is created lazily on first use, inside the
running loop (about 0.1 s of service-model loading on that loop, once), and belongs to that loop;
``close`` releases its connection pool.

Create-if-absent relies on ``If-None-Match: *`` on PutObject only (AWS since August 2024, MinIO, Ceph
RGW, moto): every chunk becomes visible through one conditional PutObject, of its bytes or of its
manifest (``backends.s3_staged`` says why not CompleteMultipartUpload: RGW ignores the condition
there). Within one tier instance the conditional step of a key is serialised (``publish_lock``),
whatever the store. With ``conditional_writes=False`` the tier checks with a HEAD first instead: two
gateways racing between that HEAD and their write can then both report a win, and the later write's
bytes stay.

Deleting a manifest chunk deletes the manifest first, then its data object: a reader never finds a
manifest without its data, except one racing the delete itself (it gets ChunkNotFound). Data objects
that no manifest names (the loser of a race that could not delete its own, a writer that died between
completing its data and publishing the manifest, a delete interrupted half-way) are invisible to
readers, count in ``usage``, and are deleted by ``cleanup_staging`` once older than its age limit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from backends import chunkfile
from backends.base import ChunkMeta, check_bytes_soon
from backends.errors import BackendError, ChunkCorrupt, ChunkNotFound, TierUnavailable
from backends.request_path import current_budget
from backends.s3_guard import CircuitBreaker, RangeNotSatisfiable, UploadGone, ensure_bucket, translate
from backends.s3_settings import S3TierSettings
from backends.s3_staged import CHECKSUM_META, DATA_META, SIZE_META, WRITER_META, S3StagedChunk
from backends.tiers import TierId

__all__ = ["S3StagedChunk", "S3Tier", "S3TierSettings"]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)

_TAIL_GUESS = 4096  # bytes fetched from a chunk's end by stat: covers every footer but huge attrs
_DIGEST_HEX = 32


@dataclass(eq=False)
class _CallScope:
    """One ``_call`` in progress: its deadline scope, and when the call got its first answer."""

    scope: asyncio.Timeout
    operation_end: float  # loop time: the operation deadline (all attempts and the body)
    answered: bool = False


_call_scope: ContextVar[_CallScope | None] = ContextVar("kvgw_s3_call_scope", default=None)


def _answered() -> None:
    """Called by an operation once its reply has arrived (a GET's headers): the rest of it (the body)
    runs under the operation deadline, not the request path's first-answer budget."""
    current = _call_scope.get()
    if current is not None and not current.answered:
        current.answered = True
        current.scope.reschedule(current.operation_end)


class S3Tier:
    """Chunks as objects in one bucket; shareable by many gateways (see module docstring)."""

    name = TierId.S3.label

    def __init__(self, settings: S3TierSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (monotonic seconds) times the circuit breaker's cooldown; tests pass a fake one. Deadlines
        and back-offs run on the event loop's clock."""
        self.settings = settings
        self._bucket = settings.bucket
        self._prefix = settings.prefix
        self._breaker = CircuitBreaker(settings.breaker_threshold, settings.breaker_cooldown, clock)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._bucket_ready = not settings.create_bucket
        self._answered_once = False  # until the endpoint has answered a call, budgets allow for connecting
        self._closed = False
        self._live_uploads: set[str] = set()  # this instance's writes in progress: never cleaned
        # Keys whose CreateMultipartUpload is in flight: the store may list the new upload before its
        # reply (and so its id) reaches us; cleanup_staging leaves uploads of these keys alone.
        self._starting_uploads: collections.Counter[str] = collections.Counter()
        self._live_data: set[str] = set()  # data objects of this instance's publishes in progress
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
            retries={"mode": "standard", "total_max_attempts": 1},  # the tier retries itself (_call)
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

    @property
    def circuit_open(self) -> bool:
        """Whether the breaker is open (failing fast, or letting its one probe through)."""
        return self._breaker.is_open

    @property
    def breaker_state(self) -> str:
        """The breaker's state for the stats: "closed", "open" or "half-open" (its probe in flight)."""
        return self._breaker.state

    async def _call(self, what: str, op: Callable[[Any], Awaitable[T]], *, guarded: bool = True) -> T:
        """Run one operation under the breaker, its attempts and its deadlines; foreign errors leave
        translated (module docstring).

        ``guarded=False`` skips the breaker's admission and the request-path budget (reads of a body
        already being streamed: a transfer).
        """
        s = self.settings
        budget = current_budget() if guarded else None
        loop = asyncio.get_running_loop()
        start = loop.time()
        operation_end = start + s.operation_timeout
        # Until the endpoint has answered once, a request-path budget also allows for connecting
        # (connect_timeout): the first call pays for the connection and the endpoint's own warm-up.
        allowance = 0.0 if self._answered_once else s.connect_timeout
        answer_end = operation_end if budget is None else min(operation_end, start + budget.timeout + allowance)
        try:
            probe = self._breaker.admit(what) if guarded else False
        except TierUnavailable:
            if budget is not None:
                budget.unavailable = True
            raise
        call: _CallScope | None = None
        try:
            if self._client is None or not self._bucket_ready:  # once: not charged to a request's budget
                async with asyncio.timeout_at(operation_end):
                    await self._get_client()
            async with asyncio.timeout_at(answer_end) as scope:
                call = _CallScope(scope, operation_end)
                token = _call_scope.set(call)
                try:
                    result = await self._attempts(op, s.max_attempts if budget is None else s.request_max_attempts,
                                                  s.retry_backoff if budget is None else s.request_retry_backoff)
                finally:
                    _call_scope.reset(token)
        except asyncio.CancelledError:
            if budget is not None and (call is None or not call.answered) and loop.time() >= answer_end:
                # the caller's deadline (the same budget, or a tighter one) cancelled a call that had
                # no answer within its budget: the endpoint is as good as unavailable
                budget.unavailable = True
                self._breaker.record(probe=probe, unavailable=True)
            elif probe:
                self._breaker.abandon_probe()
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError) and budget is not None and call is not None and not call.answered:
                exc = TimeoutError(f"no answer within {budget.timeout:.3g} s (request path)")
            error = translate(exc, what)
            unavailable = isinstance(error, TierUnavailable)
            self._answered_once = self._answered_once or not unavailable
            if budget is not None and unavailable:
                budget.unavailable = True
            self._breaker.record(probe=probe, unavailable=unavailable)
            if error is exc:
                raise
            raise error from exc
        self._answered_once = True
        self._breaker.record(probe=probe, unavailable=False)
        return result

    async def _attempts(self, op: Callable[[Any], Awaitable[T]], attempts: int, backoff: float) -> T:
        """Up to ``attempts`` tries of ``op``, retrying what translates to TierUnavailable after a jittered
        exponential back-off ("equal jitter": half of it fixed); gives up early when the back-off would
        not end before the call's deadline."""
        loop = asyncio.get_running_loop()
        attempt = 1
        while True:
            try:
                return await op(await self._get_client())
            except Exception as exc:
                if attempt >= attempts or not isinstance(translate(exc, ""), TierUnavailable):
                    raise
                delay = min(self.settings.retry_backoff_max, backoff * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2
                call = _call_scope.get()
                when = None if call is None else call.scope.when()
                if when is not None and loop.time() + delay >= when:
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    async def api(self, what: str, method: str, **params: Any) -> dict[str, Any]:
        """One S3 API call through ``_call``; returns botocore's response dict."""

        async def op(client: Any) -> dict[str, Any]:
            response: dict[str, Any] = await getattr(client, method)(Bucket=self._bucket, **params)
            return response

        return await self._call(what, op)

    # -- names ----------------------------------------------------------------------------------

    def key_for(self, digest: bytes) -> str:
        return f"{self._prefix}{digest.hex()}"

    @staticmethod
    def data_key(key: str, token: str) -> str:
        """The data object of the chunk object ``key`` written by the writer ``token``."""
        return f"{key}.{token}"

    def _data_name(self, key: str) -> tuple[str, str] | None:
        """(chunk object key, token) for a listed data object's key, else None."""
        chunk_key, dot, token = key.rpartition(".")
        if not dot or self._digest_of(chunk_key) is None or len(token) != _DIGEST_HEX:
            return None
        return (chunk_key, token) if all(c in "0123456789abcdef" for c in token) else None

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
        self._starting_uploads[key] += 1
        try:
            response = await self.api("start multipart upload", "create_multipart_upload", Key=key, Metadata=metadata)
            upload_id = str(response["UploadId"])
            self._live_uploads.add(upload_id)
        finally:
            self._starting_uploads[key] -= 1
            if not self._starting_uploads[key]:
                del self._starting_uploads[key]
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

    def data_in_progress(self, data_key: str, live: bool) -> None:
        """Mark (or unmark) a data object this instance is publishing: never an orphan to cleanup."""
        if live:
            self._live_data.add(data_key)
        else:
            self._live_data.discard(data_key)

    async def delete_quietly(self, key: str) -> None:
        """Delete an object nobody reads (a data object that lost its race); a failure is only logged,
        ``cleanup_staging`` removes it later."""
        try:
            await self.api("delete data object", "delete_object", Key=key)
        except ChunkNotFound:
            pass
        except BackendError as exc:
            log.warning("could not delete %s (left for cleanup_staging): %s", key, exc)

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
            _answered()
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data, _total_size(response.get("ContentRange"), len(data)), response.get("Metadata", {})

        return await self._call(what, op)

    async def _manifest_token(self, key: str, what: str) -> str | None:
        """After a range the chunk object cannot satisfy: its data object's token if it is a manifest
        (None if it is the chunk itself); ChunkNotFound if it is gone."""
        answer = await self.head(key)
        if answer is None:
            raise ChunkNotFound(f"{what}: {key}")
        token = answer.get("Metadata", {}).get(DATA_META)
        return None if token is None else str(token)

    async def read(self, digest: bytes, offset: int, length: int, *, checksum: int | None = None
                   ) -> bytes | memoryview:
        data = await self._read(digest, offset, length)
        await check_bytes_soon(data, checksum)
        return data

    async def _read(self, digest: bytes, offset: int, length: int) -> bytes | memoryview:
        key = self.key_for(digest)
        if length <= 0:
            if not await self.exists(key):
                raise ChunkNotFound(f"read chunk: {key}")
            return b""
        byte_range = f"bytes={offset}-{offset + length - 1}"
        try:
            data, _, metadata = await self._get_range("read chunk", key, byte_range)
            token = metadata.get(DATA_META)
        except RangeNotSatisfiable:
            data, token = b"", await self._manifest_token(key, "read chunk")
        if token is not None:  # a manifest: the bytes are in its data object
            try:
                data, _, _ = await self._get_range("read chunk", self.data_key(key, token), byte_range)
            except RangeNotSatisfiable:
                return b""
        return data  # b"" past the end: a short read, as on a truncated file

    async def stream(self, digest: bytes, offset: int, length: int, window: int) -> AsyncIterator[bytes]:
        key = self.key_for(digest)
        if length <= 0:
            if not await self.exists(key):
                raise ChunkNotFound(f"stream chunk: {key}")
            return
        byte_range = f"bytes={offset}-{offset + length - 1}"

        async def open_body(target: str) -> tuple[Any, dict[str, str]]:
            async def op(client: Any) -> tuple[Any, dict[str, str]]:
                response = await client.get_object(Bucket=self._bucket, Key=target, Range=byte_range)
                return response["Body"], response.get("Metadata", {})

            return await self._call("stream chunk", op)

        body: Any = None
        try:
            body, metadata = await open_body(key)
            token = metadata.get(DATA_META)
        except RangeNotSatisfiable:
            token = await self._manifest_token(key, "stream chunk")
            if token is None:
                return
        if token is not None:  # a manifest: stream its data object instead
            if body is not None:
                body.close()
            try:
                body, _ = await open_body(self.data_key(key, token))
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
        size, checksum = metadata.get(SIZE_META), metadata.get(CHECKSUM_META)
        if DATA_META in metadata:  # a manifest (the footer alone): its data object holds size more bytes
            if size is None or not size.isdigit():
                raise ChunkCorrupt("chunk manifest without its data size", location=key)
            total += int(size)
        meta = chunkfile.decode_meta(body, total)
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

    def absent_now(self, digests: list[bytes]) -> bool:
        return False  # every answer is a request to the server

    # -- removal --------------------------------------------------------------------------------

    async def delete(self, digest: bytes) -> bool:
        key = self.key_for(digest)
        answer = await self.head(key)
        if answer is None:
            return False
        await self._delete_chunk(key, answer)
        return True

    async def _delete_chunk(self, key: str, answer: dict[str, Any]) -> None:
        """The chunk object first (readers stop finding it), then the data object a manifest names."""
        await self.api("delete chunk", "delete_object", Key=key)
        token = answer.get("Metadata", {}).get(DATA_META)
        if token is not None:
            await self.delete_quietly(self.data_key(key, str(token)))

    async def quarantine(self, digest: bytes) -> bool:
        """Copy under the quarantine prefix (a manifest's data object, for a chunk of several parts),
        then delete; if the copy fails (for a reason other than an unreachable endpoint) the chunk is
        deleted anyway: a damaged chunk must stop being served."""
        key = self.key_for(digest)
        answer = await self.head(key)
        if answer is None:
            return False
        token = answer.get("Metadata", {}).get(DATA_META)
        source = key if token is None else self.data_key(key, str(token))
        target = f"{self.settings.quarantine_prefix}{digest.hex()}.{time.time():.0f}"
        try:
            await self.api(
                "quarantine chunk", "copy_object", Key=target, CopySource={"Bucket": self._bucket, "Key": source}
            )
        except TierUnavailable:
            raise
        except ChunkNotFound:
            if source == key:
                return False  # deleted meanwhile
            log.warning("data object of %s is missing, deleting its manifest", key)
        except BackendError as exc:
            log.warning("could not copy %s to quarantine, deleting it: %s", key, exc)
        await self._delete_chunk(key, answer)
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
        the store's clock), and delete data objects that old which no manifest names, except this
        instance's own writes in progress. Other gateways' writes are protected only by age, so keep
        ``older_than`` well above the longest upload. Lists every object under the prefix, and HEADs
        the manifest of each data object past the age limit."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than)
        removed = await self._abort_stale_uploads(cutoff)
        async for page in self._list_pages("list data objects", "list_objects_v2", Prefix=self._prefix):
            for obj in page.get("Contents", []):
                named = self._data_name(obj["Key"])
                modified = obj.get("LastModified")
                if named is None or obj["Key"] in self._live_data or (
                    isinstance(modified, datetime) and modified > cutoff
                ):
                    continue
                chunk_key, token = named
                answer = await self.head(chunk_key)
                if answer is not None and answer.get("Metadata", {}).get(DATA_META) == token:
                    continue  # a manifest names it
                try:
                    await self.api("delete orphaned data object", "delete_object", Key=obj["Key"])
                except ChunkNotFound:
                    continue
                removed += 1
        return removed

    async def _abort_stale_uploads(self, cutoff: datetime) -> int:
        removed = 0
        async for page in self._list_pages("list staged uploads", "list_multipart_uploads", Prefix=self._prefix):
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if upload["UploadId"] in self._live_uploads or upload["Key"] in self._starting_uploads or (
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
