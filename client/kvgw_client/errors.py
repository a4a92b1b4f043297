"""Errors of the kvgw client, raised only to callers that did not pass ``quiet=True``.

Every failure of a call is translated into one of these at a single boundary
(``kvgw_client.http``), so callers never see aiohttp or asyncio exceptions::

    KvgwClientError
    ├── ClientClosed          the client was closed; nothing was sent
    ├── Unavailable           the gateway could not be reached or did not answer in time
    │   ├── CircuitOpen       failing fast: recent calls failed and no probe has succeeded yet
    │   └── ServerError       a 5xx answer (after the retries the policy allows)
    ├── Rejected              a 4xx answer: credentials, key rules, size limits, missing bucket
    └── ProtocolError         the answer broke the wire contract: framing, size, checksum, JSON shape

Two attributes drive the client's policy: ``retryable`` (another attempt may succeed) and ``trips``
(the failure says something about the gateway's health and counts toward opening the circuit).
``kind`` is the short name used in counters and logs.
"""

from __future__ import annotations


class KvgwClientError(Exception):
    kind = "error"
    retryable = False
    trips = False


class ClientClosed(KvgwClientError):
    kind = "closed"

    def __init__(self) -> None:
        super().__init__("the kvgw client is closed")


class Unavailable(KvgwClientError):
    """Connection refused or reset, DNS failure, timeout: the request may or may not have arrived."""

    kind = "unavailable"
    retryable = True
    trips = True

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        if timeout:
            self.kind = "timeout"


class CircuitOpen(Unavailable):
    kind = "circuit_open"
    retryable = False
    trips = False

    def __init__(self, retry_in: float) -> None:
        super().__init__(f"gateway marked unavailable; next probe in {max(retry_in, 0.0):.1f}s")
        self.kind = "circuit_open"
        self.retry_in = retry_in


class _HttpError(KvgwClientError):
    def __init__(self, status: int, code: str, message: str, request_id: str | None) -> None:
        suffix = f" (request {request_id})" if request_id else ""
        super().__init__(f"HTTP {status} {code}: {message}{suffix}")
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


class ServerError(_HttpError, Unavailable):
    """A 5xx answer. 500/502/503/504 are retried; 507 (InsufficientStorage) says nothing about health."""

    kind = "server_error"

    def __init__(self, status: int, code: str, message: str, request_id: str | None) -> None:
        _HttpError.__init__(self, status, code, message, request_id)
        self.timeout = False
        self.kind = "server_error"
        self.retryable = status in (500, 502, 503, 504)
        self.trips = status != 507


class Rejected(_HttpError):
    """A 4xx answer with the gateway's error code; retrying the same request will not help (429 aside)."""

    kind = "rejected"

    def __init__(self, status: int, code: str, message: str, request_id: str | None) -> None:
        super().__init__(status, code, message, request_id)
        self.retryable = status == 429


class ProtocolError(KvgwClientError):
    """The answer does not follow the native API's contract; its data must not be used."""

    kind = "protocol"
    trips = True
