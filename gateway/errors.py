"""Domain errors: what the service tells an API went wrong, independent of any wire format.

Each API maps these to its own status codes and bodies through one table (native: JSON error bodies,
S3: XML error bodies); no handler chooses a status code itself. Backend errors are translated to these
in the service, at one place (``translate_backend_error``).

    KvgwError(code)
    ├── NoSuchBucket, NoSuchChunk
    ├── InvalidKey, InvalidRequest, IncompleteBody, BadDigest, InvalidRange
    ├── MissingContentLength, ChunkTooLarge, PreconditionFailed
    ├── Unauthorized, AccessDenied
    └── InsufficientStorage, ServiceUnavailable, InternalError
"""

from __future__ import annotations

from backends import errors as backend
from gateway.wire import ErrorCode


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


class ServiceUnavailable(KvgwError):
    code = ErrorCode.SERVICE_UNAVAILABLE
    default_message = "a storage tier is unavailable; retry later"


class InternalError(KvgwError):
    code = ErrorCode.INTERNAL_ERROR


def translate_backend_error(exc: backend.BackendError) -> KvgwError:
    """The one place a backend failure becomes a domain error (most specific first)."""
    if isinstance(exc, backend.ChunkNotFound):
        return NoSuchChunk()
    if isinstance(exc, backend.StorageFull):
        return InsufficientStorage()
    if isinstance(exc, backend.TierUnavailable):
        return ServiceUnavailable()
    return InternalError()
