"""Pinned LMCache surface: fails when LMCache changes what our connector and L2 adapter implement.

In the spirit of aiobotocore's ``test_patches.py``: the shapes below were read from LMCache 0.5.6, and
what 0.5.7rc2 changed is pinned beside them (``V057``); the test runs against whichever is installed
(CI runs it with both: the project's environment and ``.ci/.venv-lmcache057``). When one changes,
re-read the upstream code (docs/lmcache-0.5.6-interfaces.md says where, §5 for 0.5.7), adapt
``client/kvgw_client/lmcache/connector.py`` / ``l2_adapter.py``, then update the pin.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from tests.requirements import require_or_skip

try:
    from lmcache.v1.distributed.l2_adapters import native_plugin_l2_adapter, plugin_l2_adapter
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import NativeConnectorL2Adapter
    from lmcache.v1.storage_backend import remote_backend
    from lmcache.v1.storage_backend.connector import ConnectorContext, ConnectorManager, DynamicConnectorAdapter
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector
except ImportError as exc:
    require_or_skip(f"LMCache is not installed (.ci/install-lmcache.sh): {exc}")

from kvgw_client.lmcache import connector as lmcache_connector
from kvgw_client.lmcache import l2_adapter

Shape = tuple[bool, tuple[str, ...]]
VERSION = importlib.metadata.version("lmcache")
V057 = VERSION.startswith("0.5.7")
SUPPORTED = ("0.5.6", "0.5.7rc2")


def shape(fn: Callable[..., Any]) -> Shape:
    """(is coroutine function, parameters after self as ``name`` or ``name=default``)."""
    params = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        params.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return inspect.iscoroutinefunction(fn), tuple(params)


REMOTE_CONNECTOR: dict[str, Shape] = {
    "__init__": (False, ("config", "metadata")),
    "exists": (True, ("key",)),
    "exists_sync": (False, ("key",)),
    "get": (True, ("key",)),
    "put": (True, ("key", "memory_obj")),
    "list": (True, ()),
    "close": (True, ()),
    "ping": (True, ()),
    "support_ping": (False, ()),
    "batched_get": (True, ("keys",)),
    "support_batched_get": (False, ()),
    "batched_put": (True, ("keys", "memory_objs")),
    "support_batched_put": (False, ()),
    "batched_async_contains": (True, ("lookup_id", "keys", "pin=False")),
    "support_batched_async_contains": (False, ()),
    "batched_get_non_blocking": (True, ("lookup_id", "keys")),
    "support_batched_get_non_blocking": (False, ()),
    "batched_contains": (False, ("keys",)),
    "support_batched_contains": (False, ()),
    "remove_sync": (False, ("key",)),
    "reshape_partial_chunk": (False, ("memory_obj", "bytes_read")),
    "post_init": (False, ()),
}
REMOTE_CONNECTOR_ABSTRACT = {"close", "exists", "exists_sync", "get", "list", "put"}
BASE_ATTRIBUTES_USED = ("save_chunk_meta", "meta_shapes", "meta_dtypes", "meta_fmt", "full_chunk_size_bytes",
                        "single_token_size", "remote_metadata_bytes")

L2_ADAPTER: dict[str, Shape] = {
    "__init__": (False, ("max_capacity_bytes=0",)),
    "get_store_event_fd": (False, ()),
    "get_lookup_and_lock_event_fd": (False, ()),
    "get_load_event_fd": (False, ()),
    "submit_store_task": (False, ("keys", "objects")),
    "pop_completed_store_tasks": (False, ()),
    "submit_lookup_and_lock_task": (False, ("keys", "group_layout_descs")),
    "query_lookup_and_lock_result": (False, ("task_id",)),
    "submit_unlock": (False, ("keys",)),
    "submit_load_task": (False, ("keys", "objects")),
    "query_load_result": (False, ("task_id",)),
    "delete": (False, ("keys",)),
    "report_status": (False, ()),
    "close": (False, ()),
}
L2_ABSTRACT = {
    "close", "get_load_event_fd", "get_lookup_and_lock_event_fd", "get_store_event_fd", "pop_completed_store_tasks",
    "query_load_result", "query_lookup_and_lock_result", "submit_load_task", "submit_lookup_and_lock_task",
    "submit_store_task", "submit_unlock",
}
NATIVE_ADAPTER_INIT: Shape = (
    False,
    ("native_client", "max_capacity_gb=0", "type_name=''", "extra_status=None", "pad_buffers_to_alignment=False"),
)
if V057:  # what 0.5.7rc2 changed on the L2 side
    L2_ADAPTER = {**L2_ADAPTER, "get_memory_tags": (False, ()), "submit_touch": (False, ("keys",))}
    L2_ABSTRACT = L2_ABSTRACT | {"get_memory_tags"}
    NATIVE_ADAPTER_INIT = (False, ("native_client", "memory_tags", *NATIVE_ADAPTER_INIT[1][1:]))
NATIVE_CLIENT_REQUIRED = {"event_fd", "submit_batch_get", "submit_batch_set", "submit_batch_exists",
                          "drain_completions", "close"}


@pytest.mark.parametrize("name", sorted(REMOTE_CONNECTOR))
def test_remote_connector_method_shapes_are_pinned(name: str) -> None:
    assert shape(getattr(RemoteConnector, name)) == REMOTE_CONNECTOR[name]


def test_remote_connector_abstract_methods_are_pinned() -> None:
    assert set(RemoteConnector.__abstractmethods__) == REMOTE_CONNECTOR_ABSTRACT
    assert not getattr(lmcache_connector.KvgwConnector, "__abstractmethods__", set())


@pytest.mark.parametrize("name", sorted(set(REMOTE_CONNECTOR) - {"__init__"}))
def test_our_overrides_match_upstream(name: str) -> None:
    ours = lmcache_connector.KvgwConnector.__dict__.get(name)
    if ours is None:
        return  # inherited
    assert shape(ours) == REMOTE_CONNECTOR[name], f"KvgwConnector.{name} drifted from RemoteConnector.{name}"


def test_base_class_attributes_we_read_are_set_by_its_init() -> None:
    source = inspect.getsource(RemoteConnector.__init__)
    for attribute in BASE_ATTRIBUTES_USED:
        assert f"self.{attribute}" in source, attribute


def test_dynamic_adapter_constructs_with_keywords_we_accept() -> None:
    seen: dict[str, Any] = {}

    class Probe:
        def __init__(self, **kwargs: Any) -> None:
            seen.update(kwargs)

    context = ConnectorContext("plugin://kvgw", loop=object(), local_cpu_backend=object(), config=object(),  # type: ignore[arg-type]
                               metadata=None, plugin_name="kvgw")
    DynamicConnectorAdapter("kvgw", Probe).create_connector(context)
    assert set(seen) == {"loop", "local_cpu_backend", "config"}
    params = inspect.signature(lmcache_connector.KvgwConnector.__init__).parameters
    assert set(seen) <= set(params)


def test_our_adapter_claims_only_kvgw_plugin_urls() -> None:
    adapter = lmcache_connector.KvgwConnectorAdapter()
    assert adapter.can_parse("plugin://kvgw") and adapter.can_parse("plugin://kvgw.primary")
    assert not adapter.can_parse("plugin://kvgwx") and not adapter.can_parse("plugin://fs")
    assert shape(type(adapter).create_connector) == (False, ("context",))


@pytest.mark.parametrize(
    "name", [n for n in REMOTE_CONNECTOR if n.startswith("support_") or n in ("batched_contains", "ping")]
)
def test_instrumented_wrapper_forwards_what_we_rely_on(name: str) -> None:
    # A capability the wrapper stops forwarding would silently fall back to the base default.
    assert name in InstrumentedRemoteConnector.__dict__, f"InstrumentedRemoteConnector no longer forwards {name}"


@pytest.mark.parametrize("name", sorted(L2_ADAPTER))
def test_l2_adapter_interface_shapes_are_pinned(name: str) -> None:
    assert shape(getattr(L2AdapterInterface, name)) == L2_ADAPTER[name]


def test_l2_abstract_methods_and_native_wrapper_are_pinned() -> None:
    assert set(L2AdapterInterface.__abstractmethods__) == L2_ABSTRACT
    assert shape(NativeConnectorL2Adapter.__init__) == NATIVE_ADAPTER_INIT
    assert not getattr(l2_adapter.KvgwL2Adapter, "__abstractmethods__", set())


def _list_literal(func: Callable[..., Any], variable: str) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            return {ast.literal_eval(elt) for elt in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError(f"{variable} not found in {func.__name__}")


def test_native_plugin_required_methods_are_pinned_and_implemented() -> None:
    required = _list_literal(native_plugin_l2_adapter._create_native_plugin_l2_adapter, "required_methods")
    assert required == NATIVE_CLIENT_REQUIRED
    for name in required | {"submit_batch_delete"}:
        assert callable(getattr(l2_adapter.KvgwNativeClient, name, None)), name
    source = inspect.getsource(native_plugin_l2_adapter._create_native_plugin_l2_adapter)
    assert "connector_cls(**config.adapter_params)" in source


def test_plugin_factory_finds_our_config_class() -> None:
    config = plugin_l2_adapter.PluginL2AdapterConfig("kvgw_client.lmcache.l2_adapter", "KvgwL2Adapter", {})
    module = importlib.import_module("kvgw_client.lmcache.l2_adapter")
    found = plugin_l2_adapter._resolve_config_class(module, config, l2_adapter.KvgwL2Adapter)
    assert found is l2_adapter.KvgwL2AdapterConfig
    params = list(inspect.signature(l2_adapter.KvgwL2Adapter.__init__).parameters)
    assert params[:3] == ["self", "config", "l1_memory_desc"]


def test_the_installed_lmcache_is_one_we_support() -> None:
    assert VERSION in SUPPORTED


def test_module_homes_of_what_we_import() -> None:
    """0.5.7 moved the in-process protocol and event manager under lmcache.inprocess; kvgw imports from
    either, and here is where each version keeps them."""
    protocol = "lmcache.inprocess.v1.protocol" if V057 else "lmcache.v1.protocol"
    events = "lmcache.inprocess.v1.event_manager" if V057 else "lmcache.v1.event_manager"
    assert lmcache_connector.RemoteMetadata is importlib.import_module(protocol).RemoteMetadata
    assert hasattr(importlib.import_module(events), "EventManager")
    from gateway.bench import lmcache_engine

    assert lmcache_engine.EventManager is importlib.import_module(events).EventManager


def test_key_string_helper_we_reuse() -> None:
    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=bytes(range(16)), model_name="org/m", kv_rank=3, object_group_id=2)
    assert l2_adapter._object_key_to_string(key) == f"org/m@00000003@2@{bytes(range(16)).hex()}"


def test_our_l2_adapter_gives_the_wrapper_what_it_takes() -> None:
    takes_tags = "memory_tags" in inspect.signature(NativeConnectorL2Adapter.__init__).parameters
    assert takes_tags == V057 == l2_adapter._native_wrapper_takes_memory_tags()
    assert (l2_adapter.MEMORY_TAGS is not None) == V057
    if V057:
        source = inspect.getsource(native_plugin_l2_adapter._create_native_plugin_l2_adapter)
        assert "MemoryTags(MemorySegment.STORAGE, MemoryResidency.REMOTE)" in source  # what native_plugin says
        assert shape(l2_adapter.KvgwL2Adapter.submit_touch) == L2_ADAPTER["submit_touch"]


def test_remote_url_reaches_plugin_adapters_after_builtins() -> None:
    """``remote_url: http(s)://...`` works because ConnectorManager asks the adapters of
    ``remote_storage_plugins`` after its built-in ones and no built-in one takes http(s); and the plugin
    entry can decline to be a second backend because RemoteBackend lets IrrecoverableException through."""
    source = inspect.getsource(ConnectorManager.__init__)
    assert source.index("_remote_adapters_builtin_launcher()") < source.index("_remote_adapters_plugin_launcher(")
    manager = ConnectorManager.__new__(ConnectorManager)
    manager.adapters = []
    manager._remote_adapters_builtin_launcher()
    assert manager.adapters, "no built-in adapters found"
    for url in ("http://kvgw.internal:8080/kvcache", "https://kvgw.internal/kvcache"):
        assert not [type(a).__name__ for a in manager.adapters if a.can_parse(url)]
    init = inspect.getsource(remote_backend.RemoteBackend.init_connection)
    assert "except IrrecoverableException" in init and init.index("except IrrecoverableException") < init.index(
        "except Exception")
    assert issubclass(lmcache_connector.KvgwPluginEntryOnly, remote_backend.IrrecoverableException)
