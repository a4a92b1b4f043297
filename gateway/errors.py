"""Domain errors: what the service tells an API went wrong, independent of any wire format.

Every domain error of the gateway is defined here, each with its machine-readable ``code``. Each API
maps them to its own status codes and bodies through one table keyed by class (native:
``gateway.api.native.STATUS``, JSON error bodies; S3: ``gateway.api.s3.app.DOMAIN_CODES``, XML error
bodies); no handler chooses a status code itself, and ``tests/unit/test_error_tables.py`` fails when
a class is missing from either table. Backend errors are translated to these at one place
(``translate_backend_error``).

    KvgwError(code)
    ├── NoSuchBucket, NoSuchChunk
    ├── InvalidKey, InvalidRequest, IncompleteBody, BadDigest, InvalidRange
    ├── MissingContentLength, ChunkTooLarge, EmptyChunk, PreconditionFailed
    ├── Unauthorized, AccessDenied
    ├── InsufficientStorage (Declined), ServiceUnavailable, InternalError
    ├── MethodNotAllowed, NotFound                     the native API's routing
    ├── NoSuchUpload, InvalidPart, EntityTooSmall      multipart uploads (S3 API)
    └── InvalidBucketName, BucketAlreadyOwned, BucketNotEmpty   bucket create / delete (S3 API)
"""

from __future__ import annotations

from backends import errors as backend
from kvgw_client.wire import ErrorCode


class KvgwError(Exception):
    code: str = ErrorCode.INTERNAL_ERROR
    default_message = "internal error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)
        self.message = message or self.default_message


class NoSuchBucket(KvgwError):
    code = ErrorCode.NO_SUCH_BUCKET
    default_message = "the bucket does not exist"


class NoSuchChunk(KvgwError):
    code = ErrorCode.NO_SUCH_CHUNK
    default_message = "the chunk does not exist"


class InvalidKey(KvgwError):
    code = ErrorCode.INVALID_KEY
    default_message = "invalid key"


class InvalidRequest(KvgwError):
    code = ErrorCode.INVALID_REQUEST
    default_message = "malformed request"


class IncompleteBody(KvgwError):
    code = ErrorCode.INCOMPLETE_BODY
    default_message = "the body ended before Content-Length bytes arrived"


class BadDigest(KvgwError):
    code = ErrorCode.BAD_DIGEST
    default_message = "the body does not match the checksum sent with it"


class InvalidRange(KvgwError):
    code = ErrorCode.INVALID_RANGE
    default_message = "the requested range is not satisfiable"

    def __init__(self, size: int, message: str | None = None) -> None:
        super().__init__(message)
        self.size = size


class MissingContentLength(KvgwError):
    code = ErrorCode.MISSING_CONTENT_LENGTH
    default_message = "Content-Length is required"


class ChunkTooLarge(KvgwError):
    code = ErrorCode.CHUNK_TOO_LARGE
    default_message = "the chunk is larger than the bucket allows"


class EmptyChunk(KvgwError):
    """A write with no bytes. A KV-cache chunk is never empty, so an empty body is a client's mistake (a
    file that was never written, an unset variable) and is refused before anything is stored; buckets
    that hold generic S3 objects may allow empty ones (``kvgw bucket create|update --allow-empty-objects``)."""

    code = ErrorCode.EMPTY_CHUNK
    default_message = "the body is empty"

    @classmethod
    def in_bucket(cls, bucket: str) -> EmptyChunk:
        """The refusal with what to do about it, naming the bucket."""
        return cls(f"the body is empty, so nothing was stored: a KV-cache chunk is never empty (bucket "
                   f"{bucket!r} refuses empty objects; kvgw bucket update {bucket} --allow-empty-objects "
                   "accepts them)")


class PreconditionFailed(KvgwError):
    code = ErrorCode.PRECONDITION_FAILED
    default_message = "a precondition failed"


class Unauthorized(KvgwError):
    code = ErrorCode.UNAUTHORIZED
    default_message = "valid credentials are required"


class AccessDenied(KvgwError):
    code = ErrorCode.ACCESS_DENIED
    default_message = "access denied"


class InsufficientStorage(KvgwError):
    code = ErrorCode.INSUFFICIENT_STORAGE
    default_message = "the storage tier is full"


class Declined(InsufficientStorage):
    """A write admission did not take: the tier is at its watermarks and the chunk is predicted to be
    read again less than what storing it would evict (``gateway.lifecycle.admission``). Not a failure:
    the native API answers 507 with ``X-Kvgw-Declined``, and clients treat it as "not stored"."""

    code = ErrorCode.DECLINED
    default_message = "not stored: the tier is full of chunks more likely to be read again"

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ServiceUnavailable(KvgwError):
    code = ErrorCode.SERVICE_UNAVAILABLE
    default_message = "a storage tier is unavailable; retry later"


class InternalError(KvgwError):
    code = ErrorCode.INTERNAL_ERROR


# -- the native API's routing --------------------------------------------------------------------


class MethodNotAllowed(KvgwError):
    code = ErrorCode.METHOD_NOT_ALLOWED
    default_message = "method not allowed on this resource"


class NotFound(KvgwError):
    code = ErrorCode.NOT_FOUND
    default_message = "no such API endpoint"


# -- multipart uploads (codes are S3's) ----------------------------------------------------------


class NoSuchUpload(KvgwError):
    code = "NoSuchUpload"
    default_message = "the multipart upload does not exist (aborted, completed or never started)"


class InvalidPart(KvgwError):
    code = "InvalidPart"
    default_message = "a listed part was not uploaded or its ETag does not match"


class EntityTooSmall(KvgwError):
    code = "EntityTooSmall"
    default_message = "a part other than the last is smaller than the minimum part size"


# -- bucket create / delete (codes are S3's) -----------------------------------------------------


class InvalidBucketName(KvgwError):
    code = "InvalidBucketName"
    default_message = "the bucket name breaks the naming rules"


class BucketAlreadyOwned(KvgwError):
    code = "BucketAlreadyOwnedByYou"
    default_message = "the bucket already exists"


class BucketNotEmpty(KvgwError):
    code = "BucketNotEmpty"
    default_message = "the bucket is not empty"


def translate_backend_error(exc: backend.BackendError) -> KvgwError:
    """The one place a backend failure becomes a domain error (most specific first)."""
    if isinstance(exc, backend.ChunkNotFound):
        return NoSuchChunk()
    if isinstance(exc, backend.UploadNotFound):
        return NoSuchUpload()
    if isinstance(exc, backend.StorageFull):
        return InsufficientStorage()
    if isinstance(exc, backend.TierUnavailable):
        return ServiceUnavailable()
    return InternalError()
