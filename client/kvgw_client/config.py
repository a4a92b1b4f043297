"""Settings of the kvgw client as value objects, and one parser for the flat dicts plugins receive.

LMCache hands a connector its settings as ``extra_config`` entries and an L2 adapter as
``adapter_params``: flat string-keyed dicts whose values may arrive as strings (YAML, environment) or
as numbers. ``SettingsReader`` turns such a dict into these objects, coercing and checking each value,
and reports keys nobody asked for so a typo fails loudly at start-up instead of being ignored.

Nothing here reads the environment; ``credentials_from_env`` is for the factories that build a client.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from kvgw_client import keys as keyrules

ENV_ACCESS_KEY = "KVGW_ACCESS_KEY"
ENV_SECRET_KEY = "KVGW_SECRET_KEY"


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``read`` bounds the silence between two reads of a response, so a large transfer that
    keeps moving never times out; ``control`` bounds a whole attempt of a small JSON call;
    ``transfer``, when set, bounds a whole attempt of a chunk GET/PUT."""

    connect: float = 2.0
    read: float = 10.0
    control: float = 5.0
    transfer: float | None = None

    def __post_init__(self) -> None:
        for name in ("connect", "read", "control"):
            if getattr(self, name) <= 0:
                raise ValueError(f"timeout {name} must be positive")
        if self.transfer is not None and self.transfer <= 0:
            raise ValueError("timeout transfer must be positive")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` counts the first try. Delays use full jitter: uniform in [0, min(max, base * 2**n)]."""

    attempts: int = 3
    backoff: float = 0.05
    backoff_max: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("retry attempts must be at least 1")
        if self.backoff < 0 or self.backoff_max < 0:
            raise ValueError("retry backoff must not be negative")

    def delay(self, retry: int, rand: float) -> float:
        """Delay before retry number ``retry`` (0-based); ``rand`` is uniform in [0, 1)."""
        return float(rand * min(self.backoff_max, self.backoff * 2.0**retry))


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """After ``failure_threshold`` consecutive failures the client fails fast for ``cooldown`` seconds,
    then probes ``probe_path``; each failed probe doubles the cooldown up to ``cooldown_max``."""

    failure_threshold: int = 3
    cooldown: float = 1.0
    cooldown_max: float = 30.0
    probe_path: str = "/readyz"

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if self.cooldown <= 0 or self.cooldown_max < self.cooldown:
            raise ValueError("need 0 < cooldown <= cooldown_max")
        if not self.probe_path.startswith("/"):
            raise ValueError("probe_path must start with '/'")


@dataclass(frozen=True, slots=True)
class ClientSettings:
    url: str
    bucket: str
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    timeouts: Timeouts = Timeouts()
    retry: RetryPolicy = RetryPolicy()
    health: HealthPolicy = HealthPolicy()
    pool_size: int = 32  # the I/O loop's connections per use (batch-get; JSON calls); see kvgw_client.calls
    write_concurrency: int = 8
    max_keys_per_call: int = 1000
    max_chunk_bytes: int = 1 << 30
    require_checksum: bool = True
    direct_read_root: str | None = None  # where this host mounts the gateway's fs tier (kvgw_client.direct)
    direct_read_threads: int = 4
    ca_bundle: str | None = None  # https: trust these CA certificates (PEM file) instead of the system's
    verify_tls: bool = True  # https: check the gateway's certificate (turn off only for a throwaway test)
    # lookups (exists, prefix, locate) read-lease what they find for this long, so the gateway's
    # lifecycle leaves it until it is loaded (the bucket caps it); 0: no lease
    lease_ms: int = 0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"kvgw url must be http(s)://host[:port], got {self.url!r}")
        if parts.query or parts.fragment:
            raise ValueError("kvgw url must not have a query or fragment")
        if not keyrules.is_valid_bucket_name(self.bucket):
            raise ValueError(f"invalid bucket name {self.bucket!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("give both access_key and secret_key, or neither (anonymous)")
        if self.access_key is not None and ":" in self.access_key:
            raise ValueError("access_key must not contain ':'")
        if self.pool_size < 1 or self.write_concurrency < 1 or self.max_keys_per_call < 1:
            raise ValueError("pool_size, write_concurrency and max_keys_per_call must be at least 1")
        if not 0 <= self.lease_ms <= MAX_LEASE_MS:
            raise ValueError(f"lease_ms must be 0 to {MAX_LEASE_MS}")
        if self.max_chunk_bytes < 1:
            raise ValueError("max_chunk_bytes must be positive")
        if self.direct_read_root is not None and not os.path.isabs(self.direct_read_root):
            raise ValueError("direct_read_root must be an absolute path")
        if self.direct_read_threads < 1:
            raise ValueError("direct_read_threads must be at least 1")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ValueError(f"ca_bundle {self.ca_bundle!r} is not a file")

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What the HTTP client uses for https: the CA bundle's context, the default (True), or no checks."""
        if not self.verify_tls:
            return False
        if self.ca_bundle is not None:
            return ssl.create_default_context(cafile=self.ca_bundle)
        return True


def credentials_from_env(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    return environ.get(ENV_ACCESS_KEY) or None, environ.get(ENV_SECRET_KEY) or None


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingsReader:
    """Typed, checked reads from a flat settings dict; ``leftover()`` names the keys never read.

    ``sources`` are looked up in order (the first that has a key wins): an instance-specific namespace
    before a shared one, for example.
    """

    def __init__(self, *sources: Mapping[str, object]) -> None:
        self._sources = sources
        self._read: set[str] = set()

    def _raw(self, key: str) -> object | None:
        self._read.add(key)
        for source in self._sources:
            if key in source and source[key] is not None:
                return source[key]
        return None

    def has(self, key: str) -> bool:
        return any(key in source and source[key] is not None for source in self._sources)

    def get_str(self, key: str, default: str | None = None) -> str | None:
        value = self._raw(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ValueError(f"setting {key} must be a string")
        return value

    def required_str(self, key: str) -> str:
        value = self.get_str(key)
        if not value:
            raise ValueError(f"setting {key} is required")
        return value

    def get_float(self, key: str, default: float) -> float:
        value = self._raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"setting {key} must be a number")
        try:
            return float(value)
        except ValueError as exc:
            raise ValueError(f"setting {key} must be a number, got {value!r}") from exc

    def get_optional_float(self, key: str) -> float | None:
        if self.has(key):
            return self.get_float(key, 0.0)
        self._read.add(key)
        return None

    def get_int(self, key: str, default: int) -> int:
        value = self._raw(key)
        if value is None:
            return default
        if isinstance(value, bool):
            raise ValueError(f"setting {key} must be an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError as exc:
                raise ValueError(f"setting {key} must be an integer, got {value!r}") from exc
        raise ValueError(f"setting {key} must be an integer")

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._raw(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"setting {key} must be a boolean, got {value!r}")

    def leftover(self, source: Mapping[str, object]) -> list[str]:
        return sorted(k for k in source if k not in self._read)


MAX_LEASE_MS = 600_000  # what the gateway accepts (its buckets cap what it grants)
ENGINE_LEASE_MS = 5_000  # the engines' default: a lookup's hits stay until loaded, up to 5 s


def read_client_settings(
    reader: SettingsReader, *, access_key: str | None = None, secret_key: str | None = None
) -> ClientSettings:
    """Build ClientSettings from the documented flat keys (see docs/lmcache-0.5.6-interfaces.md): the
    engine integrations' configuration, so lookups lease their hits by default (``lease_ms``, 5 s).

    ``access_key``/``secret_key`` are fallbacks (from the environment) for keys the dict lacks.
    """
    t, r, h = Timeouts(), RetryPolicy(), HealthPolicy()
    d = {f.name: f.default for f in fields(ClientSettings)}
    return ClientSettings(
        url=reader.required_str("url"),
        bucket=reader.required_str("bucket"),
        access_key=reader.get_str("access_key", access_key),
        secret_key=reader.get_str("secret_key", secret_key),
        timeouts=Timeouts(
            connect=reader.get_float("connect_timeout_s", t.connect),
            read=reader.get_float("read_timeout_s", t.read),
            control=reader.get_float("control_timeout_s", t.control),
            transfer=reader.get_optional_float("transfer_timeout_s"),
        ),
        retry=RetryPolicy(
            attempts=reader.get_int("retry_attempts", r.attempts),
            backoff=reader.get_float("retry_backoff_s", r.backoff),
            backoff_max=reader.get_float("retry_backoff_max_s", r.backoff_max),
        ),
        health=HealthPolicy(
            failure_threshold=reader.get_int("failure_threshold", h.failure_threshold),
            cooldown=reader.get_float("cooldown_s", h.cooldown),
            cooldown_max=reader.get_float("cooldown_max_s", h.cooldown_max),
            probe_path=reader.get_str("probe_path", h.probe_path) or h.probe_path,
        ),
        pool_size=reader.get_int("pool_size", _as_int(d["pool_size"])),
        write_concurrency=reader.get_int("write_concurrency", _as_int(d["write_concurrency"])),
        max_keys_per_call=reader.get_int("max_keys_per_call", _as_int(d["max_keys_per_call"])),
        max_chunk_bytes=reader.get_int("max_chunk_bytes", _as_int(d["max_chunk_bytes"])),
        require_checksum=reader.get_bool("require_checksum", d["require_checksum"] is True),
        direct_read_root=reader.get_str("direct_read_root") or None,
        direct_read_threads=reader.get_int("direct_read_threads", _as_int(d["direct_read_threads"])),
        ca_bundle=reader.get_str("ca_bundle") or None,
        verify_tls=reader.get_bool("verify_tls", d["verify_tls"] is True),
        lease_ms=reader.get_int("lease_ms", ENGINE_LEASE_MS),
    )


def _as_int(value: object) -> int:
    assert isinstance(value, int)
    return value
