"""Settings of the S3 tier: one frozen value object, passed into ``S3Tier``'s constructor.

Kept apart from ``backends.s3`` so that reading configuration never imports aiobotocore. The gateway
nests it in its settings as ``s3: S3TierSettings | None``; with ``env_nested_delimiter="__"`` every
field is then settable as ``KVGW_S3__<FIELD>`` (``KVGW_S3__ENDPOINT_URL``, ``KVGW_S3__BUCKET``, ...).

Time budget of one operation, from the inside out: each HTTP attempt is bounded by
``connect_timeout`` / ``read_timeout`` (per socket operation), the tier makes at most ``max_attempts``
attempts with jittered exponential back-off (``retry_backoff`` doubling up to ``retry_backoff_max``),
and the whole operation (all attempts, and the body read) is cut at ``operation_timeout``. Those are the
background budgets: the lifecycle engine, write-through, prefetch, uploads.

A client waiting on the request path gets shorter ones (``backends.request_path``): a lookup (a
HEAD-class call: the footer read behind exists / prefix / HEAD / the pre-write check on an index miss)
must answer within ``lookup_timeout``, and any other call made while a request waits (the start of a
read of an S3-only chunk, a DELETE) must get its first answer within ``request_timeout``, at most
``request_max_attempts`` attempts included, ``request_retry_backoff`` apart. A dead endpoint (refused
connections) then costs milliseconds, a hung one at most those timeouts. Set ``lookup_timeout`` to a
few times the endpoint's p99 HEAD latency: every call cut by it counts as a failure for the breaker.

After ``breaker_threshold`` consecutive unavailability failures (errors, and calls that ran out of time:
a hung endpoint trips it too) the tier fails fast for ``breaker_cooldown`` seconds, then lets exactly
one probe through; every other call fails fast until the probe has answered.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

MiB = 1 << 20
S3_MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
S3_MAX_PART_SIZE = 5 * 1024 * MiB
_FLAGS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class S3TierSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket: str = Field(min_length=3, max_length=63)
    endpoint_url: str | None = None  # None: AWS's regional endpoint
    region: str = "us-east-1"
    access_key: str | None = None  # None (with secret_key None): botocore's default credential chain
    secret_key: SecretStr | None = None
    addressing_style: Literal["path", "virtual", "auto"] = "auto"
    verify_tls: bool | str = True  # or the path of a CA bundle
    connect_timeout: float = Field(default=3.0, gt=0)
    read_timeout: float = Field(default=15.0, gt=0)  # per socket read, not per request
    max_attempts: int = Field(default=3, ge=1, le=10)  # attempts per operation, first try included
    operation_timeout: float = Field(default=30.0, gt=0)  # overall deadline of one tier operation
    retry_backoff: float = Field(default=1.0, ge=0)  # first back-off (x0.5-1 jitter), doubling per retry
    retry_backoff_max: float = Field(default=20.0, ge=0)
    # the request path (a client is waiting): see the module docstring
    lookup_timeout: float = Field(default=0.05, gt=0)  # a lookup's footer read, all attempts
    request_timeout: float = Field(default=0.25, gt=0)  # first answer of any other call, all attempts
    request_max_attempts: int = Field(default=2, ge=1, le=10)
    request_retry_backoff: float = Field(default=0.01, ge=0)
    pool_size: int = Field(default=32, ge=1)  # max_pool_connections
    part_size: int = Field(default=8 * MiB, ge=S3_MIN_PART_SIZE, le=S3_MAX_PART_SIZE)
    parts_in_flight: int = Field(default=2, ge=1, le=16)  # per staged write: bounds its memory
    stat_concurrency: int = Field(default=16, ge=1)  # concurrent footer reads in stat_many / scan
    prefix: str = "chunks/"
    quarantine_prefix: str = "quarantine/"
    breaker_threshold: int = Field(default=5, ge=1)
    breaker_cooldown: float = Field(default=5.0, ge=0)
    # False for endpoints that ignore If-None-Match: publish then checks with a HEAD first, and two
    # writers racing between HEAD and write can both "win" (the later one's bytes stay).
    conditional_writes: bool = True
    create_bucket: bool = False  # create the bucket on first use (development, tests)

    @model_validator(mode="after")
    def _both_keys_or_neither(self) -> S3TierSettings:
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("set both access_key and secret_key, or neither (botocore's credential chain)")
        return self

    @field_validator("verify_tls", mode="before")
    @classmethod
    def _tls_flag(cls, value: object) -> object:
        """Environment variables are strings: "false" must mean False, not a CA bundle named "false"."""
        if isinstance(value, str) and value.strip().lower() in _FLAGS:
            return _FLAGS[value.strip().lower()]
        return value

    @field_validator("prefix", "quarantine_prefix")
    @classmethod
    def _relative(cls, value: str) -> str:
        if value.startswith("/"):
            raise ValueError("an object key prefix must not start with '/'")
        return value
