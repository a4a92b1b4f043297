"""Settings: one value object, read once (in the CLI / app factory), then passed into constructors.

Sources, highest precedence first: command-line flags, ``KVGW_*`` environment variables, a TOML config
file (``--config FILE`` or ``KVGW_CONFIG``), defaults. Nested settings use ``__`` in variable names
(``KVGW_S3__ENDPOINT``). Nothing here is read at import time.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from backends.s3_settings import S3TierSettings

MiB = 1 << 20


class ConfigurationError(Exception):
    """The settings describe a deployment kvgw refuses to run (the message says why and what to do)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGW_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path("kvgw-data")
    # Where each part lives; defaults are under data_dir. The fs tier may be an NFS mount; the index
    # and a SQLite catalog must be on local disk.
    fs_root: Path | None = None
    s3: S3TierSettings | None = None  # the S3 tier (KVGW_S3__ENDPOINT_URL, KVGW_S3__BUCKET, ...); off if unset
    index_dir: Path | None = None
    catalog_url: str | None = None
    secret_key: SecretStr | None = None  # Fernet key for credential secrets; else secret_key_file
    secret_key_file: Path | None = None
    root_access_key: str | None = None
    root_secret_key: SecretStr | None = None

    anonymous: bool = False  # let unauthenticated requests act as root (local use only)
    default_bucket: str = "kvcache"
    max_chunk_bytes: int = 256 * MiB

    fsync: bool = True  # fsync chunk data and directory entries before a PUT is acknowledged
    verify_reads: bool = True  # check a chunk's checksum before serving its first byte
    whole_read_max_bytes: int = 16 * MiB  # chunks up to this size are read in one go, larger ones streamed
    read_window_bytes: int = 4 * MiB  # piece size when streaming
    read_buffer_budget_bytes: int = 256 * MiB  # bytes of whole-read buffers in flight across requests
    body_idle_timeout: float = 60.0  # seconds a PUT body may stall before the upload is dropped

    promote_on_read: bool = True  # a read of an S3-only chunk copies it into the filesystem tier first
    s3_lookup_on_miss: bool = True  # an index and filesystem miss asks S3 (chunks other gateways wrote)
    prefetch_concurrency: int = 8  # promotions running at once for POST .../prefetch
    write_through_max_pending: int = 100_000  # queued write-through copies; beyond it new writes are not
    # queued (counted in /v1/admin/stats): the chunk stays in the filesystem tier and is demoted, not
    # lost, if it is ever evicted
    lifecycle_interval: float = 1.0  # seconds between lifecycle passes
    lifecycle_budget: int = 256  # chunks a pass may expire, replicate or evict

    index_map_size: int = 1 << 30
    index_sync: bool = False
    index_allow_network_fs: bool = False
    catalog_refresh_seconds: float = 5.0
    staging_max_age_seconds: float = 3600.0

    # S3-compatible API (gateway.api.s3.app)
    s3_api_default_bucket: str | None = None  # bucket of bare-host requests (LMCache s3://host:port); default_bucket
    s3_api_base_domain: str = "localhost"  # virtual-hosted style: <bucket>.<base domain>[:port]; comma-separated
    s3_api_region: str = "us-east-1"  # GetBucketLocation answer; requests signed for any region are accepted
    s3_api_min_part_bytes: int = 5 * MiB  # every multipart part but the last must be at least this large
    s3_api_multipart_max_age_seconds: float = 7 * 86400.0  # uploads idle this long are swept away
    s3_api_sweep_interval_seconds: float = 600.0

    log_level: str = "info"
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

    @property
    def secret_key_path(self) -> Path:
        return self.secret_key_file or self.data_dir / "secret.key"

    @property
    def root_credentials_path(self) -> Path:
        return self.data_dir / "root-credentials"


class _TomlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
            self._data = doc.get("kvgw", doc)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from flags (``overrides``; None values ignored), env, config file, defaults."""
    path = config_file or (Path(os.environ["KVGW_CONFIG"]) if os.environ.get("KVGW_CONFIG") else None)

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
            return init_settings, env_settings, _TomlSource(settings_cls, path)

    values = {k: v for k, v in overrides.items() if v is not None}
    return _Settings(**values)

