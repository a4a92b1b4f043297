"""``kvgw_client.hicache``: the SGLang backend's settings, page names and page buffers, without SGLang."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from kvgw_client.hicache import (
    HiCacheSettings,
    RankScope,
    name_prefix,
    page_name,
    pointer_view,
    split_pages,
)

URL = {"url": "http://kvgw.internal:8080"}
FACTORY = {"backend_name": "kvgw", "module_path": "kvgw_client.sglang", "class_name": "KvgwHiCacheStorage",
           "interface_v1": 1}


def test_defaults() -> None:
    s = HiCacheSettings.from_extra_config({**FACTORY, **URL}, {})
    assert s.client.bucket == "kvcache" and s.client.access_key is None
    assert (s.prefix, s.ttl, s.lookup_timeout, s.io_timeout, s.clear_timeout, s.skip_existing) == \
        ("", None, 2.0, 10.0, 300.0, True)


def test_every_key() -> None:
    s = HiCacheSettings.from_extra_config({
        **URL, "bucket": "hicache", "access_key": "AK", "secret_key": "SK", "prefix": "/prod/", "ttl_s": "3600",
        "lookup_timeout_s": 1, "io_timeout_s": 5.5, "clear_timeout_s": 60, "skip_existing": "false",
        "parent_map_size": 10, "pool_size": 64, "write_concurrency": 16, "connect_timeout_s": 1,
        "prefetch_threshold": 256,
    }, {})
    assert (s.client.bucket, s.client.access_key, s.client.secret_key) == ("hicache", "AK", "SK")
    assert (s.prefix, s.ttl, s.lookup_timeout, s.io_timeout, s.clear_timeout) == ("prod", 3600, 1.0, 5.5, 60.0)
    assert not s.skip_existing and s.client.pool_size == 64 and s.client.write_concurrency == 16


def test_credentials_from_the_environment() -> None:
    s = HiCacheSettings.from_extra_config(URL, {"KVGW_ACCESS_KEY": "AK", "KVGW_SECRET_KEY": "SK"})
    assert (s.client.access_key, s.client.secret_key) == ("AK", "SK")


@pytest.mark.parametrize(("extra", "match"), [
    ({}, "url is required"),
    ({**URL, "acess_key": "x"}, "unknown kvgw HiCache settings: acess_key"),
    ({**URL, "io_timeout_s": 0}, "must be positive"),
    ({**URL, "access_key": "AK"}, "both access_key and secret_key"),
])
def test_bad_settings_fail(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HiCacheSettings.from_extra_config(extra, {})


def config(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = dict(model_name="Qwen/Qwen3-8B", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                   attn_cp_rank=0, attn_cp_size=1, is_mla_model=False, dcp_rank=0)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(("fields", "prefix", "writer"), [
    ({}, "Qwen-Qwen3-8B/tp0of1", True),
    ({"tp_rank": 3, "tp_size": 4}, "Qwen-Qwen3-8B/tp3of4", True),
    ({"pp_rank": 1, "pp_size": 2}, "Qwen-Qwen3-8B/tp0of1/pp1of2", True),
    ({"attn_cp_rank": 1, "attn_cp_size": 2}, "Qwen-Qwen3-8B/tp0of1/cp1of2", True),
    ({"is_mla_model": True, "tp_rank": 0, "tp_size": 8}, "Qwen-Qwen3-8B", True),
    ({"is_mla_model": True, "tp_rank": 5, "tp_size": 8}, "Qwen-Qwen3-8B", False),
    ({"model_name": None, "is_mla_model": True}, "", True),
])
def test_rank_scope(fields: dict[str, object], prefix: str, writer: bool) -> None:
    scope = RankScope.of(config(**fields))
    assert name_prefix("", scope) == prefix
    assert scope.is_writer is writer


def test_page_names() -> None:
    h = "0123456789abcdef" * 4
    scope = RankScope.of(config())
    assert page_name(name_prefix("prod", scope), h) == f"prod/Qwen-Qwen3-8B/tp0of1/{h}"
    assert page_name("", h) == h
    long = page_name("m" * 900, h)
    assert len(long) < 900 and long.startswith("m" * 800 + "/")


def test_split_pages() -> None:
    assert split_pages([10, 20, 30, 40], 5, 2) == [[(10, 5), (20, 5)], [(30, 5), (40, 5)]]
    assert split_pages([10, 20], [1, 2], 2) == [[(10, 1)], [(20, 2)]]
    assert split_pages([], [], 0) == []
    with pytest.raises(ValueError, match="do not split"):
        split_pages([1, 2, 3], 1, 2)
    with pytest.raises(ValueError, match="sizes"):
        split_pages([1, 2], [1], 2)


def test_pointer_view_writes_in_place() -> None:
    buf = (ctypes.c_char * 8)()
    view = pointer_view(ctypes.addressof(buf), 8)
    view[2:4] = b"hi"
    assert buf.raw == b"\0\0hi\0\0\0\0"
    assert len(pointer_view(0, 0)) == 0
    with pytest.raises(ValueError, match="bad buffer"):
        pointer_view(0, 8)
