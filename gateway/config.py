"""Settings: one value object, read once (in the CLI / app factory), then passed into constructors.

Sources, highest precedence first: command-line flags, ``KVGW_*`` environment variables, a TOML config
file (``--config FILE`` or ``KVGW_CONFIG``), defaults. Nested settings use ``__`` in variable names
(``KVGW_S3__ENDPOINT_URL``). Nothing here is read at import time.

Mistakes get one clear line each: an unknown ``KVGW_*`` variable or config-file key is reported (with
the setting it was probably meant to be, and where capacity really is set: per bucket) and ignored,
since the ``KVGW_`` namespace is shared with kvgw's client and tests; a value that does not parse, or a
config file that is missing, unreadable or not TOML, refuses the start (``ConfigurationError``, one line
per problem). ``postgres://`` and ``postgresql://`` catalog URLs mean PostgreSQL through psycopg.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import logging
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.s3_settings import S3TierSettings

MiB = 1 << 20


log = logging.getLogger("kvgw.config")

ENV_PREFIX = "KVGW_"
OTHER_VARIABLES = frozenset({
    "KVGW_CONFIG",  # the config file itself
    "KVGW_ACCESS_KEY", "KVGW_SECRET_KEY",  # kvgw's client (a user's credential; see catalog_key below)
    "KVGW_REQUIRE_SERVICES", "KVGW_TRACES_DIR", "KVGW_AWS_CLI",  # the test suite
})
"""``KVGW_*`` variables that are not gateway settings but are not mistakes either."""
OTHER_PREFIXES = ("KVGW_TEST_",)


class ConfigurationError(Exception):
    """The settings describe a deployment kvgw refuses to run (the message says why and what to do)."""


class SettingsError(ConfigurationError):
    """A setting's value does not parse; the message has one line per bad setting."""


def is_fernet_key(value: str | bytes) -> bool:
    """Whether ``value`` is a Fernet key (32 bytes, url-safe base64): what the catalog key must be."""
    try:
        return len(base64.urlsafe_b64decode(value)) == 32
    except (binascii.Error, ValueError):
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGW_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    data_dir: Path = Path("kvgw-data")
    # Where each part lives; defaults are under data_dir. The fs tier may be an NFS mount; the index
    # and a SQLite catalog must be on local disk.
    fs_root: Path | None = None
    s3: S3TierSettings | None = None  # the S3 tier (KVGW_S3__ENDPOINT_URL, KVGW_S3__BUCKET, ...); off if unset
    index_dir: Path | None = None
    catalog_url: str | None = None
    catalog_key: SecretStr | None = None  # Fernet key encrypting credential secrets in the catalog
    catalog_key_file: Path | None = None  # else this file (default <data-dir>/secret.key)
    secret_key: SecretStr | None = None  # deprecated name of catalog_key (clashes with the client's secret)
    secret_key_file: Path | None = None  # deprecated name of catalog_key_file
    root_access_key: str | None = None
    root_secret_key: SecretStr | None = None

    workers: int | None = Field(default=None, ge=1)  # worker processes; None: one per core on PostgreSQL, 1 on SQLite
    max_workers: int = 8  # the cap of the default above
    shutdown_grace_seconds: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    tls_cert: Path | None = None  # serve https: certificate chain (PEM); needs tls_key
    tls_key: Path | None = None
    anonymous: bool = False  # let unauthenticated requests read and write every bucket (local use only)
    anonymous_admin: bool = False  # ... and delete and administer too (implies anonymous)
    default_bucket: str = "kvcache"
    max_chunk_bytes: int = 256 * MiB
    default_capacity_fraction: float = 0.9  # a new bucket's fs-tier capacity: this share of the filesystem (0: none)

    fsync: bool = True  # fsync chunk data and directory entries before a PUT is acknowledged
    # chunk data written around the page cache (O_DIRECT): a PUT costs ~0.3x the CPU, but a chunk's first read
    # comes from the disk and every later read costs ~1.75x (smaller page-cache folios): off by default, since
    # reads sit on time-to-first-token (BENCHMARKS.md, "kvgw bench first-read" and "kvgw bench io")
    fs_direct_writes: bool = False
    fs_visibility_seconds: float = 5.0  # how long an operation on a chunk file its directory lists but this host's
    # lookups do not see yet (another host created it after a lookup here: NFS/FUSE negative caches) retries
    verify_reads: bool = True  # check a chunk's checksum before serving its first byte (to readers that do not)
    # chunk bytes for readers that verify them: "auto" sendfile(2) to peers off this host, a populated mapping
    # written to loopback peers (cheaper there: BENCHMARKS.md, "kvgw bench io"); "always"; "never"
    send_files: Literal["auto", "always", "never"] = "auto"
    loop_stall_seconds: float = 1.0  # log where the event loop is when it runs nothing this long (0: no watch)
    # answer index-only HEAD / exists / prefix inside the HTTP protocol (gateway.dataplane.lane)
    lookup_lane: bool = True
    whole_read_max_bytes: int = 16 * MiB  # chunks up to this size are read in one go, larger ones streamed
    read_window_bytes: int = 4 * MiB  # piece size when streaming
    read_buffer_budget_bytes: int = 128 * MiB  # chunk bytes all reads may hold at once (gateway.read_budget)
    body_idle_timeout: float = 60.0  # seconds a PUT body may stall before the upload is dropped
    header_timeout: float = 10.0  # seconds for a request head to arrive complete (slow clients are closed)
    idle_timeout: float = 30.0  # seconds a keep-alive connection may wait for its next request
    max_connections: int = 10_000  # open connections per worker process; past it: 503 and close
    max_connections_per_client: int = 1_000  # open connections from one client address per worker process

    promote_on_read: bool = True  # a read of an S3-only chunk copies it into the filesystem tier first
    s3_lookup_on_miss: bool = True  # an index and filesystem miss asks S3 (chunks other gateways wrote)
    prefetch_concurrency: int = 8  # promotions running at once for POST .../prefetch
    write_through_max_pending: int = 100_000  # queued write-through copies; beyond it new writes are not
    # queued (counted in /v1/admin/stats): the chunk stays in the filesystem tier and is demoted, not
    # lost, if it is ever evicted
    lifecycle_interval: float = 1.0  # seconds between lifecycle passes
    lifecycle_budget: int = 256  # chunks a pass may expire, replicate or evict
    lifecycle_lease_seconds: float = 5.0  # the lifecycle leader's lease; a dead leader is replaced within ~1.3x
    lifecycle_state_save_seconds: float = 10.0  # how often the leader keeps what the policies learnt in the catalog
    # read leases are granted in memory; each process writes them this often (and at once when the
    # lifecycle leader asks), and grants only within 4x this of its last write (gateway.leases)
    lease_sync_seconds: float = 0.5

    index_map_size: int = 1 << 30
    index_sync: bool = False
    index_allow_network_fs: bool = False
    # reads are recorded in the index (last access, read count, marks a read clears) in one write
    # transaction this often: eviction sees a read at most this late
    index_touch_seconds: float = 1.0
    catalog_refresh_seconds: float = 5.0
    staging_max_age_seconds: float = 3600.0
    # the S3 tier's orphans (data objects no manifest names, stale multipart uploads): the lifecycle
    # leader lists the tier's prefix this often (the listing reads every object name)
    s3_staging_cleanup_seconds: float = 3600.0

    # Several gateways on one catalog (gateway.cluster): the change feed, usage ledger, members
    cluster_enabled: bool = True  # false: no feed, no shared usage, no membership (one gateway; benchmarks)
    cluster_flush_seconds: float = 0.1  # a feed batch is written this long after its first event...
    cluster_flush_events: int = 1000  # ...or as soon as this many events are queued
    cluster_read_flush_seconds: float = 1.0  # reads are aggregated and published this often
    cluster_max_queued_events: int = 100_000  # events held while the catalog is unreachable; past it: 503
    cluster_poll_seconds: float = 0.25  # the feed is read this often besides LISTEN wake-ups
    cluster_feed_channel: str = "kvgw_feed"  # PostgreSQL NOTIFY channel of the feed
    cluster_feed_retention_seconds: float = 86400.0  # events kept this long...
    cluster_feed_retention_events: int = 10_000_000  # ...and at most this many (a gateway further behind resyncs)
    cluster_trim_seconds: float = 60.0  # how often a member trims the feed
    cluster_snapshot_seconds: float = 600.0  # the leader shares an index snapshot this often (0: never, none used)
    cluster_heartbeat_seconds: float = 2.0  # members' heartbeat
    cluster_member_timeout_seconds: float = 15.0  # a member without heartbeat this long is shown down
    cluster_member_forget_seconds: float = 3600.0  # ... and its row deleted after this long
    cluster_usage_refresh_seconds: float = 1.0  # how often the shared usage ledger is read
    cluster_url: str | None = None  # this gateway's URL as other members and operators see it

    # S3-compatible API (gateway.api.s3.app)
    s3_api_default_bucket: str | None = None  # bucket of bare-host requests (LMCache s3://host:port); default_bucket
    s3_api_base_domain: str = "localhost"  # virtual-hosted style: <bucket>.<base domain>[:port]; comma-separated
    s3_api_region: str = "us-east-1"  # GetBucketLocation answer; requests signed for any region are accepted
    s3_api_min_part_bytes: int = 5 * MiB  # every multipart part but the last must be at least this large
    s3_api_multipart_max_age_seconds: float = 7 * 86400.0  # uploads idle this long are swept away
    s3_api_sweep_interval_seconds: float = 600.0

    log_level: str = "info"
    log_format: str = "text"  # or "json": one object per line, with the request id
    access_log: bool = False

    @property
    def fs_root_path(self) -> Path:
        return self.fs_root or self.data_dir / "fs"

    @property
    def s3_default_bucket(self) -> str:
        return self.s3_api_default_bucket or self.default_bucket

    @property
    def index_path(self) -> Path:
        return self.index_dir or self.data_dir / "index"

    @property
    def catalog_dsn(self) -> str:
        return self.catalog_url or f"sqlite:///{(self.data_dir / 'catalog.sqlite').resolve()}"

    @field_validator("catalog_url")
    @classmethod
    def _psycopg_url(cls, url: str | None) -> str | None:
        """``postgres://`` / ``postgresql://`` (as libpq, Heroku and most docs write them) mean psycopg 3."""
        if url is None:
            return None
        for scheme in ("postgres://", "postgresql://"):
            if url.startswith(scheme):
                return "postgresql+psycopg://" + url.removeprefix(scheme)
        return url

    @property
    def catalog_key_path(self) -> Path:
        return self.catalog_key_file or self.secret_key_file or self.data_dir / "secret.key"

    def given_catalog_key(self) -> bytes | None:
        """The catalog key given by setting (not by file), or None.

        ``secret_key`` (``KVGW_SECRET_KEY``) is honoured, with a deprecation warning, only when it is a
        Fernet key: on a host that also runs kvgw's client it holds a user's secret instead.
        """
        if self.catalog_key is not None:
            return self.catalog_key.get_secret_value().encode()
        if self.secret_key is not None and is_fernet_key(self.secret_key.get_secret_value()):
            log.warning("KVGW_SECRET_KEY as the catalog key is deprecated: rename it KVGW_CATALOG_KEY "
                        "(KVGW_SECRET_KEY is the client's secret key)")
            return self.secret_key.get_secret_value().encode()
        return None

    @property
    def root_credentials_path(self) -> Path:
        return self.data_dir / "root-credentials"


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings table of a TOML config file (its ``[kvgw]`` table if it has one, else the whole
    document). ConfigurationError, one line, when the file is missing, unreadable or not TOML; unknown
    keys are reported (``report_unknown_keys``) and ignored."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigurationError(f"config file {path} (--config or KVGW_CONFIG) does not exist") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"config file {path} is not valid TOML: {exc}") from None
    table = doc.get("kvgw", doc)
    if not isinstance(table, dict):
        raise ConfigurationError(f"config file {path}: [kvgw] must be a table of settings")
    report_unknown_keys(table, path, outside=[k for k in doc if k != "kvgw"] if table is not doc else [])
    return table


class _TomlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from flags (``overrides``; None values ignored), env, config file, defaults."""
    path = config_file or (Path(os.environ["KVGW_CONFIG"]) if os.environ.get("KVGW_CONFIG") else None)
    report_unknown_variables(os.environ)
    table = {} if path is None else read_config_file(path)

    class _Settings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, _TomlSource(settings_cls, table)

    values = {k: v for k, v in overrides.items() if v is not None}
    try:
        return _Settings(**values)
    except ValidationError as exc:
        raise SettingsError("\n".join(_one_line(e) for e in exc.errors())) from None


def _one_line(error: Mapping[str, Any]) -> str:
    name = "__".join(str(part) for part in error["loc"]).upper()
    return f"bad setting {ENV_PREFIX}{name}={error.get('input')!r}: {error['msg']}"


def known_variables() -> set[str]:
    """Every ``KVGW_*`` variable that is a setting (nested S3 tier settings included)."""
    names = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    names |= {f"{ENV_PREFIX}S3__{name.upper()}" for name in S3TierSettings.model_fields}
    return names


def known_keys() -> set[str]:
    """Every config-file key that is a setting: ``port``, ``s3.endpoint_url``, ..."""
    return set(Settings.model_fields) | {f"s3.{name}" for name in S3TierSettings.model_fields}


def suggestion(name: str, known: Iterable[str], *, separator: str = "_") -> str:
    """What an unknown setting ``name`` gets after "ignored": `` (did you mean X?)`` for the closest
    real setting, or where capacity is set when the name looks like capacity; "" for neither.

    Matched without the ``KVGW_`` prefix (which every name shares, so ``KVGW_CAPACTY`` would otherwise
    look like ``KVGW_PORT``): the closest whole name; else, for a name with a word like "capacity", the
    bucket setting it must have meant; else the name with the word closest to one of this name's words
    (``LOOKUP_TIMOUT`` -> ``S3__LOOKUP_TIMEOUT``).
    """
    prefix = ENV_PREFIX if name.upper().startswith(ENV_PREFIX) else ""
    bare = name[len(prefix):].upper()
    candidates = {k[len(prefix):].upper(): k for k in known}
    guess = difflib.get_close_matches(bare, list(candidates), n=1, cutoff=0.75)
    if guess:
        return f" (did you mean {candidates[guess[0]]}?)"
    words = [w for w in bare.replace(".", separator).split(separator) if len(w) >= 4]
    if any(difflib.SequenceMatcher(None, word, "CAPACITY").ratio() >= 0.8 for word in words):
        default = candidates.get("DEFAULT_CAPACITY_FRACTION", "default_capacity_fraction")
        return (" (capacity is a bucket setting: kvgw bucket create|update NAME --capacity-bytes N; "
                f"{default} sets a new bucket's default)")
    best = (0.8, "")
    for candidate in sorted(candidates):
        for word in words:
            for other in candidate.replace(".", separator).split(separator):
                ratio = difflib.SequenceMatcher(None, word, other).ratio()
                if ratio > best[0] or (ratio == best[0] and best[1] == ""):
                    best = (ratio, candidate)
    return f" (did you mean {candidates[best[1]]}?)" if best[1] else ""


def report_unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Warn once per ``KVGW_*`` variable that is no setting (it is ignored); returns the warnings."""
    known = known_variables()
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if (not upper.startswith(ENV_PREFIX) or upper in known or upper in OTHER_VARIABLES
                or upper.startswith(OTHER_PREFIXES)):
            continue
        lines.append(f"unknown setting {name} ignored{suggestion(upper, known)}")
    for line in lines:
        log.warning(line)
    return lines


def report_unknown_keys(table: Mapping[str, Any], path: Path, *, outside: Iterable[str] = ()) -> list[str]:
    """Warn once per key of a config file's settings table that is no setting (it is ignored), the same
    rule as for variables; ``outside``: top-level keys beside a ``[kvgw]`` table. Returns the warnings."""
    known = known_keys()
    found = []
    for key, value in table.items():
        if key == "s3" and isinstance(value, dict):
            found += [f"s3.{sub}" for sub in value if f"s3.{sub}" not in known]
        elif key not in known:
            found.append(key)
    lines = [f"unknown setting {key} in {path} ignored{suggestion(key, known)}" for key in sorted(found)]
    lines += [f"{key} in {path} ignored: the settings are in its [kvgw] table" for key in sorted(outside)]
    for line in lines:
        log.warning(line)
    return lines

