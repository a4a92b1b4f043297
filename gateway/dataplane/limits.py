"""Connection-level limits and the answers given below the APIs (a request the parser rejects, a head
that never completes, too many connections), in the form the client speaks.

Every answer given here is a complete HTTP/1.1 response for a connection about to close
(``connection: close``), with a request id: kvgw's JSON error (``{"error": {"code", "message",
"request_id"}}``, ``x-kvgw-request-id``) for the native API and the control plane, S3's XML ``<Error>``
(``x-amz-request-id``) for a request that looks like an S3 SDK's (SigV4's marks: an ``AWS4-``
authorization, ``x-amz-`` headers, a presigned URL's ``X-Amz-`` parameters, so far as the request was
parsed), so that an S3 SDK reports the error instead of failing to parse the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.api.http import new_request_id
from gateway.api.s3.errors import S3Error, render_error

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 414: b"URI Too Long", 500: b"Internal Server Error",
           503: b"Service Unavailable"}

S3_CODES = {400: "InvalidRequest", 408: "RequestTimeout", 414: "InvalidRequest", 500: "InternalError",
           503: "ServiceUnavailable"}
"""The S3 error code for each status answered here (S3 clients read the code, not kvgw's)."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds for a request head, from the connection's or request's first byte
    idle_timeout: float = 30.0  # seconds a keep-alive connection may wait for its next request
    max_connections: int = 10_000  # open connections per process
    max_connections_per_client: int = 1_000  # open connections per client address, per process
    max_url_bytes: int = 16 * 1024  # request target (path and query); S3 keys are at most 1 KiB (3 KiB encoded)
    send_stall_timeout: float = 60.0  # seconds a response may wait for a client that reads nothing


def refusal(status: int, code: str, message: str, *, s3: bool = False) -> bytes:
    """A complete response carrying the error, for a connection about to close."""
    request_id = new_request_id()
    if s3:
        body = render_error(S3Error(S3_CODES[status], message), request_id=request_id)
        kind, id_header = b"application/xml", b"x-amz-request-id"
    else:
        body = orjson.dumps({"error": {"code": code, "message": message, "request_id": request_id}})
        kind, id_header = b"application/json", b"x-kvgw-request-id"
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s: %s\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], kind, len(body), id_header, request_id.encode()))
    return head + body
