"""S3 error codes: the one table from code to HTTP status and default message, and the error XML.

Handlers and the pure S3 helpers raise ``S3Error`` (or a subclass below); only the front end turns
one into a response, through ``error_response``. No status code appears anywhere else.

Error tree (each class fixes its S3 code; ``S3Error(code, ...)`` covers every other code)::

    S3Error                               code, message, extra XML elements, extra headers
    ├── AuthError                         the request could not be authenticated
    │   ├── SignatureDoesNotMatch         also a bad aws-chunked chunk or trailer signature
    │   ├── InvalidAccessKeyId
    │   ├── AccessDenied                  also an expired or not-yet-valid presigned URL
    │   ├── RequestTimeTooSkewed
    │   ├── AuthorizationHeaderMalformed
    │   ├── AuthorizationQueryParametersError
    │   ├── MissingSecurityHeader
    │   └── UnsupportedAuthorization      InvalidRequest: SigV2, SigV4a, unknown schemes
    └── PayloadError                      the body does not match what the headers promised
        ├── IncompleteBody                body cut short, or decoded length != declared
        ├── MalformedChunkedEncoding      InvalidRequest: bad aws-chunked framing
        ├── MalformedTrailer              unreadable or unannounced trailing header
        ├── BadDigest                     Content-MD5 / x-amz-checksum-* mismatch
        ├── InvalidDigest                 Content-MD5 / x-amz-checksum-* value unreadable
        ├── XAmzContentSHA256Mismatch
        └── EntityTooLarge
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from gateway.api.s3._xmltext import escape_text as escape

__all__ = [
    "ERRORS",
    "AccessDenied",
    "AuthError",
    "AuthorizationHeaderMalformed",
    "AuthorizationQueryParametersError",
    "BadDigest",
    "EntityTooLarge",
    "ErrorResponse",
    "ErrorSpec",
    "IncompleteBody",
    "InvalidAccessKeyId",
    "InvalidDigest",
    "MalformedChunkedEncoding",
    "MalformedTrailer",
    "MissingSecurityHeader",
    "PayloadError",
    "RequestTimeTooSkewed",
    "S3Error",
    "SignatureDoesNotMatch",
    "UnsupportedAuthorization",
    "XAmzContentSHA256Mismatch",
    "error_response",
    "render_error",
]


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    message: str


# Messages are the ones AWS S3 sends, so clients and people recognise them.
ERRORS: Mapping[str, ErrorSpec] = {
    "AccessDenied": ErrorSpec(403, "Access Denied"),
    "AuthorizationHeaderMalformed": ErrorSpec(400, "The authorization header is malformed."),
    "AuthorizationQueryParametersError": ErrorSpec(
        400,
        "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, "
        "X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters.",
    ),
    "BadDigest": ErrorSpec(400, "The Content-MD5 you specified did not match what we received."),
    "BucketAlreadyExists": ErrorSpec(
        409,
        "The requested bucket name is not available. The bucket namespace is shared by all users "
        "of the system. Please select a different name and try again.",
    ),
    "BucketAlreadyOwnedByYou": ErrorSpec(
        409, "Your previous request to create the named bucket succeeded and you already own it."
    ),
    "BucketNotEmpty": ErrorSpec(409, "The bucket you tried to delete is not empty"),
    "EntityTooLarge": ErrorSpec(400, "Your proposed upload exceeds the maximum allowed object size."),
    "EntityTooSmall": ErrorSpec(400, "Your proposed upload is smaller than the minimum allowed object size."),
    "IncompleteBody": ErrorSpec(
        400, "You did not provide the number of bytes specified by the Content-Length HTTP header."
    ),
    "InternalError": ErrorSpec(500, "We encountered an internal error. Please try again."),
    "InvalidAccessKeyId": ErrorSpec(403, "The AWS Access Key Id you provided does not exist in our records."),
    "InvalidArgument": ErrorSpec(400, "Invalid Argument"),
    "InvalidBucketName": ErrorSpec(400, "The specified bucket is not valid."),
    "InvalidDigest": ErrorSpec(400, "The Content-MD5 you specified is not valid."),
    "InvalidPart": ErrorSpec(
        400,
        "One or more of the specified parts could not be found. The part may not have been "
        "uploaded, or the specified entity tag may not match the part's entity tag.",
    ),
    "InvalidPartNumber": ErrorSpec(416, "The requested partnumber is not satisfiable"),
    "InvalidPartOrder": ErrorSpec(
        400,
        "The list of parts was not in ascending order. The parts list must be specified in order by part number.",
    ),
    "InvalidRange": ErrorSpec(416, "The requested range is not satisfiable"),
    "InvalidRequest": ErrorSpec(400, "Invalid Request"),
    "InvalidStorageClass": ErrorSpec(400, "The storage class you specified is not valid"),
    "KeyTooLongError": ErrorSpec(400, "Your key is too long"),
    "MalformedXML": ErrorSpec(
        400,
        "The XML you provided was not well-formed or did not validate against our published schema",
    ),
    "MalformedTrailerError": ErrorSpec(
        400,
        "The request contained trailing data that was not well-formed or did not conform to our published schema.",
    ),
    "MaxMessageLengthExceeded": ErrorSpec(400, "Your request was too big."),
    "MetadataTooLarge": ErrorSpec(400, "Your metadata headers exceed the maximum allowed metadata size."),
    "MethodNotAllowed": ErrorSpec(405, "The specified method is not allowed against this resource."),
    "MissingContentLength": ErrorSpec(411, "You must provide the Content-Length HTTP header."),
    "MissingRequestBodyError": ErrorSpec(400, "Request Body is empty."),
    "MissingSecurityHeader": ErrorSpec(400, "Your request was missing a required header."),
    "NoSuchBucket": ErrorSpec(404, "The specified bucket does not exist"),
    "NoSuchKey": ErrorSpec(404, "The specified key does not exist."),
    "NoSuchUpload": ErrorSpec(
        404,
        "The specified multipart upload does not exist. The upload ID might be invalid, or the "
        "multipart upload might have been aborted or completed.",
    ),
    "NotImplemented": ErrorSpec(501, "A header you provided implies functionality that is not implemented."),
    "NotModified": ErrorSpec(304, "Not Modified"),
    "PreconditionFailed": ErrorSpec(412, "At least one of the pre-conditions you specified did not hold"),
    "RequestTimeTooSkewed": ErrorSpec(
        403, "The difference between the request time and the current time is too large."
    ),
    "RequestTimeout": ErrorSpec(
        400,
        "Your socket connection to the server was not read from or written to within the timeout period.",
    ),
    "ServiceUnavailable": ErrorSpec(503, "Service is unable to handle request."),
    "SignatureDoesNotMatch": ErrorSpec(
        403,
        "The request signature we calculated does not match the signature you provided. Check your "
        "key and signing method.",
    ),
    "SlowDown": ErrorSpec(503, "Please reduce your request rate."),
    "XAmzContentSHA256Mismatch": ErrorSpec(
        400, "The provided 'x-amz-content-sha256' header does not match what was computed."
    ),
}

ExtraValue = str | int


class S3Error(Exception):
    """An S3 error answer. Keyword fields become additional elements of the error XML
    (``S3Error("NoSuchKey", Key=key)``); ``extra`` takes names that are not identifiers.

    ``headers`` are added to the response (``ETag`` on NotModified, ``Retry-After`` on SlowDown).
    An unknown code is a programming error and fails at construction, not when rendering.
    """

    def __init__(
        self,
        code: str,
        message: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, ExtraValue] | None = None,
        **fields: ExtraValue,
    ) -> None:
        spec = ERRORS[code]
        self.code = code
        self.message = message if message is not None else spec.message
        self.status = spec.status
        self.extra: dict[str, str] = {k: str(v) for k, v in {**(extra or {}), **fields}.items()}
        self.headers: dict[str, str] = dict(headers or {})
        super().__init__(f"{code}: {self.message}")


class _Coded(S3Error):
    """A subclass whose code is fixed by the class; only the message and extras vary."""

    CODE: ClassVar[str]

    def __init__(
        self,
        message: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, ExtraValue] | None = None,
        **fields: ExtraValue,
    ) -> None:
        super().__init__(self.CODE, message, headers=headers, extra=extra, **fields)


class AuthError(_Coded):
    CODE = "AccessDenied"


class SignatureDoesNotMatch(AuthError):
    CODE = "SignatureDoesNotMatch"


class InvalidAccessKeyId(AuthError):
    CODE = "InvalidAccessKeyId"


class AccessDenied(AuthError):
    CODE = "AccessDenied"


class RequestTimeTooSkewed(AuthError):
    CODE = "RequestTimeTooSkewed"


class AuthorizationHeaderMalformed(AuthError):
    CODE = "AuthorizationHeaderMalformed"


class AuthorizationQueryParametersError(AuthError):
    CODE = "AuthorizationQueryParametersError"


class MissingSecurityHeader(AuthError):
    CODE = "MissingSecurityHeader"


class UnsupportedAuthorization(AuthError):
    """SigV2, SigV4a or another scheme: S3 answers InvalidRequest and asks for AWS4-HMAC-SHA256."""

    CODE = "InvalidRequest"


class PayloadError(_Coded):
    CODE = "InvalidRequest"


class IncompleteBody(PayloadError):
    CODE = "IncompleteBody"


class MalformedChunkedEncoding(PayloadError):
    CODE = "InvalidRequest"


class MalformedTrailer(PayloadError):
    CODE = "MalformedTrailerError"


class BadDigest(PayloadError):
    CODE = "BadDigest"


class InvalidDigest(PayloadError):
    CODE = "InvalidDigest"


class XAmzContentSHA256Mismatch(PayloadError):
    CODE = "XAmzContentSHA256Mismatch"


class EntityTooLarge(PayloadError):
    CODE = "EntityTooLarge"


def render_error(error: S3Error, *, resource: str = "", request_id: str = "") -> bytes:
    """The ``<Error>`` document. Extras come between Message and Resource, as S3 orders them."""
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>',
        escape(error.code),
        "</Code><Message>",
        escape(error.message),
        "</Message>",
    ]
    for name, value in error.extra.items():
        parts.append(f"<{name}>{escape(value)}</{name}>")
    parts.append(f"<Resource>{escape(resource)}</Resource><RequestId>{escape(request_id)}</RequestId>")
    parts.append("</Error>")
    return "".join(parts).encode("utf-8")


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def error_response(error: S3Error, *, resource: str = "", request_id: str = "", head: bool = False) -> ErrorResponse:
    """Status, ASGI headers and body for ``error``.

    HEAD answers and 304 carry no body (clients then only see the status); the front end still
    sets ``content-length`` from ``len(body)`` and adds its own common headers.
    """
    headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    if request_id:
        headers.append((b"x-amz-request-id", request_id.encode("latin-1")))
    if head or error.status == 304:
        return ErrorResponse(error.status, headers, b"")
    headers.append((b"content-type", b"application/xml"))
    return ErrorResponse(error.status, headers, render_error(error, resource=resource, request_id=request_id))
