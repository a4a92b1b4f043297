"""The client's failure policy, in one place: retries, the circuit and its probe, failure accounting,
and the boundary where foreign errors become client errors.

* ``translate`` is the one boundary where aiohttp/asyncio/OS errors become ``KvgwClientError``s (most
  specific first), and ``error_from`` turns an error response into one (the gateway's code, message
  and request id).
* ``CallPolicy.attempts`` runs one request: every call is idempotent on this API (reads, and write-once
  PUTs whose retry answers "existed"), so an attempt that failed ``retryable`` is retried with jittered
  backoff. Failures that say something about the gateway (``trips``) feed the ``Circuit``: after N in
  a row calls fail fast with CircuitOpen and a background probe decides when to try again. Every
  failure is counted and logged once per burst (``FailureLog``).
* ``CallPolicy.op`` wraps a public operation: the caller's deadline over all attempts, and ``quiet``
  (any gateway-side failure becomes the call's neutral answer instead of an exception; programming
  errors still raise).

Everything here runs on the client's I/O loop, except ``calm``, which any thread may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import aiohttp

from kvgw_client import wire
from kvgw_client.config import ClientSettings
from kvgw_client.errors import (
    CircuitOpen,
    ClientClosed,
    KvgwClientError,
    ProtocolError,
    Rejected,
    ServerError,
    Unavailable,
)
from kvgw_client.health import Circuit, CircuitState, Counters, FailureLog
from kvgw_client.response import StreamError

T = TypeVar("T")

_ERROR_BODY_LIMIT = 64 << 10


@contextlib.asynccontextmanager
async def translate(what: str) -> AsyncIterator[None]:
    """The one boundary where aiohttp/asyncio/OS errors become client errors (``translated``)."""
    try:
        yield
    except KvgwClientError:
        raise
    except Exception as exc:
        err = translated(what, exc)
        if err is None:
            raise
        raise err from exc


def translated(what: str, exc: BaseException) -> KvgwClientError | None:
    """The client error an aiohttp/asyncio/OS error stands for (most specific first); None for anything
    else (a programming error, which stays what it is)."""
    if isinstance(exc, TimeoutError):  # includes aiohttp.ServerTimeoutError and asyncio.timeout()
        return Unavailable(f"{what}: timed out", timeout=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Unavailable(f"{what}: cannot connect: {exc}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return Unavailable(f"{what}: response cut short: {exc}")
    if isinstance(exc, (aiohttp.ClientResponseError, StreamError)):
        return ProtocolError(f"{what}: malformed response: {exc}")
    if isinstance(exc, aiohttp.ClientError):
        return Unavailable(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, OSError):
        return Unavailable(f"{what}: {type(exc).__name__}: {exc}")
    return None


async def error_from(resp: aiohttp.ClientResponse) -> KvgwClientError:
    """The client error an error response stands for: ServerError for 5xx, Rejected for the rest."""
    body = b""
    with contextlib.suppress(Exception):
        body = await resp.content.read(_ERROR_BODY_LIMIT)
    return error_for(resp.status, resp.reason or "", resp.headers.get(wire.H_REQUEST_ID), body)


def error_for(status: int, reason: str, request_id: str | None, body: bytes | bytearray) -> KvgwClientError:
    """``error_from`` for an answer already read: its status, reason, request id header and body (kvgw's
    JSON error, whose code, message and request id win when present)."""
    code, message = "HTTP", reason
    with contextlib.suppress(Exception):
        err = json.loads(body)["error"]
        code = str(err.get("code") or code)
        message = str(err.get("message") or message)
        request_id = str(err.get("request_id") or request_id or "") or None
    if status >= 500:
        return ServerError(status, code, message, request_id)
    return Rejected(status, code, message, request_id)


class CallPolicy:
    """Retries, circuit, probe and accounting for one client. ``probe`` asks the gateway whether it is
    ready (never raises); ``is_closed`` says whether the client was closed."""

    def __init__(
        self,
        settings: ClientSettings,
        logger: logging.Logger,
        counters: Counters,
        *,
        probe: Callable[[], Awaitable[bool]],
        is_closed: Callable[[], bool],
        clock: Callable[[], float],
        rand: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._log = logger
        self._counters = counters
        self._probe_once = probe
        self._is_closed = is_closed
        self._rand = rand
        self.circuit = Circuit(settings.health, clock)
        self.failures = FailureLog(logger, f"kvgw {settings.url} bucket {settings.bucket}", clock)
        self._probe: asyncio.Task[None] | None = None

    async def op(
        self, op: str, body: Callable[[], Awaitable[T]], *, quiet: bool, fallback: T, deadline: float | None,
        spent: float = 0.0, counted: bool = False,
    ) -> T:
        """One public operation: the caller's deadline over all attempts, and ``quiet``. ``spent``: the
        seconds of ``deadline`` already used (by a first attempt made on the caller's thread, which also
        ``counted`` the call)."""
        if not counted:
            self._counters.add(f"{op}.calls")
        try:
            if deadline is None:
                return await body()
            async with asyncio.timeout(max(0.0, deadline - spent)):
                return await body()
        except TimeoutError as exc:
            err = Unavailable(f"{op}: no answer within {deadline}s", timeout=True)
            self.note_failure(op, err)
            if quiet:
                return fallback
            raise err from exc
        except KvgwClientError:
            if quiet:
                return fallback
            raise

    @property
    def calm(self) -> bool:
        """The circuit is closed with no failure since the last success: an attempt made off the I/O
        loop (``KvgwClient``'s blocking lookups) may go ahead, and its success changes nothing here. Read
        from any thread (a stale answer costs one hand-off to the loop, nothing else)."""
        return (self.circuit.state is CircuitState.CLOSED and not self.circuit.consecutive_failures
                and not self.failures.in_burst)

    async def attempts(self, op: str, attempt: Callable[[], Awaitable[T]], *,
                       failed: KvgwClientError | None = None) -> T:
        """Retries, circuit and accounting around one request; a final failure is noted and raised.
        ``failed``: how a first attempt made elsewhere (on a caller's thread) failed; it counts as this
        call's first attempt."""
        retry = 0
        while True:
            if failed is None:
                if self._is_closed():
                    raise ClientClosed()
                if not self.circuit.allow():
                    refused = CircuitOpen(self.circuit.retry_in())
                    self.note_failure(op, refused)
                    raise refused
                try:
                    result = await attempt()
                except KvgwClientError as attempt_failed:
                    failed = attempt_failed
                else:
                    self.circuit.on_success()
                    self.failures.success()
                    return result
            err, failed = failed, None
            if err.retryable and retry + 1 < self._settings.retry.attempts:
                self._trip(err)
                if self.circuit.allow():
                    self._counters.add(f"{op}.retries")
                    await asyncio.sleep(self._settings.retry.delay(retry, self._rand()))
                    retry += 1
                    continue
                self.failures.failure(op, err.kind, str(err))
                raise err
            self.note_failure(op, err)
            raise err

    def note_failure(self, op: str, err: KvgwClientError) -> None:
        self._trip(err)
        self.failures.failure(op, err.kind, str(err))

    def recovered(self) -> None:
        """A probe outside the loop (``ping``) succeeded: close an open circuit."""
        if self.circuit.state is not CircuitState.CLOSED:
            self.circuit.on_success()
            self.failures.success()

    def stop_probing(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    def _trip(self, err: KvgwClientError) -> None:
        if not err.trips:
            return
        if self.circuit.on_failure():
            self._log.warning(
                "kvgw %s: %d consecutive failures; failing fast, next probe in %.1fs",
                self._settings.url, self.circuit.consecutive_failures, self.circuit.retry_in(),
            )
            if self._probe is None and not self._is_closed():
                self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        try:
            while not self._is_closed() and self.circuit.state is not CircuitState.CLOSED:
                await asyncio.sleep(max(0.0, self.circuit.retry_in()))
                if not self.circuit.begin_probe():
                    continue
                ok = await self._probe_once()
                self.circuit.end_probe(ok)
                self._counters.add("probe.ok" if ok else "probe.failed")
                if ok:
                    self.failures.success()
        finally:
            self._probe = None
