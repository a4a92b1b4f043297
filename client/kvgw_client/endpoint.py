"""Where a gateway is, as the client's own connections (``kvgw_client.stream``, ``kvgw_client.calls``)
reach it: host, port, the ``Host`` header's authority, and the TLS context for https."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    authority: str  # the Host header's value
    tls: ssl.SSLContext | None  # None: plain TCP

    @classmethod
    def of(cls, url: str, ssl_context: ssl.SSLContext | bool) -> Endpoint:
        """``url``'s gateway; ``ssl_context`` as ``ClientSettings.ssl_context`` gives it (a context, True
        for the default checks, False for none)."""
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        tls = parts.scheme == "https"
        default_port = 443 if tls else 80
        port = parts.port or default_port
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        authority = shown if port == default_port else f"{shown}:{port}"
        context: ssl.SSLContext | None = None
        if tls:
            if isinstance(ssl_context, ssl.SSLContext):
                context = ssl_context
            else:
                context = ssl.create_default_context()
                if not ssl_context:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
        return cls(host, port, authority, context)

    @property
    def server_hostname(self) -> str | None:
        """The name TLS checks the certificate against (None without TLS)."""
        return self.host if self.tls is not None else None
