"""The S3 tier's one error boundary: botocore / aiohttp / timeout errors in, ``backends.errors`` out.

``translate`` is the only place that looks at botocore exception classes, S3 error codes or HTTP
statuses (most specific first, like httpx's ``map_httpcore_exceptions``)::

    ClientError NoSuchKey, 404 without a code   → ChunkNotFound
                ConditionalRequestConflict/409  → WriteConflict (a ChunkExists: a concurrent
                                                  conditional write is in progress; retry)
                PreconditionFailed / 412        → ChunkExists   (create-if-absent lost)
                InvalidRange / 416              → RangeNotSatisfiable (read past the end)
                NoSuchUpload                    → UploadGone    (aborted or completed elsewhere)
                XMinioStorageFull, quota codes  → StorageFull
                5xx, 429, SlowDown, RequestTimeout → TierUnavailable (botocore has already retried)
                anything else (403, NoSuchBucket, ...) → BackendError
    ConnectionError, HTTPClientError (refused, reset, connect/read timeouts), TimeoutError (our
    operation deadline, or the request path's budget), aiohttp.ClientError, OSError → TierUnavailable
    any other BotoCoreError (credentials, parameters)                     → BackendError

The three private subclasses never leave the S3 tier as such to anyone who does not ask: they are
``BackendError`` / ``ChunkExists`` to everybody else.

``CircuitBreaker`` turns a dead or hung endpoint into immediate ``TierUnavailable`` answers: after
``threshold`` consecutive unavailability failures (errors, and calls that ran out of time: the tier
reports both) it opens for ``cooldown`` seconds, then lets exactly one probe through while every other
call keeps failing fast; the probe's success closes it, its failure opens it again for a full cooldown.
Answers that prove the endpoint alive (404, 412, 403, ...) count as successes. One event loop, so no
locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

from backends.errors import BackendError, ChunkExists, ChunkNotFound, StorageFull, TierUnavailable


class RangeNotSatisfiable(BackendError):
    """A ranged read starts at or past the end of the object (HTTP 416)."""


class UploadGone(BackendError):
    """The multipart upload no longer exists: aborted by a cleanup, or already completed."""


class WriteConflict(ChunkExists):
    """S3 409 ConditionalRequestConflict: another conditional write of the key is in flight."""


_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412"}
_FULL_CODES = {"XMinioStorageFull", "QuotaExceeded", "XMinioAdminBucketQuotaExceeded"}
_UNAVAILABLE_CODES = {
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling", "ThrottlingException",
    "XMinioServerNotInitialized",
}
_BUCKET_EXISTS_CODES = {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}


def _code_and_status(exc: ClientError) -> tuple[str, int]:
    response: dict[str, Any] = exc.response
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def translate(exc: BaseException, what: str) -> BackendError:
    """The backend error for a foreign one; the caller raises it ``from exc``."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, ClientError):
        code, status = _code_and_status(exc)
        message = str(exc.response.get("Error", {}).get("Message", "") or "")
        detail = f"{what}: {code or status} {message}".rstrip()
        if code in _NOT_FOUND_CODES or (status == 404 and not code):
            return ChunkNotFound(detail)
        if code == "ConditionalRequestConflict":
            return WriteConflict(detail)
        if code in _EXISTS_CODES or status == 412:
            return ChunkExists(detail)
        if code == "InvalidRange" or status == 416:
            return RangeNotSatisfiable(detail)
        if code == "NoSuchUpload":
            return UploadGone(detail)
        if code in _FULL_CODES:
            return StorageFull(detail)
        if code in _UNAVAILABLE_CODES or status >= 500 or status == 429:
            return TierUnavailable(detail)
        return BackendError(detail)
    if isinstance(exc, ConnectionError | HTTPClientError):  # refused, reset, connect/read timeouts
        return TierUnavailable(f"{what}: {exc}")
    if isinstance(exc, TimeoutError):  # the operation deadline or the request path's budget (asyncio.timeout)
        return TierUnavailable(f"{what}: {exc or 'no answer within the operation deadline'}")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return TierUnavailable(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, BotoCoreError):
        return BackendError(f"{what}: {exc}")
    return BackendError(f"{what}: {type(exc).__name__}: {exc}")


async def ensure_bucket(client: Any, bucket: str, region: str) -> None:
    """Create the bucket unless it exists (development convenience: ``create_bucket``)."""
    params: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":
        params["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        await client.create_bucket(**params)
    except ClientError as exc:
        if _code_and_status(exc)[0] not in _BUCKET_EXISTS_CODES:
            raise


class CircuitBreaker:
    """Closed → (threshold failures) → open → (cooldown) → one probe → closed, or open again."""

    def __init__(self, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._threshold = threshold
        self._cooldown = cooldown
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    @property
    def state(self) -> str:
        """"closed", "open" (failing fast), or "half-open" (its one probe in flight)."""
        if self._open_until is None:
            return "closed"
        return "half-open" if self._probing else "open"

    @property
    def probing(self) -> bool:
        """Whether the one half-open probe is in flight (every other call fails fast meanwhile)."""
        return self._probing

    def check(self, what: str) -> None:
        """Fail fast while open and not yet due for a probe; takes no probe slot (for no-I/O calls)."""
        if self._open_until is not None and (self._probing or self._clock() < self._open_until):
            raise TierUnavailable(f"{what}: S3 endpoint marked unavailable (circuit open), failing fast")

    def admit(self, what: str) -> bool:
        """Raise TierUnavailable while open; return True when this call is the half-open probe."""
        if self._open_until is None:
            return False
        self.check(what)
        self._probing = True
        return True

    def record(self, *, probe: bool, unavailable: bool) -> None:
        if probe:
            self._probing = False
        if not unavailable:
            self._failures = 0
            self._open_until = None
            return
        self._failures += 1
        if probe or self._failures >= self._threshold:
            self._open_until = self._clock() + self._cooldown

    def abandon_probe(self) -> None:
        """The probe was cancelled without an answer: let the next call probe instead."""
        self._probing = False
