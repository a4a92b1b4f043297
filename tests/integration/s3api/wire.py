"""Hand-built S3 requests, signed by botocore's own SigV4 signer, for what no SDK call sends:
a bare LMCache-style path, a chosen Host header, a wrong digest, a truncated body."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.conftest import ROOT_AK, ROOT_SK

UNSIGNED = "UNSIGNED-PAYLOAD"


class _UnsignedPayloadAuth(S3SigV4Auth):
    """SigV4 with ``x-amz-content-sha256: UNSIGNED-PAYLOAD`` even over plain HTTP (as awscrt sends it)."""

    def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
        return False


def sign(method: str, url: str, headers: dict[str, str] | None = None, *, body: bytes | None = None,
         unsigned: bool = True, access_key: str = ROOT_AK, secret_key: str = ROOT_SK) -> dict[str, str]:
    """Headers (Host included) for ``method url`` signed as a client at ``url`` would sign them."""
    request = AWSRequest(method=method, url=url, headers=dict(headers or {}), data=body)
    if unsigned:
        request.headers["x-amz-content-sha256"] = UNSIGNED
    auth = _UnsignedPayloadAuth if unsigned else S3SigV4Auth
    auth(Credentials(access_key, secret_key), "s3", "us-east-1").add_auth(request)
    out = {k: v for k, v in request.headers.items()}
    parts = urlsplit(url)
    out.setdefault("Host", parts.netloc)
    return out


def send(server_url: str, method: str, path: str, *, host: str | None = None, headers: dict[str, str] | None = None,
         body: bytes | None = None, unsigned: bool = True, query: str = "", sent_body: bytes | None = None
         ) -> httpx.Response:
    """Sign for ``http://<host><path>?<query>`` and send it to ``server_url`` (which may differ: DNS-free
    virtual hosts). ``sent_body`` replaces the signed body on the wire (tampering)."""
    netloc = host or urlsplit(server_url).netloc
    target = f"{path}?{query}" if query else path
    signed = sign(method, f"http://{netloc}{target}", headers, body=body, unsigned=unsigned)
    with httpx.Client(timeout=30.0) as client:
        request = client.build_request(method, f"{server_url}{target}", headers=signed,
                                       content=body if sent_body is None else sent_body)
        request.headers["Host"] = netloc
        return client.send(request)


def raw_exchange(server_url: str, head: bytes, body: bytes, *, close_after_body: bool = True) -> bytes:
    """Send bytes on a raw socket (for bodies shorter than their Content-Length); return what came back."""
    parts = urlsplit(server_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(head + body)
        if close_after_body:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
        except OSError:
            pass
        return b"".join(chunks)


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
