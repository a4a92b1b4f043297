"""Real S3 clients as ground truth: capture what botocore (and awscrt) put on the wire, without a network.

A ``before-send`` hook records botocore's prepared request and answers it with a canned response, so
tests see the exact method, raw path, query, headers and body a real client sends, and can feed
rendered XML back through botocore's own response parser.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import botocore.session
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.config import Config

from gateway.api.s3.auth import AuthResult, authenticate

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
ACCESS_KEY = "AKIDEXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
SECRETS = {ACCESS_KEY: SECRET}


@dataclass(frozen=True)
class Wire:
    """One request as an ASGI server would hand it over."""

    method: str
    raw_path: bytes
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name.lower().encode():
                return value
        return None

    def with_header(self, name: str, value: bytes | None) -> Wire:
        """Replace (or with None drop) a header, keeping the others in order."""
        key = name.lower().encode()
        kept = [(k, v) for k, v in self.headers if k != key]
        if value is not None:
            kept.append((key, value))
        return replace(self, headers=kept)

    def authenticate(self, now: datetime | float = NOW, **kwargs: Any) -> AuthResult:
        return authenticate(self.method, self.raw_path, self.query, self.headers, SECRETS.get, now=now, **kwargs)


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body

    def read(self, *_: Any) -> bytes:
        return self._body


@contextmanager
def frozen_clock(when: datetime = NOW) -> Iterator[None]:
    """botocore signs with this time (its pure-Python and its awscrt-backed signers alike)."""

    def clock(remove_tzinfo: bool = True) -> datetime:
        return when.replace(tzinfo=None) if remove_tzinfo else when

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("botocore.auth.get_current_datetime", clock))
        if importlib.util.find_spec("awscrt") is not None:
            stack.enter_context(mock.patch("botocore.crt.auth.get_current_datetime", clock))
        yield


@contextmanager
def botocore_signer(kind: str) -> Iterator[None]:
    """Make botocore clients sign with its pure-Python SigV4 ("python") or with awscrt ("crt")."""
    import botocore.auth

    if kind == "python":
        signers = {"s3v4": botocore.auth.S3SigV4Auth, "s3v4-query": botocore.auth.S3SigV4QueryAuth}
    else:
        import botocore.crt.auth

        signers = {"s3v4": botocore.crt.auth.CrtS3SigV4Auth, "s3v4-query": botocore.crt.auth.CrtS3SigV4QueryAuth}
    with mock.patch.dict(botocore.auth.AUTH_TYPE_MAPS, signers):
        yield


@functools.cache
def _session() -> Any:
    return botocore.session.get_session()


def make_client(
    endpoint: str = "http://gw.example:9000",
    *,
    response: tuple[int, dict[str, str], bytes] = (200, {}, b""),
    captured: list[AWSPreparedRequest] | None = None,
    **config: Any,
) -> Any:
    """A botocore S3 client whose requests never leave the process."""
    session = _session()
    config.setdefault("s3", {"addressing_style": "path"})
    client = session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET,
        config=Config(**{"retries": {"max_attempts": 1}, **config}),
    )
    status, headers, body = response

    def before_send(request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        if captured is not None:
            captured.append(request)
        return AWSResponse(request.url, status, headers, _Raw(body))

    client.meta.events.register("before-send.s3", before_send)
    return client


def wire_from_prepared(request: AWSPreparedRequest) -> Wire:
    parts = urlsplit(request.url)
    headers = [
        (name.lower().encode("latin-1"), value if isinstance(value, bytes) else value.encode("latin-1"))
        for name, value in request.headers.items()
    ]
    if not any(name == b"host" for name, _ in headers):  # the HTTP client adds it, as urllib3 does
        default = {"http": 80, "https": 443}[parts.scheme]
        host = parts.hostname or ""
        headers.append((b"host", (host if parts.port in (None, default) else f"{host}:{parts.port}").encode()))
    body = request.body
    if body is None:
        data = b""
    elif isinstance(body, bytes | bytearray):
        data = bytes(body)
    elif isinstance(body, str):
        data = body.encode()
    else:
        if hasattr(body, "seek"):
            body.seek(0)
        data = body.read()
    return Wire(request.method, parts.path.encode("latin-1"), parts.query.encode("latin-1"), headers, data)


def boto_wire(call: Callable[[Any], Any], endpoint: str = "http://gw.example:9000", **config: Any) -> Wire:
    """The request a botocore client sends for ``call(client)``, signed at ``NOW``."""
    captured: list[AWSPreparedRequest] = []
    client = make_client(endpoint, captured=captured, **config)
    # the canned answer may not parse for every operation: only the request matters
    with frozen_clock(), contextlib.suppress(Exception):
        call(client)
    assert captured, "botocore sent nothing"
    return wire_from_prepared(captured[-1])


def presigned_wire(url: str, method: str, host: str, body: bytes = b"") -> Wire:
    parts = urlsplit(url)
    return Wire(method, parts.path.encode(), parts.query.encode(), [(b"host", host.encode())], body)


def split_randomly(data: bytes, rng: random.Random, max_piece: int) -> list[bytes]:
    pieces = []
    pos = 0
    while pos < len(data):
        size = rng.randint(1, max_piece)
        pieces.append(data[pos : pos + size])
        pos += size
    return pieces


async def aiter_pieces(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def collect(stream: Any) -> bytes:
    out = io.BytesIO()
    async for piece in stream:
        out.write(piece)
    return out.getvalue()
