"""How the LMCache connector and the L2 adapter read their settings (no gateway, no LMCache engine)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.requirements import require_or_skip

try:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
except ImportError as exc:
    require_or_skip(f"LMCache is not installed (.ci/install-lmcache.sh): {exc}")

from kvgw_client.lmcache.connector import ConnectorSettings
from kvgw_client.lmcache.l2_adapter import same_chain


def test_connector_settings_refuse_typos_and_take_per_instance_values() -> None:
    with pytest.raises(ValueError, match=r"kvgw.*settings: pool_sise"):
        ConnectorSettings.from_extra_config(
            {"kvgw.url": "http://gw", "kvgw.bucket": "kvcache", "kvgw.pool_sise": 1}, None, {}
        )
    per_instance = ConnectorSettings.from_extra_config(
        {"kvgw.url": "http://gw", "kvgw.bucket": "kvcache", "remote_storage_plugin.kvgw.b.bucket": "other",
         "remote_storage_plugin.kvgw.b.module_path": "x", "remote_storage_plugin.kvgw.b.class_name": "y"},
        "kvgw.b", {"KVGW_ACCESS_KEY": "AK", "KVGW_SECRET_KEY": "SK"},
    )
    assert per_instance.client.bucket == "other" and per_instance.client.access_key == "AK"


def test_l2_bad_params_fail_before_the_client_starts() -> None:
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    spec = {"type": "plugin", "module_path": "kvgw_client.lmcache.l2_adapter", "class_name": "KvgwL2Adapter",
            "adapter_params": {"bucket": "kvcache"}}
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    with pytest.raises(ValueError, match="url"):
        create_l2_adapter(config.adapters[0])


def test_same_chain_rule() -> None:
    assert same_chain("m@00000000@0@aa", "m@00000000@0@bb")
    assert not same_chain("m@00000000@0@aa", "m@00000000@1@bb")
    assert not same_chain("m@00000000@0@aa@salt1", "m@00000000@0@bb@salt2")
    assert same_chain("m@00000000@0@aa@s", "m@00000000@0@bb@s")
