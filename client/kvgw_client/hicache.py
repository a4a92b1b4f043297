"""SGLang HiCache L3 over kvgw: the parts that need neither SGLang nor torch.

``kvgw_client.sglang.KvgwHiCacheStorage`` is the backend SGLang loads; this module holds what it is
made of and what can be tested without SGLang: its settings (the extra-config keys), the key rules
(copied from SGLang's own backends, so both name a page the same way), and the views over the host
pool's page buffers that pages are read into and written from.

Key rules (SGLang 0.5.23, ``HiCacheFile``, ``MooncakeStore`` and ``SeaweedFSStore`` agree on them):

* a page is named by SGLang's 64-hex chained page hash;
* the model name (``/`` -> ``-``) scopes it;
* non-MLA (MHA) models: every tensor-parallel rank holds different heads, so the TP rank and size
  are part of the name (``tp<r>of<n>``); MLA models (and DeepSeek V4's compressed MLA): every rank
  holds the same KV, so the name has no TP part, rank 0 writes and every rank reads;
* pipeline and context parallelism add ``pp<r>of<n>`` / ``cp<r>of<n>`` when their size is above 1.

The name is ``[<prefix>/]<model>/<scope...>/<page hash>``, exactly the object key SGLang's S3
backend (``seaweedfs``) uses, so pages written through kvgw's S3 API by that backend are read by this
one and back (their bytes are the page buffers back to back in both).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvgw_client.config import ClientSettings, SettingsReader, credentials_from_env, read_client_settings

DEFAULT_BUCKET = "kvcache"

FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys of SGLang's ``dynamic`` factory and cache controller that share the extra-config dict."""

SGLANG_KEYS = frozenset({
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
"""Keys SGLang's controller reads from the same dict (it removes them before the backend sees it;
tolerated anyway, so an SGLang that leaves them in does not trip the unknown-key check)."""

MAX_KEY_LEN = 900
"""Names longer than this are shortened the way SGLang's S3 backend shortens object keys."""


@dataclass(frozen=True)
class HiCacheSettings:
    """The backend's extra-config keys (docs/sglang.md), with the client's own."""

    client: ClientSettings
    prefix: str = ""  # extra name prefix, e.g. to separate deployments sharing a bucket
    ttl: int | None = None  # X-Kvgw-TTL on every page
    lookup_timeout: float = 2.0  # deadline of a batch_exists / exists call, seconds
    io_timeout: float = 10.0  # deadline of one batch of page reads or writes, seconds
    clear_timeout: float = 300.0  # deadline of clear()
    skip_existing: bool = True  # batch_set: one exists call first, send only missing pages
    parent_map_size: int = 1 << 16
    shared_prefix_tokens: int = 0  # pages within the first N tokens of a prompt are written retention "shared"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None, environ: Mapping[str, str]) -> HiCacheSettings:
        """Read every known key; an unknown key is an error (a misspelt key would otherwise be ignored)."""
        extra = dict(extra or {})
        reader = SettingsReader(extra, {"bucket": DEFAULT_BUCKET})
        access_key, secret_key = credentials_from_env(environ)
        client = read_client_settings(reader, access_key=access_key, secret_key=secret_key)
        ttl = reader.get_int("ttl_s", 0)
        settings = cls(
            client=client,
            prefix=(reader.get_str("prefix", "") or "").strip("/"),
            ttl=ttl if ttl > 0 else None,
            lookup_timeout=reader.get_float("lookup_timeout_s", cls.lookup_timeout),
            io_timeout=reader.get_float("io_timeout_s", cls.io_timeout),
            clear_timeout=reader.get_float("clear_timeout_s", cls.clear_timeout),
            skip_existing=reader.get_bool("skip_existing", cls.skip_existing),
            parent_map_size=reader.get_int("parent_map_size", cls.parent_map_size),
            shared_prefix_tokens=reader.get_int("shared_prefix_tokens", cls.shared_prefix_tokens),
        )
        unknown = [k for k in reader.leftover(extra) if k not in FACTORY_KEYS | SGLANG_KEYS]
        if unknown:
            raise ValueError(f"unknown kvgw HiCache settings: {', '.join(unknown)}")
        if min(settings.lookup_timeout, settings.io_timeout, settings.clear_timeout) <= 0:
            raise ValueError("lookup_timeout_s, io_timeout_s and clear_timeout_s must be positive")
        if settings.parent_map_size < 1:
            raise ValueError("parent_map_size must be at least 1")
        if settings.shared_prefix_tokens < 0:
            raise ValueError("shared_prefix_tokens must not be negative")
        return settings


@dataclass(frozen=True)
class RankScope:
    """The fields of SGLang's ``HiCacheStorageConfig`` that name a rank's pages."""

    model_name: str | None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False
    dcp_rank: int = 0

    @classmethod
    def of(cls, config: object) -> RankScope:
        """From a ``HiCacheStorageConfig`` (read by attribute name, so no SGLang import here)."""

        def get(name: str, default: int) -> int:
            value = getattr(config, name, default)
            return int(value) if value is not None else default

        model = getattr(config, "model_name", None)
        return cls(
            model_name=str(model) if model else None,
            tp_rank=get("tp_rank", 0), tp_size=get("tp_size", 1),
            pp_rank=get("pp_rank", 0), pp_size=get("pp_size", 1),
            cp_rank=get("attn_cp_rank", 0), cp_size=get("attn_cp_size", 1),
            is_mla=bool(getattr(config, "is_mla_model", False)),
            dcp_rank=get("dcp_rank", 0),
        )

    def parts(self) -> list[str]:
        """The model and rank components of a page's name (SGLang's rules, module docstring)."""
        parts = []
        if self.model_name:
            parts.append("-".join(self.model_name.split("/")))
        if not self.is_mla:
            parts.append(f"tp{self.tp_rank}of{self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        if self.cp_size > 1:
            parts.append(f"cp{self.cp_rank}of{self.cp_size}")
        return parts

    @property
    def is_writer(self) -> bool:
        """MLA: one rank (rank 0; the first of its DCP group) writes; every rank of other models does."""
        return not self.is_mla or self.tp_rank == self.dcp_rank


def name_prefix(prefix: str, scope: RankScope) -> str:
    """``[<prefix>/]<model>/<scope...>``: what every page name of this rank starts with (may be empty)."""
    return "/".join(([prefix.strip("/")] if prefix.strip("/") else []) + scope.parts())


def page_name(prefix: str, page_hash: str) -> str:
    """The kvgw key of a page (SGLang's S3 backend's object key for it)."""
    full = f"{prefix}/{page_hash}" if prefix else page_hash
    if len(full) <= MAX_KEY_LEN:
        return full
    return f"{full[:800]}/{hashlib.sha256(full.encode()).hexdigest()}"


def split_pages(
    addresses: Sequence[int], sizes: Sequence[int] | int, num_pages: int
) -> list[list[tuple[int, int]]]:
    """``get_page_buffer_meta``'s flat lists cut into ``(address, nbytes)`` buffers per page, in order.

    Page-first layouts give two buffers a page (its K and V), ``layer_first`` two per layer, MLA one;
    a page's bytes in kvgw are its buffers back to back.
    """
    if num_pages <= 0:
        return []
    if len(addresses) % num_pages:
        raise ValueError(f"{len(addresses)} buffers do not split into {num_pages} pages")
    size_list = [sizes] * len(addresses) if isinstance(sizes, int) else list(sizes)
    if len(size_list) != len(addresses):
        raise ValueError(f"{len(addresses)} buffer addresses but {len(size_list)} sizes")
    per_page = len(addresses) // num_pages
    return [
        [(int(addresses[j]), int(size_list[j])) for j in range(i * per_page, (i + 1) * per_page)]
        for i in range(num_pages)
    ]


def pointer_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address``, without a copy. The memory must outlive the
    view (the host pool's buffers live as long as SGLang's process)."""
    if nbytes < 0 or (address == 0 and nbytes):
        raise ValueError(f"bad buffer {address:#x}+{nbytes}")
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
